"""Pre-train a MultiHashFormer (or the Standard baseline) with `model.fit`.

    keras-mhf pretrain --data my_corpus/ --output runs/mhf \\
        --tokenizer tokenizer.model --architecture mini_h4b1024 --steps 300

--data is either a corpus prepared once by `keras-mhf prepare` (a directory
with index.json: token shards that training streams from disk), or raw text
(.txt paragraphs or lines, .jsonl {"text": ...}, .jsonl.gz, directories and
glob patterns of them), which is first prepared into OUTPUT/data (resumable; a
rerun reuses it). Without --tokenizer, raw text gets a SentencePiece tokenizer
trained on a bounded sample of it, and a prepared directory uses the tokenizer
recorded in its index.json.

Every step reads batch-size windows of sequence-length + 1 tokens drawn from
(seed, step) alone. AdamW (decay 0.1, not on norms/biases), linear warmup +
cosine decay, global-norm clipping 1.0. After every --checkpoint-every steps:
validation perplexity over the real vocabulary on fixed held-out windows, a
line in log.csv and an atomic checkpoint (OUTPUT/checkpoints/step_NNNNNN);
rerunning the same command after a crash resumes from the newest complete
checkpoint and ends with the same weights as an uninterrupted run. A
non-finite training loss stops the run (exit status 1) and keeps the last
finite checkpoint. log.csv scores every validation window under the paper's
rule (scoring temperature 1.0).

At the end, an MHF model is calibrated (unless --no-calibrate): its scoring
temperature is fitted on the first half of the validation windows, and the
second half, held out from the fit, is scored under the paper's rule and
calibrated (summary.json: validation, validation_paper_rule,
scoring_temperature, calibration, validation_windows). The final model, with
its temperature, is saved as a KerasHub preset in OUTPUT/preset, with
OUTPUT/loss.png and OUTPUT/summary.json. The Standard baseline has one
scoring rule and is never calibrated.

Settings can also come from a TOML (or YAML) file, one `name = value` per
setting, named as in `--help`'s sections and OUTPUT/config.toml (e.g.
learning_rate = 1e-3): `--config FILE`, with flags overriding it. Every run
writes its resolved settings to OUTPUT/config.toml, so that
`keras-mhf pretrain --config OUTPUT/config.toml` reruns (or resumes) it.

Multi-host (JAX): run the same command on every host with --coordinator
HOST:PORT --num-processes N --process-id I --distribution data, a prepared
--data directory and an --output directory on a filesystem every host sees.
Importable: `from keras_mhf.pretraining import pretrain`.
"""

import json
import os

# Before keras_mhf (and so TensorFlow) is imported: drops TensorFlow's
# start-up lines that mean nothing on a CPU machine (see
# keras_mhf/utils/native_logs.py; KERAS_MHF_QUIET_STARTUP=0 shows them).
os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")

from keras_mhf.cli.common import add_run_settings  # noqa: E402
from keras_mhf.cli.common import parser_from_doc  # noqa: E402
from keras_mhf.cli.common import run_reporting_errors  # noqa: E402
from keras_mhf.cli.common import run_settings_from  # noqa: E402

# The multi-host launch settings: they say how this process joins the job,
# not what the run is.
LAUNCH = ("coordinator", "num_processes", "process_id")


def build_parser(prog=None):
    p = parser_from_doc(__doc__, prog)
    add_run_settings(p, "pretrain")
    return p


def join_processes(coordinator=None, num_processes=None, process_id=None):
    """Joins the multi-process JAX job named by --coordinator,
    --num-processes and --process-id (before anything touches a device);
    returns an error message, or `None`."""
    given = [
        coordinator is not None,
        num_processes is not None,
        process_id is not None,
    ]
    if not any(given):
        return None
    if not all(given):
        return (
            "--coordinator, --num-processes and --process-id go together; "
            "pass all three (or none for a single process)."
        )
    if num_processes < 1:
        return f"--num-processes must be >= 1, got {num_processes}."
    if not 0 <= process_id < num_processes:
        return (
            f"--process-id must be in 0..{num_processes - 1}, got {process_id}."
        )
    from keras_mhf.pretraining.distribution import initialize

    try:
        initialize(coordinator, num_processes, process_id)
    except ValueError as error:
        return str(error)
    return None


def main(argv=None, prog=None):
    parser = build_parser(prog)
    settings = run_settings_from(parser, parser.parse_args(argv), "pretrain")
    problem = join_processes(**{k: settings.pop(k, None) for k in LAUNCH})
    if problem:
        parser.error(problem)
    from keras_mhf.pretraining import pretrain
    from keras_mhf.utils.progress import show_progress

    show_progress(settings.get("verbose", 1) != 0)  # the final calibration's

    summary = run_reporting_errors(
        parser, lambda: pretrain(**settings), settings.get("verbose", 1)
    )
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
