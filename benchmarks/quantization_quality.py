"""Quality of a quantized MultiHashFormer against its float32 self: next-token
accuracy, perplexity (paper rule and the preset's calibrated temperature),
the held-out perplexity ratio quantized / float32, and greedy generations,
on a prepared corpus's held-out windows.

    python -m benchmarks.quantization_quality \\
        --preset runs/quickstart/mhf/preset --data runs/quickstart/mhf/data
    python -m benchmarks.quantization_quality \\
        --preset RUNS/seed0/mhf_h4b16384/preset --data RUNS/data \\
        --modes int8 int4 gptq awq --output quality.json

Scores the second half of the first `--validation-blocks` validation windows
(the half `keras-mhf pretrain` reports; the calibration fit used the first)
and generates `--prompts` greedy continuations of `--new-tokens` tokens from
the first `--prompt-length` tokens of validation windows. `gptq` and `awq`
calibrate on `--calibration-samples` windows of the *train* split
(`keras.quantizers.GPTQConfig` / `AWQConfig`, `--weight-bits` and
`--group-size`), never on the held-out text. Prints a table and writes JSON.
"""

import argparse

import numpy as np

from benchmarks import common
from benchmarks import result_tables


def parse_args(argv=None):
    p = common.argument_parser(
        "quantization_quality",
        __doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", required=True, help="a trained MHF preset")
    p.add_argument(
        "--data", required=True, help="the prepared corpus it was trained on"
    )
    p.add_argument("--modes", nargs="+", default=["int8"])
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--validation-blocks", type=int, default=64)
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument(
        "--calibration-samples",
        type=int,
        default=128,
        help="gptq/awq: calibration windows from the train split",
    )
    p.add_argument(
        "--calibration-length",
        type=int,
        default=None,
        help="gptq/awq: tokens per calibration window (--sequence-length)",
    )
    p.add_argument(
        "--weight-bits", type=int, default=4, help="gptq: 2, 3, 4 or 8"
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=128,
        help="gptq/awq: weights per scale (-1: per channel)",
    )
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def quantization_config(mode, args, corpus, tokenizer):
    """`None` for int8/int4 (Keras' defaults); a `GPTQConfig` / `AWQConfig`
    calibrating on train-split windows for gptq/awq."""
    import keras

    from keras_mhf.data import validation_windows

    if mode not in ("gptq", "awq"):
        return None
    length = args.calibration_length or args.sequence_length
    windows = validation_windows(
        corpus, length, count=args.calibration_samples, split="train"
    )
    calibration = dict(
        dataset=list(windows),
        tokenizer=tokenizer,
        num_samples=len(windows),
        sequence_length=length,
        group_size=args.group_size,
    )
    if mode == "gptq":
        return keras.quantizers.GPTQConfig(
            weight_bits=args.weight_bits, **calibration
        )
    return keras.quantizers.AWQConfig(**calibration)


def load(preset):
    """`(model without its preprocessor, tokenizer)`: the model reads and
    writes token ids (and Keras' `quantize` locks a model's attributes, so
    the preprocessor could not be detached afterwards)."""
    from keras_mhf.models import MultiHashFormerCausalLM

    lm = MultiHashFormerCausalLM.from_preset(preset)
    tokenizer = lm.preprocessor.tokenizer
    lm.preprocessor = None
    return lm, tokenizer


def measure(lm, blocks, prompts, new_tokens):
    """Metrics of `blocks` and greedy continuations of `prompts` (`lm`
    without a preprocessor: ids in and out)."""
    from keras_mhf import evaluation

    metrics = evaluation.perplexity(lm, blocks)
    b, length = prompts.shape
    total = length + new_tokens
    token_ids = np.zeros((b, total), "int32")
    padding_mask = np.zeros((b, total), bool)
    token_ids[:, :length], padding_mask[:, :length] = prompts, True
    out = lm.generate(
        {"token_ids": token_ids, "padding_mask": padding_mask},
        stop_token_ids=None,
    )
    return metrics, np.asarray(out["token_ids"])[:, length:]


def main(argv=None):
    args = parse_args(argv)
    from keras_mhf.data import PreparedCorpus
    from keras_mhf.data import validation_windows
    from keras_mhf.pretraining.validation import split_validation_windows

    corpus = PreparedCorpus(args.data)
    blocks = validation_windows(
        corpus, args.sequence_length, count=args.validation_blocks
    )
    _, (start, end) = split_validation_windows(len(blocks))
    reported = blocks[start:end]
    count = max(args.prompts, 1)
    windows = validation_windows(corpus, args.prompt_length - 1, count=count)
    if len(windows) < args.prompts:
        raise SystemExit(
            f"The validation split holds only {len(windows)} prompts of "
            f"{args.prompt_length} tokens; pass --prompts {len(windows)}."
        )
    results = {"preset": args.preset, "tokens": int(reported[:, 1:].size)}
    lm, tokenizer = load(args.preset)
    corpus.check_tokenizer(tokenizer)
    lm.compile(sampler="greedy")
    results["scoring_temperature"] = lm.scoring_temperature
    base, base_tokens = measure(lm, reported, windows, args.new_tokens)
    results["float32"] = base
    for mode in args.modes:
        lm, tokenizer = load(args.preset)
        lm.quantize(
            mode, config=quantization_config(mode, args, corpus, tokenizer)
        )
        lm.compile(sampler="greedy")
        metrics, tokens = measure(lm, reported, windows, args.new_tokens)
        same = float(np.mean(np.all(tokens == base_tokens, axis=-1)))
        metrics["greedy_identical"] = same
        metrics["accuracy_change_points"] = 100 * (
            metrics["accuracy"] - base["accuracy"]
        )
        metrics["perplexity_change"] = (
            metrics["perplexity"] / base["perplexity"] - 1
        )
        metrics["perplexity_ratio"] = metrics["perplexity"] / base["perplexity"]
        results[mode] = metrics
    report = result_tables.quality_report(
        results, args.preset, args.prompts, args.new_tokens
    )
    print(report)
    results["report"] = report
    if args.output:
        common.write_json(args.output, results, indent=1)


if __name__ == "__main__":
    main()
