"""The quickstart: train a small MultiHashFormer and its Standard baseline on
real English text that ships with Python itself (the interpreter's bundled
documentation, `pydoc_data.topics`), then generate, evaluate and export.

    bash tools/quickstart.sh                 # sets up .venv, then runs this
    bash tools/quickstart.sh --data my.jsonl --steps 600
"""

import argparse
import json
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_documentation(path):
    """Writes Python's bundled help topics (English prose written by the
    Python documentation authors) as blank-line separated documents."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(topics[k].strip() for k in sorted(topics)))
    return path


def write_jsonl(documents, path):
    """Writes documents as JSON lines (`{"text": ...}`) and returns the path."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in documents)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--data",
        default=None,
        help="corpus (.txt/.jsonl or folder); default: Python's bundled docs",
    )
    parser.add_argument(
        "--output", default=os.path.join(ROOT, "runs", "quickstart")
    )
    parser.add_argument("--architecture", default="mini_h4b1024")
    parser.add_argument("--vocabulary-size", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--prompt", default="The for statement")
    args = parser.parse_args(argv)

    import keras

    from keras_mhf.data import read_documents
    from keras_mhf.evaluation import evaluate_preset
    from keras_mhf.evaluation import write_last_word_file
    from keras_mhf.pretraining import pretrain

    started = time.time()
    os.makedirs(args.output, exist_ok=True)
    data = args.data or python_documentation(
        os.path.join(args.output, "python_docs.txt")
    )
    documents = list(read_documents(data))
    held_out = documents[-max(1, len(documents) // 20) :]
    print(
        f"Backend: {keras.config.backend()}. Corpus: {data} "
        f"({len(documents)} documents, "
        f"{sum(map(len, documents)):,} characters); "
        f"the last {len(held_out)} are held out."
    )
    # The training and held-out documents as separate files: the MHF run
    # prepares them (tokenizer, token shards) once, the Standard run reuses
    # that prepared corpus, and the evaluation below scores the same
    # held-out documents.
    train_path = write_jsonl(
        documents[: len(documents) - len(held_out)],
        os.path.join(args.output, "train.jsonl"),
    )
    held_out_jsonl = write_jsonl(
        held_out, os.path.join(args.output, "held_out.jsonl")
    )

    runs, models = {}, {}
    for name, model, arch in (
        ("mhf", "mhf", args.architecture),
        ("standard", "standard", args.architecture.split("_")[0]),
    ):
        print(f"\n=== Training {name} ({arch}) for {args.steps} steps ===")
        first = not runs
        models[name], runs[name] = pretrain(
            train_path if first else runs["mhf"]["data"],
            os.path.join(args.output, name),
            tokenizer=None if first else runs["mhf"]["tokenizer"],
            validation_data=held_out_jsonl if first else None,
            vocabulary_size=args.vocabulary_size,
            model=model,
            architecture=arch,
            sequence_length=args.sequence_length,
            batch_size=args.batch_size,
            steps=args.steps,
            checkpoint_every=max(args.steps // 3, 1),
            learning_rate=2e-3,
            warmup_steps=max(args.steps // 10, 1),
        )

    lm = models["mhf"]
    lm.compile(sampler="greedy")
    print(f"\n=== Generation (greedy), prompt {args.prompt!r} ===")
    print("MHF:     ", lm.generate(args.prompt, max_length=40))
    standard = models["standard"]
    standard.compile(sampler="greedy")
    print("Standard:", standard.generate(args.prompt, max_length=40))

    print("\n=== Evaluation on the held-out slice ===")
    held_out_path = os.path.join(args.output, "held_out.txt")
    with open(held_out_path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(held_out))
    lambada_path = write_last_word_file(
        held_out,
        os.path.join(args.output, "held_out_last_word.jsonl"),
        count=40,
    )
    results = {}
    for name in runs:
        results[name] = evaluate_preset(
            runs[name]["preset"],
            perplexity_files=[held_out_path],
            lambada_files=[lambada_path],
            sequence_length=args.sequence_length,
            batch_size=args.batch_size,
            output=os.path.join(args.output, f"{name}_eval.jsonl"),
        )
    with open(os.path.join(args.output, "evaluation.json"), "w") as f:
        json.dump(results, f, indent=2)
    for name, r in results.items():
        ppl = r[f"perplexity:{held_out_path}"]
        last_word = r[f"lambada:{lambada_path}"]
        print(
            f"{name:<9} perplexity {ppl['perplexity']:.1f} (next-token "
            f"accuracy {ppl['accuracy']:.3f}); last-word accuracy "
            f"{last_word['acc']:.3f}, "
            f"last-word perplexity {last_word['perplexity']:.1f}; "
            f"{runs[name]['parameters']:,} parameters"
        )

    print("\n=== Export ===")
    saved_model = os.path.join(args.output, "mhf", "saved_model")
    lm.export(saved_model)
    keras_file = os.path.join(args.output, "mhf", "model.keras")
    lm.save(keras_file)

    print("\n=== Where everything went ===")
    for label, path in [
        ("tokenizer", runs["mhf"]["tokenizer"]),
        ("MHF preset (from_preset)", runs["mhf"]["preset"]),
        ("MHF .keras file", keras_file),
        ("MHF TF SavedModel (serve, generate)", saved_model),
        ("Standard preset", runs["standard"]["preset"]),
        ("training logs", os.path.join(args.output, "*", "log.csv")),
        ("loss plots", os.path.join(args.output, "*", "loss.png")),
        (
            "evaluation (summary, per example)",
            os.path.join(args.output, "evaluation.json"),
        ),
    ]:
        print(f"  {label:<38} {path}")
    print(f"\nDone in {time.time() - started:.0f} s.")


if __name__ == "__main__":
    main()
