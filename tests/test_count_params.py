import subprocess
import sys

import pytest

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import count_parameters
from keras_mhf.models import standard_causal_lm
from keras_mhf.utils.keras_utils import count_trainable_parameters
from tests.conftest import REPO


@pytest.mark.parametrize(
    "name, millions",
    [
        ("1b", 1073.8),
        ("1b_h3b10k", 1077.1),
        ("1b_h4b16k", 1146.5),
        ("100m", 112.5),
        ("100m_h4b16k", 138.7),
    ],
)
def test_paper_counts(name, millions):
    assert round(count_parameters(name)["total"] / 1e6, 1) == millions


def test_standard_plus_layers():
    # The paper's parameter-matched controls for MHF H4B16K.
    assert (
        round(count_parameters("100m", extra_layers=4)["total"] / 1e6, 1)
        == 141.6
    )
    assert (
        round(count_parameters("1b", extra_layers=2)["total"] / 1e6, 1)
        == 1174.5
    )


def test_counts_equal_built_models(small_tokenizer):
    mhf = MultiHashFormerCausalLM.from_tokenizer(small_tokenizer, "tiny_h3b64")
    trainable = count_trainable_parameters(mhf)
    counted = count_parameters("tiny_h3b64", small_tokenizer.vocabulary_size())
    assert trainable == counted["total"]
    assert mhf.count_params() - trainable == (
        counted["signature_table_entries"] + counted["decoding_index_entries"]
    )
    std = standard_causal_lm(small_tokenizer, "tiny", extra_layers=2)
    assert (
        std.count_params()
        == count_parameters(
            "tiny", small_tokenizer.vocabulary_size(), extra_layers=2
        )["total"]
    )


def test_tool_prints_table():
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "count_params.py"),
            "1b_h4b16k",
            "100m",
            "--extra-layers",
            "4",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "1b_h4b16k+4L" in out and "100m+4L" in out and "141.6M" in out
