"""The documented `keras-mhf` commands that stand alone (the quickstart
with a corpus, `prepare`, `pretrain` from a prepared corpus, `inspect` of
architectures), run as written from a scratch directory: the other half of
tests/test_docs_commands.py, in a module of its own so that the two halves
run in parallel (the large step's pytest-xdist workers take a module
each)."""

import pytest

from tests.test_docs_commands import run_documented_commands
from tests.test_docs_commands import uses_the_pretrained_run


@pytest.mark.large
def test_documented_commands_that_stand_alone(tmp_path):
    ran = run_documented_commands(
        tmp_path, lambda command: not uses_the_pretrained_run(command)
    )
    assert ran >= 7
