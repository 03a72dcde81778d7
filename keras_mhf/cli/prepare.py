"""Tokenizes text corpora once into token shards for pre-training.

    keras-mhf prepare --tokenizer tokenizer.model --output prepared/ corpus/
    keras-mhf prepare --tokenizer tokenizer.model \\
        --output prepared/ 'books/*.jsonl.gz' notes.txt \\
        --validation held_out.jsonl --workers 8
    keras-mhf prepare --tokenizer tokenizer.model --output prepared/edu \\
        'fineweb-edu/sample/10BT/*.parquet' --text-field text

Inputs are `.txt`, `.jsonl`, `.jsonl.gz`, `.jsonl.zst` or `.txt.zst` files,
Parquet files (`.parquet`, e.g. FineWeb-Edu), Arrow files and folders
written by Hugging Face `datasets`' `save_to_disk` (a DatasetDict: name its
split, FOLDER/SPLIT), directories of them (other files are skipped) and glob
patterns. --text-field picks the JSON field or column that holds the text
(default: text). The output directory gets `train_*.bin`, `validation_*.bin`
and `index.json` (written last); open it with `keras_mhf.data.PreparedCorpus`.
A killed run restarted with the same arguments continues where it stopped; a
finished one is left as it is.
"""

import sys

from keras_mhf.cli.common import parser_from_doc
from keras_mhf.data.prepare import DEFAULT_SHARD_TOKENS


def build_parser(prog=None):
    """The arguments of `keras-mhf prepare`."""
    parser = parser_from_doc(__doc__, prog)
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="corpus file (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .txt.zst, "
        ".parquet, .arrow), datasets save_to_disk folder, directory or glob "
        "pattern",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="TOKENIZER.model",
        help="SentencePiece model file",
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="output directory",
    )
    split = parser.add_mutually_exclusive_group()
    split.add_argument(
        "--validation-fraction",
        type=float,
        default=0.005,
        metavar="F",
        help="share of documents held out for validation, chosen by a hash of "
        "each document's text",
    )
    split.add_argument(
        "--validation",
        nargs="+",
        metavar="INPUT",
        help="separate validation corpus (then every INPUT document is for "
        "training); give it after the INPUTs",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help="tokens per shard file (default%(default).0s: "
        f"{DEFAULT_SHARD_TOKENS:,})",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="tokenizer processes (default: every core); the output is the "
        "same for any number",
    )
    parser.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        default="fail",
        help="a bad line or row (not UTF-8, invalid JSON, no string text, a "
        "null): stop with its file:line (fail, default) or skip it with a "
        "warning (skip); a damaged Parquet or Arrow file always stops",
    )
    parser.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON field (.jsonl) or Parquet/Arrow column that holds "
        "the text (default: %(default)s)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress report on stderr",
    )
    return parser


def main(argv=None, prog=None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    from keras_mhf.data.prepare import prepare_data
    from keras_mhf.utils.disk_space import disk_full_reason
    from keras_mhf.utils.disk_space import is_disk_full
    from keras_mhf.utils.output_lock import OutputLockedError

    try:
        prepare_data(
            args.inputs,
            args.tokenizer,
            args.output,
            validation_fraction=args.validation_fraction,
            validation_inputs=args.validation,
            shard_tokens=args.shard_tokens,
            workers=args.workers,
            on_error=args.on_error,
            progress=not args.quiet,
            text_field=args.text_field,
        )
    except (ValueError, OSError, OutputLockedError) as error:
        message = str(error)
        if is_disk_full(error):
            message = (
                f"{disk_full_reason(error)} while writing {args.output} "
                f"({error.strerror}); free space and rerun the same command "
                "to continue where it stopped"
            )
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
