"""Generate text from a preset, printed as it is made.

    keras-mhf generate --preset runs/quickstart/mhf/preset "The cell"
    keras-mhf generate --preset P --prompt-file prompts.txt > answers.jsonl
    keras-mhf generate --preset P                 # a prompt loop (a terminal)
    printf 'The cell\\nWater boils\\n' | keras-mhf generate --preset P

A prompt argument prints its continuation as it comes. `--prompt-file`
reads one prompt per line and writes JSON Lines (`prompt`, `completion`,
`finish_reason`). With neither, a terminal gets a prompt loop (Ctrl-C ends
the answer being written, Ctrl-D or Ctrl-C at the prompt ends the loop);
lines from a pipe are answered one by one, an answer per line.

`--sampler greedy` (the default) is `generate`'s greedy decoding;
`top_k`, `top_p` and `random` sample at `--temperature`, and `--seed` makes
that repeatable. Generation ends at the end token, after --max-new-tokens, or
before a `--stop` text.
"""

import json
import sys

from keras_mhf.cli.common import parser_from_doc
from keras_mhf.settings.rules import preset_directory

# `keras_mhf.models.generation_stream.SAMPLERS`, which imports Keras: the
# arguments are checked before Keras loads.
SAMPLERS = ("greedy", "top_k", "top_p", "random")


def build_parser(prog=None):
    parser = parser_from_doc(__doc__, prog)
    parser.add_argument("prompt", nargs="?", help="the prompt")
    parser.add_argument(
        "--preset",
        required=True,
        type=preset_directory,
        help="preset directory (or a Hugging Face export, or a .keras file)",
    )
    parser.add_argument(
        "--prompt-file", help="one prompt per line; JSON Lines out"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="most new tokens per prompt",
    )
    parser.add_argument(
        "--sampler",
        choices=SAMPLERS,
        default="greedy",
        help="how each token is chosen",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="divides the scores before sampling (not greedy)",
    )
    parser.add_argument(
        "--top-k", type=int, default=5, help="candidates for top_k"
    )
    parser.add_argument(
        "--top-p", type=float, default=0.9, help="probability mass for top_p"
    )
    parser.add_argument(
        "--seed", type=int, help="seed of the sampler (repeatable sampling)"
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end the answer before this text (repeatable)",
    )
    parser.add_argument(
        "--truncate-left",
        action="store_true",
        help="keep the end of a prompt too long for the model, instead of "
        "refusing it",
    )
    return parser


def _check(parser, args):
    if args.prompt is not None and args.prompt_file is not None:
        parser.error("give a prompt or --prompt-file, not both.")
    if args.max_new_tokens < 1:
        parser.error(
            f"--max-new-tokens must be >= 1; got {args.max_new_tokens}."
        )
    if args.sampler != "greedy" and not args.temperature > 0:
        parser.error(
            f"--temperature must be > 0 to sample; got {args.temperature} "
            "(--sampler greedy for the most likely tokens)."
        )
    if args.top_k < 1:
        parser.error(f"--top-k must be >= 1; got {args.top_k}.")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1]; got {args.top_p}.")


class _Generator:
    """The loaded model and the command's settings: `stream(prompt)`
    yields text pieces (`generate_stream`) and leaves `finish_reason`."""

    def __init__(self, lm, args):
        from keras_mhf.models.generation_stream import make_sampler

        self.lm = lm
        self.args = args
        # One sampler for the run: with --seed, the same run gives the same
        # answers.
        self.sampler = make_sampler(
            args.sampler, args.temperature, args.top_k, args.top_p, args.seed
        )
        self.finish_reason = None

    def stream(self, prompt):
        self.finish_reason = None
        stream = self.lm.generate_stream(
            prompt,
            max_new_tokens=self.args.max_new_tokens,
            truncate="left" if self.args.truncate_left else None,
            stop=self.args.stop,
            sampler=self.sampler,
        )
        yield from stream
        self.finish_reason = stream.finish_reasons[0]


def _print_answer(generator, prompt):
    for piece in generator.stream(prompt):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


def _prompt_file(generator, path):
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            prompt = line.rstrip("\n")
            if not prompt.strip():
                continue
            completion = "".join(generator.stream(prompt))
            record = {
                "line": number,
                "prompt": prompt,
                "completion": completion,
                "finish_reason": generator.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False), flush=True)


def _loop(generator, interactive):
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()
            return
        if not interactive and line == "":
            return  # the pipe's end
        prompt = line.rstrip("\n")
        if not prompt.strip():
            if not interactive:
                print(flush=True)
            continue
        try:
            _print_answer(generator, prompt)
        except KeyboardInterrupt:
            # Ctrl-C ends this answer, not the loop.
            print(" [stopped]", flush=True)
            if not interactive:
                return


def main(argv=None, prog=None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    _check(parser, args)
    from keras_mhf.models.preset_loading import load_causal_lm

    lm = load_causal_lm(args.preset)
    if lm.preprocessor is None:
        parser.error(f"{args.preset} has no tokenizer; generate needs text.")
    generator = _Generator(lm, args)
    try:
        if args.prompt is not None:
            _print_answer(generator, args.prompt)
        elif args.prompt_file is not None:
            _prompt_file(generator, args.prompt_file)
        else:
            _loop(generator, sys.stdin.isatty())
    except ValueError as error:  # a prompt that does not fit, a bad line
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    return 0
