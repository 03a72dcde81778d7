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

from keras_mhf.cli.common import add_training_options  # noqa: E402
from keras_mhf.cli.common import one_path_or_list  # noqa: E402
from keras_mhf.cli.common import parser_from_doc  # noqa: E402
from keras_mhf.cli.common import run_reporting_errors
from keras_mhf.cli.common import training_settings  # noqa: E402
from keras_mhf.utils.training_defaults import PRETRAIN_DEFAULTS  # noqa: E402


def build_parser(prog=None):
    p = parser_from_doc(__doc__, prog)
    add_model_options(p)
    add_training_options(p, PRETRAIN_DEFAULTS)
    add_scaling_options(p)
    return p


def add_model_options(p):
    """The data, output, tokenizer and architecture options."""
    p.add_argument(
        "--data",
        required=True,
        nargs="+",
        metavar="DATA",
        help="a prepared corpus directory (index.json, from "
        "`keras-mhf prepare`), or raw text: .txt/.jsonl/.jsonl.gz files, "
        "directories or glob patterns, prepared into OUTPUT/data first",
    )
    p.add_argument(
        "--output", required=True, help="output directory (reused to resume)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="SentencePiece .model; default: for raw text, train one on a "
        "sample of it; for a prepared directory, the one its index.json "
        "records",
    )
    p.add_argument(
        "--vocabulary-size",
        type=int,
        default=4000,
        help="pieces of the tokenizer trained when --tokenizer is not given",
    )
    p.add_argument(
        "--model",
        choices=["mhf", "standard"],
        default="mhf",
        help="MultiHashFormer or the Standard baseline (KerasHub Qwen3)",
    )
    p.add_argument(
        "--architecture",
        default="mini_h4b1024",
        help="e.g. tiny_h3b512, mini_h4b1024, 100m_h4b16k (trunk only for "
        "standard)",
    )
    p.add_argument("--extra-layers", type=int, default=0, help="Standard+kL")


def add_scaling_options(p):
    """Rematerialisation, the device mesh and the multi-host job."""
    p.add_argument(
        "--rematerialize",
        action="store_true",
        help="recompute each decoder block in the backward pass (gradient "
        "checkpointing): larger batches in the same memory, the same "
        "numbers; on JAX's CPU backend start with XLA_FLAGS="
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    )
    p.add_argument(
        "--distribution",
        choices=["data", "model", "fsdp"],
        default=None,
        help="train over all devices (JAX backend only): data parallel, "
        "model parallel, or fully sharded data parallel (weights and "
        "optimizer state split along the batch axis, across hosts too)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="(batch)x(model) device mesh, e.g. 2x4 (required for "
        "--distribution model)",
    )
    hosts = p.add_argument_group(
        "multi-host (JAX)",
        "one process per host, all with the same arguments except --process-id",
    )
    hosts.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0, which every process connects to",
    )
    hosts.add_argument(
        "--num-processes", type=int, default=None, help="processes in all"
    )
    hosts.add_argument(
        "--process-id", type=int, default=None, help="this process, 0..N-1"
    )


def join_processes(args):
    """Joins the multi-process JAX job named by --coordinator,
    --num-processes and --process-id (before anything touches a device);
    returns an error message, or `None`."""
    given = [
        args.coordinator is not None,
        args.num_processes is not None,
        args.process_id is not None,
    ]
    if not any(given):
        return None
    if not all(given):
        return (
            "--coordinator, --num-processes and --process-id go together; "
            "pass all three (or none for a single process)."
        )
    if args.num_processes < 1:
        return f"--num-processes must be >= 1, got {args.num_processes}."
    if not 0 <= args.process_id < args.num_processes:
        return (
            f"--process-id must be in 0..{args.num_processes - 1}, got "
            f"{args.process_id}."
        )
    from keras_mhf.pretraining.distribution import initialize

    try:
        initialize(args.coordinator, args.num_processes, args.process_id)
    except ValueError as error:
        return str(error)
    return None


def main(argv=None, prog=None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    problem = join_processes(args)
    if problem:
        parser.error(problem)
    from keras_mhf.pretraining import pretrain
    from keras_mhf.utils.progress import show_progress

    show_progress(not args.quiet)  # the final calibration's progress

    summary = run_reporting_errors(
        parser,
        lambda: pretrain(
            data=one_path_or_list(args.data),
            output_dir=args.output,
            tokenizer=args.tokenizer,
            vocabulary_size=args.vocabulary_size,
            model=args.model,
            architecture=args.architecture,
            extra_layers=args.extra_layers,
            rematerialize=args.rematerialize,
            distribution=args.distribution,
            mesh=args.mesh,
            **training_settings(args),
        ),
    )
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
