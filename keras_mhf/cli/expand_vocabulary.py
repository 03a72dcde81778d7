"""Expand a saved model's vocabulary (paper Sec. 4.4) into a new preset.

    keras-mhf expand-vocabulary --preset runs/mhf/preset \\
        --tokenizer expanded.model --output runs/mhf_expanded
    keras-mhf expand-vocabulary --preset runs/mhf/preset \\
        --tokens new_tokens.txt --output runs/mhf_expanded

--tokenizer is a SentencePiece model whose first pieces are the preset's
own, in order (e.g. from `keras_mhf.expansion.expand_sentencepiece`);
--tokens is a text file of new pieces, one per line (SentencePiece spelling,
`▁` for a leading space), appended to the preset's tokenizer. A
MultiHashFormer gets signatures for the new tokens and no new parameter
(`MultiHashFormerCausalLM.expand_vocabulary`); the Standard baseline gets
new embedding rows, each the mean of the rows of the piece's old
tokenization. Every other weight, and a MultiHashFormer's scoring
temperature, is kept. The new preset is written atomically.
"""

import json
import os

# Before keras_mhf (and so TensorFlow) is imported: drops TensorFlow's
# start-up lines that mean nothing on a CPU machine (see
# keras_mhf/utils/native_logs.py; KERAS_MHF_QUIET_STARTUP=0 shows them).
os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")

from keras_mhf.cli.common import parser_from_doc  # noqa: E402
from keras_mhf.cli.common import refuse_existing_output  # noqa: E402
from keras_mhf.cli.common import refuse_output_over_input  # noqa: E402
from keras_mhf.settings.rules import preset_directory  # noqa: E402


def build_parser(prog=None):
    p = parser_from_doc(__doc__, prog)
    p.add_argument(
        "--preset",
        required=True,
        type=preset_directory,
        help="the MHF or Standard preset to expand",
    )
    new = p.add_mutually_exclusive_group(required=True)
    new.add_argument(
        "--tokenizer",
        metavar="TOKENIZER.model",
        help="the expanded SentencePiece model (old pieces first)",
    )
    new.add_argument(
        "--tokens",
        metavar="FILE",
        help="new pieces, one per line, appended to the preset's tokenizer",
    )
    p.add_argument(
        "--output", required=True, help="directory of the new preset"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing OUTPUT",
    )
    return p


def read_tokens(path):
    """The pieces of a `--tokens` file: one per line, blank lines skipped."""
    with open(path, encoding="utf-8") as f:
        tokens = [line.rstrip("\r\n") for line in f]
    return [t for t in tokens if t.strip()]


def expand_preset(preset, output, tokenizer=None, tokens=None):
    """Loads `preset`, expands its vocabulary with `tokenizer` (a
    SentencePiece model file) or `tokens` (pieces appended to its
    tokenizer) and saves the result as a preset at `output`.

    Returns:
        dict with `model` (the class), `old_vocabulary_size`,
        `vocabulary_size`, `new_tokens`, and the trainable parameters
        before and after (`old_parameters`, `parameters`; the signature
        table is not a parameter).
    """
    from keras_mhf.expansion import append_pieces
    from keras_mhf.models import StandardCausalLM
    from keras_mhf.models.preset_loading import load_causal_lm
    from keras_mhf.models.standard.standard_vocabulary import (
        expand_standard_vocabulary,
    )
    from keras_mhf.pretraining.run import save_preset
    from keras_mhf.utils.keras_utils import count_trainable_parameters

    lm = load_causal_lm(preset)
    old_tokenizer = getattr(lm.preprocessor, "tokenizer", None)
    if old_tokenizer is None:
        raise ValueError(
            f"The preset {preset} has no tokenizer; expanding needs the old "
            "pieces. Save the model with its preprocessor."
        )
    if tokenizer is not None:
        with open(tokenizer, "rb") as f:
            proto = f.read()
    else:
        proto, _ = append_pieces(old_tokenizer.proto, tokens)
    new_tokenizer = type(old_tokenizer)(proto=proto)
    if isinstance(lm, StandardCausalLM):
        expanded = expand_standard_vocabulary(lm, new_tokenizer)
    else:
        expanded = lm.expand_vocabulary(tokenizer=new_tokenizer)
    save_preset(expanded, output)
    old_size = lm.backbone.vocabulary_size
    return {
        "model": type(lm).__name__,
        "old_vocabulary_size": int(old_size),
        "vocabulary_size": int(expanded.backbone.vocabulary_size),
        "new_tokens": int(expanded.backbone.vocabulary_size - old_size),
        "old_parameters": count_trainable_parameters(lm),
        "parameters": count_trainable_parameters(expanded),
    }


def main(argv=None, prog=None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    refuse_output_over_input(parser, args.output, args.preset)
    refuse_existing_output(parser, args)
    tokens = None
    if args.tokens is not None:
        tokens = read_tokens(args.tokens)
        if not tokens:
            parser.error(f"{args.tokens} lists no token; put one per line.")
    report = expand_preset(args.preset, args.output, args.tokenizer, tokens)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
