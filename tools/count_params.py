"""Prints embedding / decoder / trunk / total parameters of named
architectures without allocating any weight.

    python tools/count_params.py                      # the paper's configs
    python tools/count_params.py 1b_h4b16k 100m --extra-layers 4
    python tools/count_params.py small_h4b16k --vocabulary-size 256000
    python tools/count_params.py mini_h4b1024 mini --bytes --quantize int8

`--bytes` builds each model (allocating its weights) and prints the bytes
its weights take as stored, in float32 and after each `--quantize` mode:
the vocabulary side (MHF bucket tables, Standard embedding) separately.
"""

import argparse

from keras_mhf.models.multi_hash_former_architectures import count_parameters

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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "architectures",
        nargs="*",
        default=PAPER,
        help="names like 1b, 1b_h4b16k, tiny_h3b512 (default: the paper's)",
    )
    parser.add_argument(
        "--vocabulary-size",
        type=int,
        default=32768,
        help="V; only the Standard embedding depends on it (default 32768)",
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
    args = parser.parse_args(argv)
    if args.quantize and not args.bytes:
        parser.error("--quantize needs --bytes")
    if args.bytes:
        return print_bytes(args)
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


def print_bytes(args):
    from keras_mhf import benchmarking
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import StandardCausalLM
    from keras_mhf.models import standard_backbone
    from keras_mhf.models.multi_hash_former_architectures import (
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
                    benchmarking.synthetic_tokens(args.vocabulary_size),
                    name,
                    pad_token_id=2,
                    num_layers=trunk["num_layers"] + args.extra_layers,
                )
            if mode != "float32":
                model.quantize(mode)
            b = benchmarking.weight_bytes(model)
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


if __name__ == "__main__":
    main()
