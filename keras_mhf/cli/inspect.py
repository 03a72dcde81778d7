"""Parameters, weight bytes and signature collisions of named architectures
or of a saved model.

    keras-mhf inspect                      # the paper's configs
    keras-mhf inspect 1b_h4b16k 100m --extra-layers 4
    keras-mhf inspect small_h4b16k --vocabulary-size 256000
    keras-mhf inspect mini_h4b1024 mini --bytes --quantize int8
    keras-mhf inspect --preset runs/mhf/preset

Without options it prints embedding / decoder / trunk / total parameters of
named architectures, without allocating any weight.

`--bytes` builds each model (allocating its weights) and prints the bytes
its weights take as stored, in float32 and after each `--quantize` mode:
the vocabulary side (MHF bucket tables, Standard embedding) separately.

`--signatures TOKENIZER` builds each MHF architecture's signature table on
a SentencePiece model's vocabulary and prints its collision statistics
(`SignatureTable.statistics()`):

    keras-mhf inspect 1b_h4b16k 1b_h4b16k_lsh1 --signatures tokenizer.model

`--preset` loads a saved MHF or Standard model and prints its architecture,
parameters by part, scoring temperature and, for MHF, the statistics of the
signature table it holds.
"""

import json

from keras_mhf.cli.common import parser_from_doc
from keras_mhf.settings.rules import preset_directory

PAPER = [
    "100m",
    "100m_h3b10k",
    "100m_h4b16k",
    "1b",
    "1b_h3b10k",
    "1b_h4b16k",
    "3b",
    "3b_h3b10k",
    "3b_h4b16k",
]


def main(argv=None, prog=None):
    parser = parser_from_doc(__doc__, prog)
    parser.add_argument(
        "architectures",
        nargs="*",
        default=PAPER,
        help="names like 1b, 1b_h4b16k, tiny_h3b512 (default: the paper's "
        "nine)",
    )
    parser.add_argument(
        "--vocabulary-size",
        type=int,
        default=32768,
        help="V; only the Standard embedding depends on it",
    )
    parser.add_argument(
        "--extra-layers",
        type=int,
        default=0,
        help="blocks added to each trunk (Standard+kL)",
    )
    parser.add_argument(
        "--bytes",
        action="store_true",
        help="build each model and print the bytes of its weights",
    )
    parser.add_argument(
        "--quantize",
        nargs="*",
        default=[],
        choices=["int8", "int4"],
        help="with --bytes: also after model.quantize(mode)",
    )
    parser.add_argument(
        "--signatures",
        default=None,
        metavar="TOKENIZER",
        help="print each MHF architecture's signature statistics on this "
        "SentencePiece model's vocabulary",
    )
    parser.add_argument(
        "--rule",
        default="unique",
        choices=["unique", "reference"],
        help="with --signatures: the collision rule",
    )
    parser.add_argument(
        "--preset",
        default=None,
        type=preset_directory,
        metavar="DIR",
        help="inspect this saved model (a preset directory) instead",
    )
    args = parser.parse_args(argv)
    if args.quantize and not args.bytes:
        parser.error("--quantize needs --bytes")
    if args.preset:
        return print_preset(args.preset)
    if args.signatures:
        return print_signatures(args)
    if args.bytes:
        return print_bytes(args)
    from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
        count_parameters,
    )

    print(
        f"{'architecture':<16}{'embedding':>14}{'decoder':>12}{'trunk':>16}{'total':>16}"
    )
    for name in args.architectures:
        c = count_parameters(name, args.vocabulary_size, args.extra_layers)
        label = name + (f"+{args.extra_layers}L" if args.extra_layers else "")
        print(
            f"{label:<16}{c['embedding']:>14,}{c['decoder']:>12,}{c['trunk']:>16,}"
            f"{c['total']:>16,}  ({c['total'] / 1e6:.1f}M)"
        )


def print_signatures(args):
    import sentencepiece as spm

    from keras_mhf import SignatureTable
    from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
        parse_architecture,
    )

    sp = spm.SentencePieceProcessor(model_file=args.signatures)
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    # The authors' pad: `</s>` when the tokenizer has no pad piece.
    pad = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    pad = pad if pad >= 0 else None
    print(
        f"{'architecture':<20}{'V':>8}{'H':>3}{'B':>7}{'LSH':>4}{'load':>10}"
        f"{'distinct':>10}{'dupes':>7}{'prefix coll.':>13}{'max/prefix':>11}"
        f"{'bucket use %':>16}{'LSH distinct':>14}{'LSH shared':>12}"
    )
    for name in args.architectures:
        _, hashes = parse_architecture(name)
        if hashes is None:
            continue
        num_lsh = hashes.get("num_lsh", 0)
        rule = "reference" if num_lsh == hashes["num_hashes"] else args.rule
        try:
            table = SignatureTable.from_tokens(
                tokens,
                hashes["num_hashes"],
                hashes["num_buckets"],
                pad,
                rule,
                num_lsh=num_lsh,
            )
        except ValueError as error:
            print(f"{name:<20}  cannot be built: {error}")
            continue
        s = table.statistics()
        usage = [100 * u for u in s["bucket_usage"]]
        lsh = (
            ("-", "-")
            if not num_lsh
            else (
                s["lsh_distinct"],
                s["lsh_shared_tokens"],
            )
        )
        print(
            f"{name:<20}{s['vocabulary_size']:>8}{s['num_hashes']:>3}"
            f"{s['num_buckets']:>7}{num_lsh:>4}{s['load']:>10.2e}"
            f"{s['distinct_signatures']:>10}{s['duplicate_tokens']:>7}"
            f"{s['prefix_collisions']:>13}{s['max_tokens_per_prefix']:>11}"
            f"{min(usage):>8.1f}-{max(usage):<7.1f}{lsh[0]:>14}{lsh[1]:>12}"
        )


def print_bytes(args):
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import StandardCausalLM
    from keras_mhf.models import standard_backbone
    from keras_mhf.models.model_size import synthetic_tokens
    from keras_mhf.models.model_size import weight_bytes
    from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
        parse_architecture,
    )

    print(
        f"{'architecture':<16}{'weights':>9}{'vocabulary side':>18}"
        f"{'other':>16}{'int index':>14}{'total':>16}"
    )
    reference = {}
    for name in args.architectures:
        for mode in ["float32"] + list(args.quantize):
            trunk, hashes = parse_architecture(name)
            if hashes is None:
                backbone = standard_backbone(
                    args.vocabulary_size, name, extra_layers=args.extra_layers
                )
                model = StandardCausalLM(backbone=backbone, preprocessor=None)
            else:
                model = MultiHashFormerCausalLM.from_tokens(
                    synthetic_tokens(args.vocabulary_size),
                    name,
                    pad_token_id=2,
                    num_layers=trunk["num_layers"] + args.extra_layers,
                )
            if mode != "float32":
                model.quantize(mode)
            b = weight_bytes(model)
            reference.setdefault(name, b["vocabulary"])
            ratio = reference[name] / max(b["vocabulary"], 1)
            print(
                f"{name:<16}{mode:>9}{b['vocabulary']:>18,}{b['other']:>16,}"
                f"{b['index']:>14,}{b['total']:>16,}"
                + (
                    f"  (vocabulary side {ratio:.2f}x smaller)"
                    if ratio != 1
                    else ""
                )
            )


def preset_report(preset):
    """What `--preset` prints, as a dict: the model class, `V`, the
    architecture's settings, parameters by part, the scoring temperature
    and, for MHF, `SignatureTable.statistics()` of its table."""
    from keras_mhf.models.model_size import weight_bytes
    from keras_mhf.models.preset_loading import load_causal_lm

    model = load_causal_lm(preset)
    backbone = model.backbone
    config = backbone.get_config()
    report = {
        "class": type(model).__name__,
        "vocabulary_size": int(backbone.vocabulary_size),
        "hidden_dim": config.get("hidden_dim"),
        "num_layers": config.get("num_layers"),
        "parameters": int(model.count_params()),
        "weight_bytes": weight_bytes(model),
        "scoring_temperature": getattr(model, "scoring_temperature", None),
    }
    if hasattr(backbone, "signature_lookup"):
        from keras_mhf import SignatureTable

        lookup = backbone.signature_lookup
        table = SignatureTable(
            lookup.get_signatures(),
            lookup.num_buckets,
            pad_token_id=lookup.pad_token_id,
        )
        statistics = table.statistics()
        statistics["bucket_usage"] = [
            round(u, 4) for u in statistics["bucket_usage"]
        ]
        report["num_hashes"] = int(lookup.num_hashes)
        report["num_buckets"] = int(lookup.num_buckets)
        report["signatures"] = statistics
    return report


def print_preset(preset):
    print(json.dumps(preset_report(preset), indent=2))


if __name__ == "__main__":
    main()
