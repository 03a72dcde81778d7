"""Every setting of a pre-training or fine-tuning run, declared once
(`RUN_SETTINGS`, no Keras), and what is derived from the table:
`RunConfig`'s fields and their checks (`keras_mhf.pretraining.config`), the
flags of `keras-mhf pretrain` and `finetune` with their help and defaults
(`keras_mhf.cli.common.add_run_settings`), settings files
(`keras_mhf.settings.settings_file`), the settings a resumed run must match
(`OUTPUT/run.json`) and the docs' table (`settings_table`).

Adding a setting is one entry here; the code that acts on it reads it from
the `RunConfig`.

Example:

>>> [s.name for s in settings_of("finetune")][:3]
['data', 'output_dir', 'initial_preset']
>>> command_defaults("finetune")["steps"], command_defaults("pretrain")["steps"]
(100, 300)
"""

from keras_mhf.settings import rules
from keras_mhf.settings.setting import COMMANDS
from keras_mhf.settings.setting import PATH
from keras_mhf.settings.setting import PATHS
from keras_mhf.settings.setting import SAME
from keras_mhf.settings.setting import Setting

PRETRAIN = ("pretrain",)
FINETUNE = ("finetune",)
DATA = "data and model"
VALIDATION = "validation and calibration"
RUN = "the run"
SCALING = "scaling out"
HOSTS = "multi-host (JAX): the same arguments in every process but --process-id"

RUN_SETTINGS = (
    Setting(
        "data",
        PATHS,
        None,
        "a prepared corpus directory (index.json, from `keras-mhf "
        "prepare`), or raw text: .txt/.jsonl/.jsonl.gz/.jsonl.zst/.txt.zst/"
        ".parquet/.arrow files, `datasets` save_to_disk folders, directories "
        "or glob patterns, prepared into OUTPUT/data first (for finetune, "
        "with the preset's tokenizer)",
        rule=rules.required(": a prepared directory or text"),
        required=True,
        group=DATA,
    ),
    Setting(
        "output_dir",
        PATH,
        None,
        "output directory (reused to resume)",
        flag="--output",
        rule=rules.required(""),
        required=True,
        group=DATA,
    ),
    Setting(
        "initial_preset",
        PATH,
        None,
        "the MHF or Standard preset to fine-tune (e.g. runs/mhf/preset); it "
        "decides the model and the tokenizer",
        commands=FINETUNE,
        flag="--preset",
        rule=rules.preset,
        parse=rules.preset_directory,
        required=True,
        recorded="fingerprint",
        group=DATA,
    ),
    Setting(
        "tokenizer",
        PATH,
        None,
        "SentencePiece .model; default: for raw text, train one on a "
        "sample of it; for a prepared directory, the one its index.json "
        "records",
        commands=PRETRAIN,
        rule=rules.path,
        group=DATA,
    ),
    Setting(
        "vocabulary_size",
        int,
        4000,
        "pieces of the tokenizer trained when --tokenizer is not given",
        commands=PRETRAIN,
        rule=rules.integer(1),
        group=DATA,
    ),
    Setting(
        "model",
        str,
        "mhf",
        "MultiHashFormer or the Standard baseline (KerasHub Qwen3)",
        commands=PRETRAIN,
        choices=rules.MODELS,
        rule=rules.one_of,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "architecture",
        str,
        "mini_h4b1024",
        "e.g. tiny_h3b512, mini_h4b1024, 100m_h4b16k (trunk only for standard)",
        commands=PRETRAIN,
        rule=rules.architecture,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "extra_layers",
        int,
        0,
        "Standard+kL: k more decoder layers",
        commands=PRETRAIN,
        rule=rules.extra_layers,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "signature_rule",
        str,
        "unique",
        "MHF signatures: unique (no two tokens share one), reference (the "
        "authors' rule, bit for bit) or repeated (the single-ID ablation)",
        commands=PRETRAIN,
        choices=rules.SIGNATURE_RULES,
        rule=rules.one_of,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "lora_rank",
        int,
        None,
        "rank of the LoRA adapters on the attention query and value "
        "projections; 0 trains every weight",
        finetune_default=8,
        commands=FINETUNE,
        rule=rules.lora_rank,
        none_spelling=0,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "train_tables",
        bool,
        False,
        "also train the hash tables (MHF) / token embedding (Standard), "
        "e.g. after expand-vocabulary",
        commands=FINETUNE,
        rule=rules.train_tables,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "sequence_length",
        int,
        128,
        "tokens per window",
        rule=rules.integer(1),
        recorded="value",
    ),
    Setting(
        "batch_size",
        int,
        8,
        "global batch size (all devices and processes together)",
        rule=rules.integer(1),
        recorded="value",
    ),
    Setting(
        "gradient_accumulation_steps",
        int,
        1,
        "micro-batches per optimizer step: --batch-size stays the global "
        "batch, computed in this many parts one after another (the same "
        "step, in the memory of one part)",
        rule=rules.gradient_accumulation,
        recorded="value",
    ),
    Setting(
        "steps",
        int,
        300,
        "optimizer steps",
        finetune_default=100,
        rule=rules.steps,
        recorded="value",
    ),
    Setting(
        "learning_rate",
        float,
        2e-3,
        "peak learning rate",
        finetune_default=1e-3,
        rule=rules.number(above=0),
    ),
    Setting(
        "warmup_steps",
        int,
        30,
        "linear warmup before the cosine decay",
        finetune_default=10,
        rule=rules.integer(0),
    ),
    Setting(
        "weight_decay",
        float,
        0.1,
        "AdamW decay (not on norms and biases)",
        finetune_default=0.0,
        rule=rules.number(at_least=0),
    ),
    Setting(
        "optimizer",
        str,
        "adamw",
        "adamw: epsilon after bias correction, as torch.optim.AdamW and the "
        "authors' runs; keras_adamw: Keras' AdamW (epsilon before the "
        "correction; runs made before 0.2)",
        choices=rules.OPTIMIZERS,
        rule=rules.optimizer,
    ),
    Setting(
        "precision",
        str,
        "float32",
        "float32; mixed_bfloat16 (bf16 compute, float32 weights); bfloat16 "
        "(weights and optimizer state in bf16 too, as the authors trained); "
        "the loss and the cascade's softmax stay float32",
        choices=rules.PRECISIONS,
        rule=rules.one_of,
        aliases={"--mixed-precision": "mixed_bfloat16"},
        recorded="value",
    ),
    Setting(
        "mixed_precision",
        bool,
        False,
        "kept from 0.1: True is precision mixed_bfloat16",
        flag="",
        rule=rules.true_or_false,
        written=False,
    ),
    Setting(
        "seed",
        int,
        0,
        "initialisation and the order of the data",
        rule=rules.integer(0),
        recorded="value",
    ),
    Setting(
        "validation_data",
        PATHS,
        None,
        "raw text only: held-out files; default: the documents a hash of "
        "their text puts in the --validation-fraction",
        rule=rules.paths,
        group=VALIDATION,
    ),
    Setting(
        "validation_fraction",
        float,
        0.05,
        "raw text only: share of documents held out for validation",
        finetune_default=0.1,
        rule=rules.fraction,
        group=VALIDATION,
    ),
    Setting(
        "validation_blocks",
        int,
        64,
        "held-out windows scored at every checkpoint",
        rule=rules.integer(1),
        group=VALIDATION,
    ),
    Setting(
        "calibrate",
        bool,
        True,
        "MHF: fit the scoring temperature on the first half of the "
        "validation windows at the end (--no-calibrate keeps the paper's "
        "rule, temperature 1.0); the second half is reported either way",
        rule=rules.true_or_false,
        group=VALIDATION,
    ),
    Setting(
        "checkpoint_every",
        int,
        50,
        "steps between validation, log line and checkpoint",
        finetune_default=25,
        rule=rules.integer(1),
        group=RUN,
    ),
    Setting(
        "log_every",
        int,
        10,
        "steps between the points of the TensorBoard training curves (the "
        "loss is the mean over the steps since the last point)",
        rule=rules.integer(1),
        group=RUN,
    ),
    Setting(
        "tensorboard",
        str,
        "auto",
        "TensorBoard event files of per-step training curves and of each "
        "checkpoint's validation; 'auto' is OUTPUT/tensorboard, 'none' "
        "(--no-tensorboard) turns them off",
        metavar="DIR",
        aliases={"--no-tensorboard": "none"},
        rule=rules.directory_or_keyword,
        none_spelling="none",
        group=RUN,
    ),
    Setting(
        "workers",
        int,
        None,
        "raw text only: tokenizer processes when preparing it; every core "
        "if not given",
        rule=rules.integer(1, optional=True),
        group=RUN,
    ),
    Setting(
        "on_error",
        str,
        "fail",
        "raw text only: a bad line or row (not UTF-8, invalid JSON, no "
        "string text, a null, a cut-short .gz or .zst) stops the run with "
        "its file:line (fail) or is skipped with a warning (skip)",
        choices=rules.ON_ERROR,
        rule=rules.one_of,
        group=RUN,
    ),
    Setting(
        "text_field",
        str,
        "text",
        "raw text only: the JSON field (.jsonl) or Parquet/Arrow column that "
        "holds the text; OUTPUT/data records it, so a rerun with another one "
        "is refused",
        metavar="NAME",
        rule=rules.name,
        group=RUN,
    ),
    Setting(
        "verify_data",
        bool,
        True,
        "re-hash the prepared corpus's shards against index.json (and check "
        "their token ids) when the run starts or resumes",
        flag="--verify",
        rule=rules.true_or_false,
        group=RUN,
    ),
    Setting(
        "compilation_cache",
        str,
        "auto",
        "JAX only: a persistent cache of compiled programs, so that a "
        "resumed run starts training within seconds; 'auto' is "
        "OUTPUT/compilation_cache, 'none' turns it off",
        metavar="DIR",
        rule=rules.directory_or_keyword,
        none_spelling="none",
        group=RUN,
    ),
    Setting(
        "discard_unusable_checkpoints",
        bool,
        False,
        "when OUTPUT holds checkpoints and none can be loaded, set them "
        "aside (step_N.unusable) and train from step 0 (otherwise such a "
        "run is refused)",
        rule=rules.true_or_false,
        group=RUN,
    ),
    Setting(
        "verbose",
        int,
        1,
        "no progress bars or messages (the summary is still printed)",
        flag="",
        aliases={"--quiet": 0},
        rule=rules.verbose,
        group=RUN,
    ),
    Setting(
        "rematerialize",
        bool,
        False,
        "recompute each decoder block in the backward pass (gradient "
        "checkpointing): larger batches in the same memory, the same "
        "numbers; on JAX's CPU backend start with XLA_FLAGS="
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
        commands=PRETRAIN,
        rule=rules.true_or_false,
        group=SCALING,
    ),
    Setting(
        "distribution",
        str,
        None,
        "train over all devices (JAX backend only): data parallel, model "
        "parallel, or fully sharded data parallel (weights and optimizer "
        "state split along the batch axis, across hosts too)",
        commands=PRETRAIN,
        choices=rules.DISTRIBUTIONS,
        rule=rules.one_of,
        group=SCALING,
    ),
    Setting(
        "mesh",
        str,
        None,
        "(batch)x(model) device mesh, e.g. 2x4 (required for --distribution "
        "model)",
        commands=PRETRAIN,
        rule=rules.mesh,
        group=SCALING,
    ),
    Setting(
        "coordinator",
        str,
        None,
        "address of process 0, which every process connects to",
        commands=PRETRAIN,
        metavar="HOST:PORT",
        group=HOSTS,
        written=False,
        run_config=False,
    ),
    Setting(
        "num_processes",
        int,
        None,
        "processes in all",
        commands=PRETRAIN,
        metavar="N",
        group=HOSTS,
        written=False,
        run_config=False,
    ),
    Setting(
        "process_id",
        int,
        None,
        "this process, 0..N-1",
        commands=PRETRAIN,
        metavar="I",
        group=HOSTS,
        written=False,
        run_config=False,
    ),
)

BY_NAME = {s.name: s for s in RUN_SETTINGS}


def settings_of(command):
    """The settings `command` (`"pretrain"` or `"finetune"`) takes, in the
    table's order."""
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {COMMANDS}, got {command!r}")
    return [s for s in RUN_SETTINGS if command in s.commands]


def command_defaults(command):
    """`{name: default}` of `command`'s settings."""
    return {s.name: s.default_for(command) for s in settings_of(command)}


def finetune_defaults():
    """The defaults in which fine-tuning differs from pre-training."""
    return {
        s.name: s.finetune_default
        for s in RUN_SETTINGS
        if s.finetune_default is not SAME
    }


def part_of_run(setting, command):
    """Whether a run of `command` has `setting`: every run has the
    pre-training settings (a fine-tuning run's model and architecture come
    from its preset); the fine-tuning ones belong to fine-tuning runs."""
    return "pretrain" in setting.commands or command in setting.commands


def setting_problems(values):
    """The problems of every `RunConfig` setting of `values`, in the
    table's order."""
    problems = []
    for setting in RUN_SETTINGS:
        if setting.run_config:
            value = getattr(values, setting.name)
            problems += setting.problems(value, values)
    return problems


def settings_table(command):
    """The settings of `command` as a Markdown table (the docs' reference:
    key in a settings file, flag, default, whether a resumed run must match
    it, what it is)."""
    lines = [
        "| setting (file key) | flag | default | resume | what |",
        "|---|---|---|---|---|",
    ]
    for s in settings_of(command):
        flags = [s.flag] if s.flag else []
        if s.type is bool and s.flag:
            flags.append("--no-" + s.flag[2:])
        flags += list(s.aliases)
        shown = s.shown_default(command)
        resume = {"value": "must match", "fingerprint": "same files"}
        lines.append(
            f"| `{s.name}` | {', '.join(f'`{f}`' for f in flags) or '-'} | "
            f"{'' if shown is None else f'`{shown}`'} | "
            f"{resume.get(s.recorded, '')} | {s.help} |"
        )
    return "\n".join(lines) + "\n"


def with_current_tables(page):
    """`page` (Markdown) with the table under each `## keras-mhf COMMAND`
    heading replaced by `settings_table(COMMAND)`: how docs/settings.md is
    kept current (`python -m keras_mhf.settings docs/settings.md`)."""
    lines = page.splitlines(keepends=True)
    out, command, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            heading = line[3:].strip()
            command = heading.removeprefix("keras-mhf ")
            command = command if command in COMMANDS else None
        if command and line.startswith("| setting (file key) |"):
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            out.append(settings_table(command))
            command = None
            continue
        out.append(line)
        i += 1
    return "".join(out)
