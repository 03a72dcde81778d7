"""The `keras-mhf` command line (`keras_mhf/cli/`): the command list, every
subcommand's options with their defaults, and one smoke run of each
subcommand on a tiny model. The subcommands wrap the library functions that
the other test modules check on every backend, so these run once, under
JAX (`ONCE_PER_SUITE` in conftest.py)."""

import contextlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
from argparse import SUPPRESS
from pathlib import Path

import keras_hub
import numpy as np
import pytest

from keras_mhf.cli import main as cli
from tests.conftest import CORPUS
from tests.conftest import REPO
from tests.evaluation.harness_rows import write_rows
from tests.pretraining_helpers import RUN
from tests.pretraining_helpers import run_flags
from tests.pretraining_helpers import write_documents
from tests.pretraining_helpers import write_tokenizer


def run_cli(argv, capsys):
    """`keras-mhf ARGV` in this process: `(exit status, stdout, stderr)`."""
    capsys.readouterr()
    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exit:
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


def last_json(out):
    """The JSON document a subcommand printed last."""
    return json.loads(out[out.index("{") :])


def test_help_lists_every_command(capsys):
    status, out, _ = run_cli(["--help"], capsys)
    assert status == 0
    for name in cli.COMMANDS:
        assert f"  {name} " in out
    status, _, err = run_cli(["train"], capsys)
    assert status == 2
    assert err.strip() == (
        "keras-mhf: error: unknown command 'train'; choose one of "
        + ", ".join(cli.COMMANDS)
        + " (keras-mhf --help lists them)."
    )


def test_the_console_script_is_declared():
    text = (REPO / "pyproject.toml").read_text()
    assert 'keras-mhf = "keras_mhf.cli.main:console_main"' in text


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_option_has_help_and_its_default(name, capsys):
    module = importlib.import_module(f"keras_mhf.cli.{cli.COMMANDS[name][0]}")
    status, out, _ = run_cli([name, "--help"], capsys)
    assert status == 0
    assert out.startswith(f"usage: keras-mhf {name}")
    parser = _parser_of(module, capsys)
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{name}: {action.option_strings} has no help"
        for option in action.option_strings:
            assert option in out
        if action.default not in (None, False, [], True, SUPPRESS) and (
            action.option_strings
        ):
            # The formatter's "(default: X)", or the help's own wording.
            shown = f"(default: {action.default})" in " ".join(out.split())
            assert shown or "%(default" in action.help, (name, action.dest)


def _parser_of(module, capsys):
    """The subcommand's parser, as its `--help` built it."""
    import argparse

    built = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        built.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            module.main([], prog="x")
    finally:
        argparse.ArgumentParser.parse_args = original
    capsys.readouterr()
    return built[0]


def test_an_unexpected_error_is_one_line(capsys, tmp_path):
    broken = tmp_path / "broken_preset"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    status, _, err = run_cli(["inspect", "--preset", broken], capsys)
    assert status == 1
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("keras-mhf inspect: error: ")


@pytest.mark.parametrize(
    "command",
    ["evaluate", "export", "finetune", "expand-vocabulary", "inspect"],
)
def test_a_missing_preset_is_a_usage_error_that_says_what_to_give(
    command, capsys
):
    status, _, err = run_cli([command, "--preset", "missing"], capsys)
    assert status == 2
    assert (
        "argument --preset: 'missing' is not a directory; give a preset "
        "directory, e.g. runs/mhf/preset"
    ) in err


LIGHT_CHILD = """
import sys
sys.argv = ["keras-mhf"]  # the console script's name: the command line
from keras_mhf.cli import main
for argv in (["--help"], *([name, "--help"] for name in main.COMMANDS)):
    try:
        main.main(argv)
    except SystemExit:
        pass
print(sorted(m for m in ("keras", "tensorflow", "jax", "torch") if m in sys.modules))
"""


def test_help_loads_no_backend():
    """`keras-mhf --help` and every `keras-mhf COMMAND --help` answer before
    Keras and TensorFlow are imported (the package loads once a command's
    arguments parse)."""
    done = subprocess.run(
        [sys.executable, "-c", LIGHT_CHILD], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"
    assert done.stderr == ""


def test_a_command_prints_no_tensorflow_start_up_lines():
    if shutil.which("keras-mhf") is None:
        pytest.skip("the keras-mhf console script is not installed")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_MHF_QUIET_STARTUP")
    }
    done = subprocess.run(
        ["keras-mhf", "inspect", "--bytes", "tiny_h3b64"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tiny_h3b64" in done.stdout
    assert done.stderr == ""


def test_the_command_runs_on_jax_unless_told_otherwise(tmp_path):
    """Keras' own default (TensorFlow, from keras.json) is not the command's:
    it runs on JAX unless KERAS_BACKEND says otherwise, as the docs say, and
    `pretrain` names the backend on its first line."""
    if shutil.which("keras-mhf") is None:
        pytest.skip("the keras-mhf console script is not installed")
    keras_home = tmp_path / "keras_home"
    keras_home.mkdir()
    (keras_home / "keras.json").write_text('{"backend": "tensorflow"}')
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(keras_home)
    command = ["keras-mhf", "pretrain", "--data", "missing.jsonl", "--output"]
    done = subprocess.run(
        command + [str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout.splitlines()[0].startswith(
        "keras-mhf pretrain: Keras backend jax"
    ), done.stdout
    assert "missing.jsonl" in done.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`(root, preset)`: `keras-mhf prepare` then `keras-mhf pretrain` of a
    tiny MultiHashFormer, once for the module. The module's tests run in
    `root` and give the commands paths relative to it, as a user types
    them (`root` and `preset` are relative paths too)."""
    root = tmp_path_factory.mktemp("cli")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        write_documents(root / "docs.jsonl", count=120)
        write_tokenizer(root / "small.model")
        settings = dict(RUN, steps=2, checkpoint_every=2, validation_blocks=16)
        settings["verbose"] = 1  # progress on: lines, as output is no terminal
        out = io.StringIO()  # not a terminal: lines, not a progress bar
        with contextlib.redirect_stdout(out):
            assert (
                cli.main(
                    ["prepare", "--tokenizer", "small.model"]
                    + ["--output", "prepared", "--validation-fraction", "0.2"]
                    + ["--workers", "1", "--quiet", "docs.jsonl"]
                )
                == 0
            )
            assert (
                cli.main(
                    ["pretrain", "--data", "prepared", "--output", "run"]
                    + ["--compilation-cache", "none"]
                    + run_flags(settings)
                )
                == 0
            )
        assert "\r" not in out.getvalue() and "\x1b[" not in out.getvalue()
        assert "Steps 1-2 of 2" in out.getvalue()
        yield Path("."), Path("run") / "preset"


def test_pretrain_writes_a_preset(trained):
    _, preset = trained
    summary = json.loads((preset.parent / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert (preset / "config.json").exists()


def test_config_file_reruns_a_run(trained, capsys):
    """`OUTPUT/config.toml` holds the run's resolved settings: `--config`
    with it resumes the finished run (the same settings, so not refused),
    and with another `--output` retrains it to the same weights, bit for
    bit; a flag given with it overrides the file."""
    import tomllib

    root, preset = trained
    config = preset.parent / "config.toml"
    recorded = tomllib.loads(config.read_text())
    assert recorded["command"] == "pretrain"
    assert recorded["data"] == str((root / "prepared").resolve())
    assert recorded["steps"] == 2 and recorded["compilation_cache"] == "none"
    assert "keras-mhf pretrain --config" in config.read_text()
    status, out, err = run_cli(["pretrain", "--config", config], capsys)
    assert status == 0, err[-2000:]
    assert last_json(out)["status"] == "finished"
    status, out, err = run_cli(
        ["pretrain", "--config", config, "--output", "again"], capsys
    )
    assert status == 0, err[-2000:]
    summaries = [
        json.loads((folder / "summary.json").read_text())
        for folder in (preset.parent, root / "again")
    ]
    assert summaries[0]["validation"] == summaries[1]["validation"]
    first, second = (
        keras_hub.models.CausalLM.from_preset(str(path))
        for path in (preset, root / "again" / "preset")
    )
    for a, b in zip(first.get_weights(), second.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    again = tomllib.loads((root / "again" / "config.toml").read_text())
    assert again == dict(recorded, output_dir=str((root / "again").resolve()))
    # A flag overrides the file: other steps, so this output is refused.
    status, _, err = run_cli(
        ["pretrain", "--config", config, "--steps", "3"], capsys
    )
    assert status == 2
    assert "steps: 2 recorded, now 3" in err


def test_inspect_a_preset_and_architectures(trained, capsys):
    _, preset = trained
    status, out, _ = run_cli(["inspect", "--preset", preset], capsys)
    assert status == 0
    report = last_json(out)
    assert report["class"] == "MultiHashFormerCausalLM"
    assert report["num_hashes"] == 3 and report["num_buckets"] == 64
    signatures = report["signatures"]
    assert signatures["vocabulary_size"] == report["vocabulary_size"]
    assert signatures["duplicate_tokens"] == 0
    status, out, _ = run_cli(["inspect", "tiny_h3b64", "tiny"], capsys)
    assert status == 0 and "tiny_h3b64" in out


def test_evaluate_a_preset(trained, capsys):
    root, preset = trained
    lambada = root / "lambada.jsonl"
    lambada.write_text(
        "".join(json.dumps({"text": s}) + "\n" for s in CORPUS[:4])
    )
    piqa = write_rows(str(root), "piqa")
    status, out, err = run_cli(
        ["evaluate", "--preset", preset, "--lambada", lambada]
        + ["--task", f"piqa={piqa}", "--task", f"social_iqa={piqa}"]
        + ["--no-progress", "--output", root / "results.jsonl"],
        capsys,
    )
    assert status == 1 and f"{piqa}:1: siqa expects" in err
    status, out, _ = run_cli(
        ["evaluate", "--preset", preset, "--lambada", lambada]
        + ["--task", f"piqa={piqa}", "--delimiter", "\n"]
        + ["--no-progress", "--output", root / "results2.jsonl"],
        capsys,
    )
    assert status == 0
    results = last_json(out)
    metrics = results[f"lambada:{lambada}"]
    assert metrics["examples"] == 4 and 0 <= metrics["acc"] <= 1
    # A calibrated preset: its rule, and the paper's beside it.
    piqa_metrics = results[f"piqa:{piqa}"]
    assert set(piqa_metrics) == {
        "acc",
        "acc_norm",
        "examples",
        "paper_rule",
        "scoring_temperature",
    }
    assert set(piqa_metrics["paper_rule"]) == {"acc", "acc_norm"}
    status, out, err = run_cli(["evaluate", "--preset", preset], capsys)
    assert status == 2 and out == ""
    assert "nothing to evaluate: give --perplexity, --lambada" in err
    for bad in ("winogrande=x.jsonl", "piqa"):
        status, _, err = run_cli(
            ["evaluate", "--preset", preset, "--task", bad], capsys
        )
        assert status == 2 and f"--task '{bad}'" in err


def test_evaluate_errors_are_one_line(trained, capsys):
    from keras_mhf.utils.output_lock import output_lock

    root, preset = trained
    bad = root / "bad_lambada.jsonl"
    bad.write_text(json.dumps({"text": CORPUS[0]}) + '\n{"text": "word"}\n')
    status, _, err = run_cli(
        ["evaluate", "--preset", preset, "--lambada", bad, "--no-progress"],
        capsys,
    )
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert f"TaskFileError: {bad}:2: 'text' has a single word" in err
    from keras_mhf.evaluation import TaskFileWarning

    with pytest.warns(TaskFileWarning, match=f"{bad}:2: .*left out"):
        status, out, _ = run_cli(
            ["evaluate", "--preset", preset, "--lambada", bad]
            + ["--no-progress", "--on-error", "skip"],
            capsys,
        )
    assert status == 0
    assert last_json(out)[f"lambada:{bad}"]["skipped_lines"] == 1
    # A results file held by another process: the lock names the file.
    results = root / "locked.jsonl"
    with output_lock(str(root), "a test", lock_name=".locked.jsonl.lock"):
        status, _, err = run_cli(
            ["evaluate", "--preset", preset, "--lambada", bad, "--no-progress"]
            + ["--output", results],
            capsys,
        )
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert f"OutputLockedError: {results.resolve()} is being written by" in err


def test_finetune_a_preset(trained, capsys):
    root, preset = trained
    documents = write_documents(root / "notes.jsonl", count=60, seed=3)
    settings = dict(RUN, steps=1, checkpoint_every=1)
    for name in ("architecture",):
        settings.pop(name)
    status, out, err = run_cli(
        ["finetune", "--preset", preset, "--data", documents]
        + ["--output", root / "ft", "--lora-rank", "2", "--no-calibrate"]
        + ["--compilation-cache", "none", "--workers", "1"]
        + run_flags(settings),
        capsys,
    )
    assert status == 0, err[-2000:]
    assert (root / "ft" / "preset" / "config.json").exists()


def test_expand_vocabulary_of_a_preset(trained, capsys):
    root, preset = trained
    tokens = root / "new_tokens.txt"
    tokens.write_text("▁Zürich\n▁Ωmega\n\n")
    output = root / "expanded"
    status, out, err = run_cli(
        ["expand-vocabulary", "--preset", preset, "--tokens", tokens]
        + ["--output", output],
        capsys,
    )
    assert status == 0, err
    report = last_json(out)
    assert report["new_tokens"] == 2
    assert report["parameters"] == report["old_parameters"]
    import keras_hub

    lm = keras_hub.models.CausalLM.from_preset(str(output))
    vocabulary = lm.preprocessor.tokenizer.get_vocabulary()
    assert vocabulary[-2:] == ["▁Zürich", "▁Ωmega"]
    scores = np.asarray(lm.score(np.array([[1, len(vocabulary) - 1]])))
    assert np.isfinite(scores).all()
    # An existing output is refused, with what to do.
    status, _, err = run_cli(
        ["expand-vocabulary", "--preset", preset, "--tokens", tokens]
        + ["--output", output],
        capsys,
    )
    assert status == 2 and "--overwrite" in err


def test_export_a_preset(trained, capsys):
    _, preset = trained
    command = ["export", "--preset", preset, "--format", "transformers"]
    status, _, err = run_cli(command + ["--output", "hf"], capsys)
    assert status == 0, err
    config = json.loads(Path("hf", "config.json").read_text())
    assert config["num_hashes"] == 3
    status, _, err = run_cli(command + ["--output", "hf"], capsys)
    assert status == 2
    assert "hf exists; pass --overwrite to replace it" in err
    status, _, err = run_cli(
        command + ["--output", "hf", "--overwrite"], capsys
    )
    assert status == 0, err


# --- Issue #59: outputs over inputs, Hugging Face exports, bfloat16 -------


@pytest.fixture(scope="module")
def bfloat16_presets(tmp_path_factory):
    """`{"mhf", "standard"}`: tiny bfloat16 presets (saved as a run saves
    them, no training), and their tokenizer file, in a folder of their own."""
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import MultiHashFormerTokenizer
    from keras_mhf.models import standard_causal_lm
    from tests.conftest import small_proto_bytes

    root = tmp_path_factory.mktemp("bfloat16")
    tokenizer = MultiHashFormerTokenizer(small_proto_bytes())
    presets = {"root": root}
    for name, lm in (
        (
            "mhf",
            MultiHashFormerCausalLM.from_tokenizer(
                tokenizer, "tiny_h3b64", sequence_length=16, dtype="bfloat16"
            ),
        ),
        (
            "standard",
            standard_causal_lm(
                tokenizer, "tiny", sequence_length=16, dtype="bfloat16"
            ),
        ),
    ):
        lm.save_to_preset(str(root / name))
        presets[name] = root / name
    return presets


def _snapshot(folder):
    """Every file under `folder` with its size and modification time."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(Path(folder).rglob("*"))
    }


def test_an_output_over_its_input_is_refused_and_nothing_is_touched(
    bfloat16_presets, tmp_path, capsys
):
    """An output that is, lies inside or holds the input (symbolic links
    resolved) is a usage error before anything is written, for export (both
    formats), expand-vocabulary, finetune and quickstart."""
    preset = bfloat16_presets["mhf"]
    link = tmp_path / "link"
    link.symlink_to(preset)
    before = _snapshot(bfloat16_presets["root"])
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("▁Zürich\n")
    documents = write_documents(tmp_path / "notes.jsonl", count=20)
    for output, how in (
        (preset, "is"),
        (link, "is"),
        (preset / "hf", "lies inside"),
        (link / "assets", "lies inside"),
        (preset.parent, "holds"),
    ):
        how = "contains" if how == "holds" else how
        for command in (
            ["export", "--format", "transformers", "--preset", preset],
            ["export", "--format", "saved_model", "--preset", preset],
            ["expand-vocabulary", "--preset", preset, "--tokens", tokens],
            ["finetune", "--preset", preset, "--data", documents],
        ):
            status, _, err = run_cli(
                command + ["--output", output, "--overwrite"]
                if command[0] != "finetune"
                else command + ["--output", output],
                capsys,
            )
            assert status == 2, (command, output, err)
            assert (
                f"error: --output {output} {how} --preset {preset}: writing "
                "it would change or destroy the input"
            ) in err, err
            assert _snapshot(bfloat16_presets["root"]) == before
            assert not (preset / "hf").exists()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Some text.\n")
    for output in (corpus, corpus / "run", tmp_path):
        status, _, err = run_cli(
            ["quickstart", "--data", corpus, "--output", output], capsys
        )
        assert status == 2 and "--data" in err and "--output" in err, err
        assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"]


def test_hugging_face_exports_load_on_the_command_line(
    bfloat16_presets, capsys
):
    """`inspect`, `evaluate`, `export` and `expand-vocabulary` read an MHF
    and a Standard Hugging Face export (KerasHub's loader had no converter
    for the first and looked for Qwen's special tokens in the second), in
    the precision they were written in (bfloat16 stays bfloat16)."""
    root = bfloat16_presets["root"]
    text = root / "text.txt"
    text.write_text("\n\n".join(CORPUS))
    for name in ("mhf", "standard"):
        preset, exported = bfloat16_presets[name], root / f"{name}_hf"
        status, _, err = run_cli(
            ["export", "--format", "transformers", "--preset", preset]
            + ["--output", exported],
            capsys,
        )
        assert status == 0, err
        config = json.loads((exported / "config.json").read_text())
        assert config["dtype"] == "bfloat16"
        reports = []
        for path in (preset, exported):
            status, out, err = run_cli(["inspect", "--preset", path], capsys)
            assert status == 0, err
            reports.append(last_json(out))
        assert reports[0]["weight_bytes"] == reports[1]["weight_bytes"]
        assert reports[0]["class"] == reports[1]["class"]
        status, out, err = run_cli(
            ["evaluate", "--preset", exported, "--perplexity", text]
            + ["--no-progress"],
            capsys,
        )
        assert status == 0, err
        metrics = last_json(out)[f"perplexity:{text}"]
        assert np.isfinite(metrics["perplexity"])
        status, out, err = run_cli(
            ["expand-vocabulary", "--preset", exported, "--tokens"]
            + [_tokens_file(root), "--output", root / f"{name}_hf_expanded"],
            capsys,
        )
        assert status == 0, err
        assert last_json(out)["new_tokens"] == 1


def _tokens_file(root):
    path = root / "tokens.txt"
    path.write_text("▁Zürich\n")
    return path


def _safetensors_dtypes(path):
    import struct

    data = Path(path).read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_a_bfloat16_preset_keeps_its_precision(bfloat16_presets, capsys):
    """`inspect` counts a bfloat16 preset's weights at 2 bytes each, and
    `expand-vocabulary` and `export --format transformers` write bfloat16
    (before: float32, through KerasHub's loader)."""
    root, preset = bfloat16_presets["root"], bfloat16_presets["mhf"]
    status, out, _ = run_cli(["inspect", "--preset", preset], capsys)
    assert status == 0
    report = last_json(out)
    # Every float weight in bfloat16 (the signature table is int32).
    assert report["weight_bytes"]["other"] < 2.1 * report["parameters"]
    expanded = root / "expanded_bf16"
    status, _, err = run_cli(
        ["expand-vocabulary", "--preset", preset, "--tokens"]
        + [_tokens_file(root), "--output", expanded],
        capsys,
    )
    assert status == 0, err
    config = json.loads((expanded / "config.json").read_text())
    assert config["config"]["dtype"]["config"]["name"] == "bfloat16"
    exported = root / "bf16_hf"
    status, _, err = run_cli(
        ["export", "--format", "transformers", "--preset", preset]
        + ["--output", exported],
        capsys,
    )
    assert status == 0, err
    assert json.loads((exported / "config.json").read_text())["dtype"] == (
        "bfloat16"
    )
    assert "BF16" in _safetensors_dtypes(exported / "model.safetensors")
    assert "F32" not in _safetensors_dtypes(exported / "model.safetensors")


def test_generate_prompts_files_pipes_and_a_prompt_loop(
    trained, capsys, monkeypatch, small_proto
):
    """`keras-mhf generate` on the pretrained MHF preset and on a Standard
    preset: a prompt prints `generate`'s greedy text; `--prompt-file`
    writes JSON Lines (seeded sampling repeats itself); piped lines get an
    answer each; `--stop` cuts the text; in the prompt loop Ctrl-C ends
    one answer and the loop goes on."""
    from keras_mhf.cli import generate as generate_command
    from keras_mhf.models import MultiHashFormerTokenizer
    from keras_mhf.models import standard_causal_lm
    from keras_mhf.models.generation_stream import SAMPLERS
    from keras_mhf.models.preset_loading import load_causal_lm

    assert generate_command.SAMPLERS == SAMPLERS
    _, preset = trained
    standard = standard_causal_lm(
        MultiHashFormerTokenizer(small_proto), "tiny", sequence_length=32
    )
    standard.save_to_preset("standard")
    for path in (preset, Path("standard")):
        lm = load_causal_lm(str(path))
        lm.compile(sampler="greedy")
        want = lm.generate("The cell", max_new_tokens=6, strip_prompt=True)
        status, out, _ = run_cli(
            ["generate", "--preset", path, "The cell", "--max-new-tokens", 6],
            capsys,
        )
        assert (status, out) == (0, want + "\n")
    Path("prompts.txt").write_text("The cell\n\nWater\n")
    runs = [
        run_cli(
            ["generate", "--preset", preset, "--prompt-file", "prompts.txt"]
            + ["--max-new-tokens", 6, "--sampler", "top_p", "--seed", 3],
            capsys,
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and runs[0][0] == 0
    records = [json.loads(line) for line in runs[0][1].splitlines()]
    assert [(r["line"], r["prompt"]) for r in records] == [
        (1, "The cell"),
        (3, "Water"),
    ]
    assert all(r["finish_reason"] in ("stop", "length") for r in records)
    lm = load_causal_lm(str(preset))
    lm.compile(sampler="greedy")
    want = lm.generate("The cell", max_new_tokens=6, strip_prompt=True)
    monkeypatch.setattr(sys, "stdin", io.StringIO("The cell\nThe cell\n"))
    status, out, _ = run_cli(
        ["generate", "--preset", preset, "--max-new-tokens", 6], capsys
    )
    assert (status, out) == (0, f"{want}\n{want}\n")
    stop = want[2:4]
    status, out, _ = run_cli(
        ["generate", "--preset", preset, "The cell", "--max-new-tokens", 6]
        + ["--stop", stop],
        capsys,
    )
    assert out == want[: want.index(stop)] + "\n"
    # The prompt loop: Ctrl-C during the first answer ends it; the second
    # prompt is answered; Ctrl-D ends the loop.
    lines = iter(["The cell", "The cell"])

    def typed(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    answered = []
    real = generate_command._print_answer

    def print_answer(generator, prompt):
        answered.append(prompt)
        if len(answered) == 1:
            raise KeyboardInterrupt
        real(generator, prompt)

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", typed)
    monkeypatch.setattr(generate_command, "_print_answer", print_answer)
    status, out, _ = run_cli(
        ["generate", "--preset", preset, "--max-new-tokens", 6], capsys
    )
    assert status == 0
    assert out == f" [stopped]\n{want}\n\n"
    status, _, err = run_cli(
        ["generate", "--preset", preset, "x", "--sampler", "top_k"]
        + ["--temperature", 0],
        capsys,
    )
    assert status == 2 and "--temperature must be > 0" in err
