"""Evaluate a saved MultiHashFormer or Standard model (a preset directory).

    python recipes/evaluate.py --preset runs/mhf/preset \
        --perplexity ../shared/data/openstax_edu_en/validation_00.jsonl \
        --lambada lambada_test.jsonl --multiple-choice piqa.jsonl arc_easy.jsonl \
        --card660 card660.tsv --output results.jsonl

Metrics follow lm-eval: perplexity over the real vocabulary; LAMBADA (OpenAI
jsonl, target = last word) acc and perplexity as `lambada_openai`; multiple
choice ({"query", "choices", "gold"}) acc and acc_norm; Card-660-format rare-word
similarity (Pearson/Spearman of last-token cosine similarity, final and
second-to-last layer). --output writes one JSON line per example.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", required=True, help="preset directory (MHF or Standard)")
    p.add_argument("--perplexity", nargs="*", default=[], help="held-out .txt/.jsonl files")
    p.add_argument("--lambada", nargs="*", default=[], help="LAMBADA-format .jsonl files")
    p.add_argument("--multiple-choice", nargs="*", default=[],
                   help='{"query", "choices", "gold"} .jsonl files')
    p.add_argument("--card660", nargs="*", default=[], help="word1<TAB>word2<TAB>score files")
    p.add_argument("--sequence-length", type=int, default=128,
                   help="block length for perplexity")
    p.add_argument("--max-blocks", type=int, default=256, help="blocks scored for perplexity")
    p.add_argument("--limit", type=int, default=None, help="examples per task file")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--output", default=None, help="per-example results as JSON lines")
    return p.parse_args(argv)


def evaluate(preset, perplexity=(), lambada=(), multiple_choice=(), card660=(),
             sequence_length=128, max_blocks=256, limit=None, batch_size=8, output=None):
    """Runs the requested evaluations; returns `{task: metrics}`."""
    import keras_hub
    import sentencepiece as spm

    import keras_mhf  # noqa: F401 (registers the MHF classes)
    from keras_mhf import evaluation
    from keras_mhf.data import pack_documents
    from keras_mhf.data import read_documents

    model = keras_hub.models.CausalLM.from_preset(preset)
    tokenizer = model.preprocessor.tokenizer
    results, lines = {}, []

    def record(task, path, metrics, examples):
        results[f"{task}:{os.path.basename(path)}"] = metrics
        lines.extend({"task": task, "file": path, **e} for e in examples)

    for path in perplexity:
        sp = spm.SentencePieceProcessor(model_proto=tokenizer.proto)
        blocks = pack_documents(read_documents(path), sp.encode,
                                tokenizer.start_token_id, sequence_length)[:max_blocks]
        record("perplexity", path, evaluation.perplexity(model, blocks, batch_size), [])
    for path in lambada:
        record("lambada", path, *evaluation.lambada(model, tokenizer, path, batch_size, limit))
    for path in multiple_choice:
        record("multiple_choice", path,
               *evaluation.multiple_choice(model, tokenizer, path, batch_size, limit))
    for path in card660:
        record("rare_words", path,
               *evaluation.rare_word_similarity(model, tokenizer, path, batch_size, limit))
    if output:
        with open(output, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return results


def main(argv=None):
    args = parse_args(argv)
    results = evaluate(
        args.preset, args.perplexity, args.lambada, args.multiple_choice, args.card660,
        args.sequence_length, args.max_blocks, args.limit, args.batch_size, args.output,
    )
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
