"""Pre-train a MultiHashFormer (or the Standard baseline) with `model.fit`.

    python recipes/pretrain.py --data ../shared/data/openstax_edu_en \
        --output runs/mhf \
        --tokenizer ../shared/data/mistral_v03_tokenizer/tokenizer.model \
        --architecture mini_h4b1024 --steps 300

Documents (.txt paragraphs or .jsonl {"text": ...}) are packed into fixed-length
sequences with <s> between documents; AdamW (decay 0.1, not on norms/biases),
linear warmup + cosine decay, global-norm clipping 1.0. After every
--checkpoint-every steps: validation perplexity over the real vocabulary, a line
in log.csv and a checkpoint; rerunning the same command after a crash resumes
exactly. The final model is saved as a KerasHub preset in OUTPUT/preset, with
OUTPUT/loss.png and OUTPUT/summary.json. Importable: `from keras_mhf.pretraining
import pretrain`.
"""

import argparse
import json


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--data",
        required=True,
        help="a .txt/.jsonl file or a directory of them",
    )
    p.add_argument(
        "--output", required=True, help="output directory (reused to resume)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="SentencePiece .model; default: train one on the data",
    )
    p.add_argument(
        "--vocabulary-size",
        type=int,
        default=4000,
        help="pieces of the tokenizer trained when --tokenizer is not given",
    )
    p.add_argument("--model", choices=["mhf", "standard"], default="mhf")
    p.add_argument(
        "--architecture",
        default="mini_h4b1024",
        help="e.g. tiny_h3b512, mini_h4b1024, 100m_h4b16k (trunk only for "
        "standard)",
    )
    p.add_argument("--extra-layers", type=int, default=0, help="Standard+kL")
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument(
        "--learning-rate", type=float, default=2e-3, help="peak learning rate"
    )
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument(
        "--validation-data",
        default=None,
        help="held-out file/directory; default: the last documents of --data",
    )
    p.add_argument("--validation-fraction", type=float, default=0.05)
    p.add_argument(
        "--validation-blocks",
        type=int,
        default=64,
        help="at most this many held-out sequences are scored",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="steps between validation, log line and checkpoint",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="cap on training tokens"
    )
    p.add_argument(
        "--mixed-precision", action="store_true", help="train in mixed_bfloat16"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--distribution",
        choices=["data", "model"],
        default=None,
        help="train over all devices (JAX backend only)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="(batch)x(model) device mesh, e.g. 2x4 (required for "
        "--distribution model)",
    )
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from keras_mhf.pretraining import pretrain

    _, summary = pretrain(
        data=args.data,
        output_dir=args.output,
        tokenizer=args.tokenizer,
        vocabulary_size=args.vocabulary_size,
        model=args.model,
        architecture=args.architecture,
        extra_layers=args.extra_layers,
        sequence_length=args.sequence_length,
        batch_size=args.batch_size,
        steps=args.steps,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        validation_data=args.validation_data,
        validation_fraction=args.validation_fraction,
        validation_blocks=args.validation_blocks,
        checkpoint_every=args.checkpoint_every,
        max_tokens=args.max_tokens,
        mixed_precision=args.mixed_precision,
        seed=args.seed,
        distribution=args.distribution,
        mesh=args.mesh,
    )
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
