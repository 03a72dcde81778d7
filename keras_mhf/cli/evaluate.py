"""Evaluate a saved MultiHashFormer or Standard model (a preset directory).

    keras-mhf evaluate --preset runs/mhf/preset \
        --perplexity held_out.jsonl \
        --lambada lambada_test.jsonl \
        --task piqa=piqa_validation.jsonl --task hellaswag=hellaswag.jsonl \
        --card660 card660.tsv --output results.jsonl

Metrics follow lm-eval: perplexity over the real vocabulary; --task NAME=FILE
scores one of the paper's ten tasks (lambada, arc_easy, copa, openbookqa,
piqa, hellaswag, race, sciq, siqa, record) from its Hugging Face rows or
llm-foundry's files, with lm-eval 0.4's prompt and metrics for that task;
LAMBADA (OpenAI jsonl, target = last word) acc and perplexity as
`lambada_openai`; multiple choice ({"query", "choices", "gold"}, prompt and
choice joined by --delimiter) acc and acc_norm; Card-660-format rare-word
similarity (Pearson/Spearman of last-token cosine similarity, final and
second-to-last layer). A MultiHashFormer with a calibrated scoring
temperature reports every metric under it and, as "paper_rule", under the
paper's rule. Results are keyed "<task>:<file as given>".

--output streams one JSON line per example (perplexity: one per block) as it
is scored, and each task's metrics when it ends; run the same command again
after an interruption and it resumes (finished tasks and recorded examples
are not scored again; other settings, another preset or a changed task file
are refused). A progress line with an ETA goes to stderr. The engine is
`keras_mhf.evaluation.evaluate_preset`; the file format is
`keras_mhf.evaluation.evaluation_results`.
"""

import json
import os

# Before keras_mhf (and so TensorFlow) is imported: drops TensorFlow's
# start-up lines that mean nothing on a CPU machine (see
# keras_mhf/utils/native_logs.py; KERAS_MHF_QUIET_STARTUP=0 shows them).
os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")

from keras_mhf.cli.common import parser_from_doc  # noqa: E402
from keras_mhf.settings.rules import preset_directory  # noqa: E402


def build_parser(prog=None):
    p = parser_from_doc(__doc__, prog)
    p.add_argument(
        "--preset",
        required=True,
        type=preset_directory,
        help="preset directory (MHF or Standard)",
    )
    p.add_argument(
        "--perplexity",
        nargs="*",
        default=[],
        help="held-out text: .txt, .jsonl(.gz/.zst), .parquet or .arrow "
        "files, datasets save_to_disk folders, directories or glob patterns",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON field (.jsonl) or Parquet/Arrow column of the "
        "--perplexity text (default: %(default)s)",
    )
    p.add_argument(
        "--lambada", nargs="*", default=[], help="LAMBADA-format .jsonl files"
    )
    p.add_argument(
        "--multiple-choice",
        nargs="*",
        default=[],
        help='{"query", "choices", "gold"} .jsonl files',
    )
    p.add_argument(
        "--task",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="one of the paper's tasks and its .jsonl file (repeat for "
        "more): lambada, arc_easy, copa, openbookqa, piqa, hellaswag, race, "
        "sciq, siqa, record",
    )
    p.add_argument(
        "--delimiter",
        default=None,
        help="what joins each prompt and continuation in LAMBADA and "
        "multiple-choice files (default: a space, lm-eval's target "
        "delimiter); for pre-formatted files, e.g. --delimiter $'\\n'",
    )
    p.add_argument(
        "--card660",
        nargs="*",
        default=[],
        help="word1<TAB>word2<TAB>score files",
    )
    p.add_argument(
        "--sequence-length",
        type=int,
        default=128,
        help="block length for perplexity",
    )
    p.add_argument(
        "--max-blocks",
        type=int,
        default=256,
        help="blocks scored for perplexity",
    )
    p.add_argument(
        "--limit", type=int, default=None, help="examples per task file"
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="examples per forward pass"
    )
    p.add_argument(
        "--output",
        default=None,
        help="per-example results as JSON lines, written as they are "
        "computed; a rerun resumes",
    )
    p.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        default="fail",
        help="a bad line of a --lambada, --multiple-choice or --card660 file "
        "stops the evaluation with its file:line (fail) or is left out with "
        "a warning, counted in the task's skipped_lines (skip)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress lines (on stderr) for the long tasks",
    )
    return p


def _task(parser, value):
    """`NAME=FILE` as `(name, file)`; a parser error for anything else."""
    from keras_mhf.evaluation.task_formats import task_name

    name, sep, path = value.partition("=")
    if not sep or not path:
        parser.error(
            f"--task {value!r}: expected NAME=FILE, e.g. piqa=piqa.jsonl"
        )
    try:
        return task_name(name), path
    except ValueError as error:
        parser.error(f"--task {value!r}: {error}")


def main(argv=None, prog=None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not (
        args.perplexity
        or args.lambada
        or args.multiple_choice
        or args.card660
        or args.task
    ):
        parser.error(
            "nothing to evaluate: give --perplexity, --lambada, "
            "--multiple-choice, --card660 or --task files."
        )
    from keras_mhf.evaluation import evaluate_preset

    tasks = [_task(parser, value) for value in args.task]

    results = evaluate_preset(
        args.preset,
        args.perplexity,
        args.lambada,
        args.multiple_choice,
        args.card660,
        args.sequence_length,
        args.max_blocks,
        args.limit,
        args.batch_size,
        args.output,
        progress=not args.no_progress,
        on_error=args.on_error,
        tasks=tasks,
        delimiter=args.delimiter,
        text_field=args.text_field,
    )
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
