"""The settings of a run, declared once (`keras_mhf.settings`): the flags
and their defaults per command, settings files (read, written, round trip,
errors), the settings a resume must match, and the docs' tables. Nothing
here runs a backend (the runs that use a settings file are in
tests/cli/test_cli.py)."""

import types
from pathlib import Path

import pytest

from keras_mhf.cli import finetune as finetune_cli
from keras_mhf.cli import pretrain as pretrain_cli
from keras_mhf.cli.common import run_settings_from
from keras_mhf.pretraining import RunConfig
from keras_mhf.pretraining import run_settings
from keras_mhf.pretraining.checkpoints import recorded_settings
from keras_mhf.settings import RUN_SETTINGS
from keras_mhf.settings import SettingsFileError
from keras_mhf.settings import read_settings_file
from keras_mhf.settings import settings_of
from keras_mhf.settings import settings_table
from keras_mhf.settings import write_settings_file
from keras_mhf.settings.__main__ import main
from keras_mhf.settings.run_settings import with_current_tables

REPO = Path(__file__).resolve().parents[2]
PARSERS = {
    "pretrain": pretrain_cli.build_parser,
    "finetune": finetune_cli.build_parser,
}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_each_setting_has_its_flag_and_the_commands_default(command):
    parser = PARSERS[command]("keras-mhf " + command)
    actions = {}
    for action in parser._actions:
        for option in action.option_strings:
            actions[option] = action
    for setting in settings_of(command):
        if not setting.flag:  # set by an alias flag, or kept from 0.1
            assert setting.aliases or not setting.written, setting.name
            continue
        action = actions[setting.flag]
        assert action.dest == setting.name
        shown = setting.shown_default(command)
        if shown is not None:
            assert action.help.endswith(f"(default: {shown})"), setting.name
        if setting.type is bool:
            assert actions["--no-" + setting.flag[2:]] is action
    assert ("--model" in actions) == (command == "pretrain")
    assert ("--lora-rank" in actions) == (command == "finetune")


def test_fine_tuning_defaults_differ_where_the_table_says():
    parser = finetune_cli.build_parser("keras-mhf finetune")
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["steps"].endswith("(default: 100)")
    assert helps["lora_rank"].endswith("(default: 8)")
    parser = pretrain_cli.build_parser("keras-mhf pretrain")
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["steps"].endswith("(default: 300)")
    assert "lora_rank" not in helps


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = tmp_path / "paper.toml"
    path.write_text(
        'data = ["a.jsonl", "b.parquet"]\noutput_dir = "runs/x"\n'
        "steps = 7\nlearning_rate = 1e-3\ncalibrate = false\n"
    )
    parser = pretrain_cli.build_parser("keras-mhf pretrain")
    args = parser.parse_args(
        ["--config", str(path), "--steps", "9", "--calibrate", "--quiet"]
    )
    values = run_settings_from(parser, args, "pretrain")
    assert values == {
        "data": ["a.jsonl", "b.parquet"],
        "output_dir": "runs/x",
        "steps": 9,
        "learning_rate": 1e-3,
        "calibrate": True,
        "verbose": 0,
    }
    args = parser.parse_args(["--data", "c.txt", "--output", "o"])
    assert run_settings_from(parser, args, "pretrain") == {
        "data": "c.txt",
        "output_dir": "o",
    }


def test_a_required_setting_given_nowhere_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "partial.toml"
    path.write_text("steps = 7\n")
    parser = finetune_cli.build_parser("keras-mhf finetune")
    args = parser.parse_args(["--config", str(path), "--data", "d.jsonl"])
    with pytest.raises(SystemExit) as exit:
        run_settings_from(parser, args, "finetune")
    assert exit.value.code == 2
    assert (
        "the following arguments are required: --output, --preset (as "
        "flags, or in the --config file)"
    ) in capsys.readouterr().err


def test_yaml_files_read_as_toml_files(tmp_path):
    path = tmp_path / "paper.yaml"
    # YAML 1.1 reads 2e-3 (no dot) as a string; a number setting takes it.
    path.write_text(
        "command: finetune\ninitial_preset: runs/mhf/preset\n"
        "learning_rate: 2e-3\nlora_rank: 4\ndata: notes.jsonl\n"
    )
    assert read_settings_file(path, "finetune") == {
        "initial_preset": "runs/mhf/preset",
        "learning_rate": 0.002,
        "lora_rank": 4,
        "data": "notes.jsonl",
    }


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "typo.toml",
            "stepz = 3\nmodel = 'mhf'\nlora_rank = 4\n",
            "typo.toml: 'stepz' is not a setting of keras-mhf pretrain (did "
            "you mean 'steps'?); 'lora_rank' is a setting of keras-mhf "
            "finetune, not pretrain (keras-mhf pretrain --help lists",
        ),
        (
            "dashes.toml",
            "learning-rate = 3.0\n",
            "'learning-rate' is not a setting of keras-mhf pretrain (did you "
            "mean 'learning_rate'?)",
        ),
        (
            "other.toml",
            'command = "finetune"\n',
            "other.toml holds settings of keras-mhf finetune; run keras-mhf "
            "finetune --config",
        ),
        ("broken.toml", "steps = = 3\n", "broken.toml is not valid TOML: "),
        ("broken.yaml", "steps: [3\n", "broken.yaml is not valid YAML: "),
        ("list.yaml", "- 3\n", "list.yaml must hold settings as name = value"),
        ("settings.json", "{}", "settings.json: a settings file is TOML"),
    ],
)
def test_a_bad_file_is_one_line_naming_it(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SettingsFileError) as error:
        read_settings_file(path, "pretrain")
    assert message in str(error.value)
    assert len(str(error.value).splitlines()) == 1


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(SettingsFileError, match="cannot read the settings"):
        read_settings_file(tmp_path / "none.toml")


def test_written_settings_read_back_as_the_same_run(tmp_path):
    config = RunConfig(
        data=[str(tmp_path / "a.jsonl"), str(tmp_path / "*.txt")],
        output_dir=str(tmp_path / "run"),
        model="standard",
        architecture="tiny",
        extra_layers=2,
        steps=7,
        learning_rate=3e-4,
        precision="bfloat16",
        calibrate=False,
        compilation_cache="none",
        distribution="data",
        mesh="2x4",
        workers=3,
        verbose=0,
    )
    path = tmp_path / "run.toml"
    write_settings_file(path, config, "pretrain")
    assert RunConfig(**read_settings_file(path)) == config
    # A fine-tuning run: full fine-tuning (no LoRA rank) is written as 0,
    # TOML having no null.
    preset = tmp_path / "preset"
    preset.mkdir()
    config = RunConfig(
        data="notes.jsonl",
        output_dir="ft",
        initial_preset=str(preset),
        lora_rank=None,
        steps=5,
    )
    path = tmp_path / "ft.toml"
    write_settings_file(path, config, "finetune")
    read = read_settings_file(path, "finetune")
    assert read["lora_rank"] == 0 and "model" not in read
    assert RunConfig(**read) == config


def test_a_resume_matches_the_settings_earlier_runs_recorded():
    """The settings `run.json` records are those runs of earlier releases
    recorded, so that their outputs still resume."""
    config = RunConfig("d", "o")
    data = types.SimpleNamespace(fingerprint="f")
    assert set(run_settings(config, data)) == {
        "model",
        "architecture",
        "extra_layers",
        "signature_rule",
        "sequence_length",
        "batch_size",
        "gradient_accumulation_steps",
        "steps",
        "seed",
        "precision",
        "data",
    }
    config = RunConfig("d", "o", mixed_precision=True)
    assert run_settings(config, data)["precision"] == "mixed_bfloat16"
    # Runs before 0.3 recorded no accumulation: they resume as 1.
    recorded = dict(run_settings(RunConfig("d", "o"), data))
    del recorded["gradient_accumulation_steps"]
    assert recorded_settings(recorded) == run_settings(
        RunConfig("d", "o"), data
    )


def test_every_run_config_setting_is_checked():
    problems = []
    for setting in RUN_SETTINGS:
        if setting.run_config and setting.rule is None:
            problems.append(setting.name)
    assert problems == []
    config = RunConfig(
        "d", "o", steps="300", signature_rule="x", mesh="2y4", verbose=5
    )
    with pytest.raises(ValueError) as error:
        config.validate()
    assert str(error.value) == (
        "--signature-rule must be 'unique', 'reference' or 'repeated', got "
        "'x'; --steps must be an integer >= 1, got '300'; verbose must be "
        "0, 1 or 2, got 5; --mesh must look like 2x4; got '2y4'."
    )


def test_the_docs_tables_are_the_settings():
    page = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")
    for command in ("pretrain", "finetune"):
        assert settings_table(command) in page
    assert with_current_tables(page) == page, (
        "docs/settings.md's tables are not current; run: "
        "python -m keras_mhf.settings docs/settings.md"
    )


def test_the_docs_writer_replaces_only_the_tables(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# x\n\n## keras-mhf finetune\n\ntext\n\n"
        "| setting (file key) | flag |\n|---|---|\n| `old` | - |\n\nafter\n"
    )
    main([str(page)])
    assert page.read_text() == (
        "# x\n\n## keras-mhf finetune\n\ntext\n\n"
        + settings_table("finetune")
        + "\nafter\n"
    )
