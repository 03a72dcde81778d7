"""Prints embedding / decoder / trunk / total parameters of named
architectures without allocating any weight.

    python tools/count_params.py                      # the paper's configs
    python tools/count_params.py 1b_h4b16k 100m --extra-layers 4
    python tools/count_params.py small_h4b16k --vocabulary-size 256000
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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    main()
