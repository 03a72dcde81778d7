"""Evaluation speed: the compiled, length-bucketed scorer against the eager
`model.score()` path that evaluation used before, on LAMBADA-style and
PIQA-style requests, with the same numbers checked.

    KERAS_BACKEND=jax python -m benchmarks.benchmark_evaluation
    python -m benchmarks.benchmark_evaluation --examples 96 \
        --reference-examples 24

The requests come from the held-out openstax text (`../shared/data`;
LAMBADA-style: a passage and its last word; PIQA-style: the start of a
paragraph with two candidate continuations, its own and another paragraph's),
scored by an untrained MultiHashFormer with the Mistral tokenizer (speed does
not depend on training). Writes JSON and prints a table.
"""

import argparse
import os
import time

from benchmarks import common
from benchmarks import result_tables


def parse_args(argv=None):
    p = common.argument_parser(
        "benchmark_evaluation",
        __doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--architecture", default="mini_h4b1024")
    p.add_argument("--examples", type=int, default=96)
    p.add_argument(
        "--reference-examples",
        type=int,
        default=24,
        help="examples scored with the slow eager path",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--output",
        default=os.path.join(common.RESULTS, "benchmark_evaluation.json"),
    )
    return p.parse_args(argv)


def requests(documents, count):
    """`{"lambada": [...], "piqa": [...]}` lists of (context, continuation)
    pairs; PIQA-style examples contribute two requests each."""
    paragraphs = [
        p.split()
        for doc in documents
        for p in doc.split("\n")
        if len(p.split()) >= 30
    ]
    lambada, piqa = [], []
    for i, words in enumerate(paragraphs):
        last = words[25].rstrip(".,;:!?\"')")
        if last.isalpha() and len(lambada) < count:
            lambada.append((" ".join(words[:25]), " " + last))
        other = paragraphs[(i + 7) % len(paragraphs)]
        if len(piqa) < 2 * count:
            query = " ".join(words[:12])
            piqa.append((query, " " + " ".join(words[12:20])))
            piqa.append((query, " " + " ".join(other[12:20])))
    return {"lambada": lambada, "piqa": piqa}


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main(argv=None):
    args = parse_args(argv)
    import keras
    import numpy as np

    from keras_mhf import evaluation
    from keras_mhf.data import read_documents
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import MultiHashFormerTokenizer

    tokenizer = MultiHashFormerTokenizer(common.MISTRAL)
    documents = list(
        read_documents(os.path.join(common.OPENSTAX, "validation_00.jsonl"))
    )
    keras.utils.set_random_seed(0)
    model = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, args.architecture, sequence_length=128
    )
    tasks = requests(documents, args.examples)
    per_example = {"lambada": 1, "piqa": 2}
    results = {"backend": keras.config.backend(), "settings": vars(args)}
    for task, pairs in tasks.items():
        n_ref = args.reference_examples * per_example[task]
        reference, t_ref = timed(
            lambda: evaluation.loglikelihoods(
                model, tokenizer, pairs[:n_ref], args.batch_size, reference=True
            )
        )
        first, t_first = timed(
            lambda: evaluation.loglikelihoods(
                model, tokenizer, pairs, args.batch_size
            )
        )
        second, t_second = timed(
            lambda: evaluation.loglikelihoods(
                model, tokenizer, pairs, args.batch_size
            )
        )
        difference = float(
            np.max(np.abs([a[0] - b[0] for a, b in zip(reference, first)]))
        )
        same_greedy = all(a[1] == b[1] for a, b in zip(reference, first))
        examples = len(pairs) / per_example[task]
        row = {
            "reference_examples_per_s": n_ref / per_example[task] / t_ref,
            "compiled_examples_per_s_first_pass": examples / t_first,
            "compiled_examples_per_s": examples / t_second,
            "examples": examples,
            "reference_examples": n_ref / per_example[task],
            "max_loglikelihood_difference": difference,
            "same_greedy_flags": same_greedy,
        }
        row["speedup_first_pass"] = (
            row["compiled_examples_per_s_first_pass"]
            / row["reference_examples_per_s"]
        )
        row["speedup"] = (
            row["compiled_examples_per_s"] / row["reference_examples_per_s"]
        )
        results[task] = row
    report = result_tables.evaluation_speed_report(
        results, tokenizer.vocabulary_size()
    )
    print(report)
    common.write_json(args.output, results)
    with open(os.path.splitext(args.output)[0] + ".md", "w") as f:
        f.write(report + "\n")


if __name__ == "__main__":
    main()
