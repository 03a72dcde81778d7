"""Every `keras-mhf` command of README.md and docs/command_line.md runs as
written, from a scratch directory, as a user types it.

The commands run in page order (the README's, then the command-line
page's), through `bash -c` (so quoting, globs and relative paths are the
shell's), each in a fresh process that must exit 0; later commands use what
earlier ones wrote (`runs/mhf/preset`). Those that use the README's run
(`runs/mhf`) run here, in one directory; the others, which stand alone, in
test_docs_commands_standalone.py (a module of its own, so that the two run
in parallel). The
directory holds small files under the pages' placeholder names
(`my_corpus.jsonl`, `tokenizer.model`, `piqa.jsonl`, ...), made from
English text that ships with Python. A ```bash block opts out only with
`<!-- not runnable: REASON -->` right before its fence (the bare
quickstart, which .ci/run runs as `bash tools/quickstart.sh`; lm-eval's
own downloads). One pass, under JAX: the commands start their own
processes.
"""

import gzip
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.evaluation.harness_rows import write_rows
from tests.test_docs import NOT_RUNNABLE
from tests.test_docs import code_blocks

PAGES = [REPO / "README.md", REPO / "docs" / "command_line.md"]
COMMAND_TIMEOUT_S = 900


def documented_commands(page, runnable_only=True):
    """The `keras-mhf ...` command lines of a page's ```bash blocks (the
    runnable ones unless `runnable_only=False`), continuation lines
    joined, comments dropped."""
    commands = []
    for _, language, code, before in code_blocks(page):
        if language != "bash" or (runnable_only and NOT_RUNNABLE.match(before)):
            continue
        for command in code.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command.startswith("keras-mhf "):
                commands.append(command)
    return commands


def write_placeholders(folder):
    """The pages' input files, small, from Python's bundled documentation
    (`pydoc_data.topics`: English prose, offline)."""
    import pydoc_data.topics

    from keras_mhf.pretraining import train_sentencepiece

    topics = pydoc_data.topics.topics
    texts = [topics[k].strip() for k in sorted(topics)]
    train, held_out = texts[:-20], texts[-20:]

    def jsonl(path, documents, opener=open):
        with opener(folder / path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in documents)

    jsonl("my_corpus.jsonl", train)
    jsonl("held_out.jsonl", held_out)
    jsonl("my_notes.jsonl", train[:60])
    for name in ("my_corpus", "books"):
        (folder / name).mkdir()
    jsonl("my_corpus/part_1.jsonl", train[: len(train) // 2])
    jsonl("my_corpus/part_2.jsonl", train[len(train) // 2 :])
    jsonl("books/a.jsonl.gz", train[:100], gzip.open)
    jsonl("books/b.jsonl.gz", train[100:200], gzip.open)
    (folder / "notes.txt").write_text("\n\n".join(train[200:260]))
    jsonl("lambada_test.jsonl", [" ".join(t.split()[:40]) for t in held_out])
    write_rows(str(folder), "piqa")
    write_rows(str(folder), "arc_easy")
    (folder / "card660.tsv").write_text(
        "loop\titeration\t3.5\nclass\tobject\t3.0\nfile\tmodule\t2.0\n"
        "string\tnumber\t1.0\n"
    )
    (folder / "new_tokens.txt").write_text("▁asyncio\n▁dataclass\n")
    train_sentencepiece(train, 1000, str(folder / "tokenizer.model"))


def write_expanded_tokenizer(folder):
    """`expanded.model`: the pretrained preset's tokenizer with two pieces
    appended, as `keras-mhf expand-vocabulary --tokenizer` expects."""
    from keras_mhf.expansion import append_pieces

    proto = (folder / "runs" / "mhf" / "tokenizer.model").read_bytes()
    expanded, _ = append_pieces(proto, ["▁asyncio", "▁dataclass"])
    (folder / "expanded.model").write_bytes(expanded)


def test_pages_have_commands():
    """Every command is documented (a block that does not run here, like
    the quickstart's, still documents it)."""
    commands = [
        c
        for page in PAGES
        for c in documented_commands(page, runnable_only=False)
    ]
    names = {c.split()[1] for c in commands}
    from keras_mhf.cli.main import COMMANDS

    assert set(COMMANDS) <= names, set(COMMANDS) - names


def uses_the_pretrained_run(command):
    """Whether a command reads or writes the run the README pretrains
    (`runs/mhf`: its preset, tokenizer, checkpoints); the others stand
    alone and run in a module of their own, beside these."""
    return "runs/mhf" in command or "expanded.model" in command


def run_documented_commands(folder, chosen):
    """Runs the pages' runnable commands for which `chosen(command)`, in
    page order, in `folder` (with `write_placeholders`' files), each through
    `bash -c` in a fresh process, as a user types it: each must exit 0
    without TensorFlow's start-up lines."""
    write_placeholders(folder)
    env = dict(os.environ, KERAS_BACKEND="jax")
    env["PATH"] = os.pathsep.join(
        [os.path.dirname(sys.executable), env.get("PATH", "")]
    )
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    ran = 0
    for page in PAGES:
        for command in filter(chosen, documented_commands(page)):
            if "expanded.model" in command:
                write_expanded_tokenizer(folder)
            started = time.monotonic()
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
            where = f"{page.name}: {command}"
            print(f"{time.monotonic() - started:6.1f} s  {where}")
            assert done.returncode == 0, f"{where}\n{done.stderr[-3000:]}"
            # No TensorFlow start-up lines from any command.
            assert "absl::InitializeLog" not in done.stderr, where
            assert "cuda" not in done.stderr.lower(), where
            ran += 1
    return ran


@pytest.mark.large
def test_documented_commands_of_the_pretrained_run(tmp_path):
    """The README's `pretrain` and every command that uses its run
    (`runs/mhf`), in page order; the others run in
    test_docs_commands_standalone.py, in parallel with these."""
    assert run_documented_commands(tmp_path, uses_the_pretrained_run) >= 10
