"""The quickstart: train a small MultiHashFormer and its Standard baseline on
real English text that ships with Python itself (the interpreter's bundled
documentation, `pydoc_data.topics`), then generate, evaluate and export.

The MHF run calibrates its scoring temperature at the end (on the validation
slice); the evaluation, on a separate test slice, reports perplexity under the
paper's rule and calibrated, ECE, next-token and last-word accuracy.

    keras-mhf quickstart                     # writes runs/quickstart/
    keras-mhf quickstart --data my.jsonl --steps 600
    bash tools/quickstart.sh                 # from a checkout: sets up .venv too
"""

import json
import os
import time

# Before keras_mhf (and so TensorFlow) is imported: drops TensorFlow's
# start-up lines that mean nothing on a CPU machine (see
# keras_mhf/utils/native_logs.py; KERAS_MHF_QUIET_STARTUP=0 shows them).
os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")

from keras_mhf.cli.common import parser_from_doc  # noqa: E402
from keras_mhf.cli.common import refuse_output_over_input  # noqa: E402


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


def describe_evaluation(perplexity, last_word, summary):
    """One line of the evaluation: perplexity under the paper's rule and
    calibrated (MHF), the fitted temperature, ECE, next-token and last-word
    accuracy, parameters.

    Args:
        perplexity: `evaluate_preset`'s perplexity metrics of the model.
        last_word: its last-word (`lambada`) metrics, or `None` when the
            test slice held no last-word passage.
        summary: the model's pre-training summary (`scoring_temperature`,
            `calibration`, `parameters`).
    """
    # A calibrated model's metrics are under its temperature, with the
    # paper's rule nested; otherwise there is one rule.
    paper = perplexity.get("paper_rule", perplexity)
    last_word_accuracy = (
        f"last-word accuracy {last_word['acc']:.3f}"
        if last_word is not None
        else "no last-word passages"
    )
    accuracies = (
        f"next-token accuracy {perplexity['accuracy']:.3f}; "
        f"{last_word_accuracy}; {summary['parameters']:,} parameters"
    )
    if summary["scoring_temperature"] is None:
        return (
            f"perplexity {perplexity['perplexity']:.1f} (one scoring rule), "
            f"ECE {perplexity['ece']:.3f}; {accuracies}"
        )
    if not summary["calibration"]["applied"]:
        return (
            f"perplexity {paper['perplexity']:.1f} (paper rule; not "
            f"calibrated: {summary['calibration']['reason']}), ECE "
            f"{paper['ece']:.3f}; {accuracies}"
        )
    return (
        f"perplexity {paper['perplexity']:.1f} (paper rule) / "
        f"{perplexity['perplexity']:.1f} (calibrated, temperature "
        f"{summary['scoring_temperature']:.3f}), ECE {paper['ece']:.3f} / "
        f"{perplexity['ece']:.3f}; {accuracies}"
    )


def build_parser(prog=None):
    parser = parser_from_doc(__doc__, prog)
    parser.add_argument(
        "--data",
        default=None,
        help="corpus (.txt/.jsonl or folder); default: Python's bundled docs",
    )
    parser.add_argument(
        "--output",
        default=os.path.join("runs", "quickstart"),
        help="directory for both runs, the evaluation and the exports",
    )
    parser.add_argument(
        "--architecture",
        default="mini_h4b1024",
        help="the MHF architecture (the Standard run uses its trunk)",
    )
    parser.add_argument(
        "--vocabulary-size",
        type=int,
        default=4000,
        help="size of the SentencePiece tokenizer trained on the corpus",
    )
    parser.add_argument(
        "--steps", type=int, default=600, help="training steps of each run"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="windows per step"
    )
    parser.add_argument(
        "--sequence-length", type=int, default=128, help="tokens per window"
    )
    parser.add_argument(
        "--prompt",
        default="The for statement",
        help="the prompt both models continue",
    )
    return parser


def split_corpus(args):
    """Reads the corpus and writes its slices: `(train.jsonl path,
    validation.jsonl path, test documents)`.

    Two held-out slices of the last documents: the validation slice (the
    runs' validation windows; the MHF run fits its scoring temperature on
    the first half of them) and the test slice, which neither training nor
    calibration sees, for the evaluation. The training and validation
    documents are separate files: the MHF run prepares them (tokenizer,
    token shards) once and the Standard run reuses that prepared corpus."""
    import keras

    from keras_mhf.data import read_documents

    data = args.data or python_documentation(
        os.path.join(args.output, "python_docs.txt")
    )
    documents = list(read_documents(data))
    size = max(1, len(documents) // 20)
    held_out = documents[-size:]
    validation = documents[-2 * size : -size]
    train = documents[: len(documents) - 2 * size]
    print(
        f"Backend: {keras.config.backend()}. Corpus: {data} "
        f"({len(documents)} documents, "
        f"{sum(map(len, documents)):,} characters); of the last "
        f"{2 * size}, {len(validation)} are the validation slice (validation "
        f"and calibration) and {len(held_out)} the test slice (evaluation)."
    )
    train_path = write_jsonl(train, os.path.join(args.output, "train.jsonl"))
    validation_path = write_jsonl(
        validation, os.path.join(args.output, "validation.jsonl")
    )
    return train_path, validation_path, held_out


def train_both(args, train_path, validation_path):
    """Pre-trains the MHF, then the Standard baseline on its prepared
    corpus and tokenizer: `(models, run summaries)`, keyed "mhf" and
    "standard"."""
    from keras_mhf.pretraining import pretrain

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
            validation_data=validation_path if first else None,
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
    return models, runs


def generate_both(models, prompt):
    """Greedy continuations of `prompt` by both models."""
    print(f"\n=== Generation (greedy), prompt {prompt!r} ===")
    for name, label in (("mhf", "MHF:     "), ("standard", "Standard:")):
        models[name].compile(sampler="greedy")
        print(label, models[name].generate(prompt, max_length=40))


def write_last_word_task(args, held_out):
    """Writes the test slice's last-word passages
    (`held_out_last_word.jsonl`) before anything trains and returns its
    path, or `None`, with a note, when the slice yields none (documents
    shorter than 8 words, or not ending in a word): the evaluation then
    leaves that task out instead of failing after both runs trained."""
    from keras_mhf.evaluation.tasks import last_word_passages
    from keras_mhf.evaluation.tasks import write_last_word_file

    if not last_word_passages(held_out, count=40):
        print(
            "Note: the test slice yields no last-word passage (each needs a "
            "document of at least 8 words ending in a word), so the "
            "last-word accuracy is left out of the evaluation."
        )
        return None
    return write_last_word_file(
        held_out,
        os.path.join(args.output, "held_out_last_word.jsonl"),
        count=40,
    )


def evaluate_both(args, runs, held_out, lambada_path):
    """Perplexity and last-word accuracy (unless `lambada_path` is `None`:
    see `write_last_word_task`) of both presets on the test slice; writes
    `evaluation.json` and prints one line per model."""
    from keras_mhf.evaluation import evaluate_preset

    print(
        "\n=== Evaluation on the test slice (unseen in training and "
        "calibration) ==="
    )
    held_out_path = os.path.join(args.output, "held_out.txt")
    with open(held_out_path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(held_out))
    results = {}
    for name in runs:
        results[name] = evaluate_preset(
            runs[name]["preset"],
            perplexity_files=[held_out_path],
            lambada_files=[lambada_path] if lambada_path else [],
            sequence_length=args.sequence_length,
            batch_size=args.batch_size,
            output=os.path.join(args.output, f"{name}_eval.jsonl"),
        )
    with open(os.path.join(args.output, "evaluation.json"), "w") as f:
        json.dump(results, f, indent=2)
    for name, r in results.items():
        print(
            f"{name:<9} "
            + describe_evaluation(
                r[f"perplexity:{held_out_path}"],
                r.get(f"lambada:{lambada_path}"),
                runs[name],
            )
        )


def export_mhf(lm, output):
    """The MHF as a TF SavedModel, a `.keras` file and a Hugging Face
    checkpoint under `output/mhf`: `{label: path}`."""
    print("\n=== Export ===")
    saved_model = os.path.join(output, "mhf", "saved_model")
    lm.export(saved_model, overwrite=True)
    print(
        f"TF SavedModel (serve, score, generate, text endpoints): {saved_model}"
    )
    keras_file = os.path.join(output, "mhf", "model.keras")
    lm.save(keras_file)
    print(f"Keras file (keras.saving.load_model): {keras_file}")
    hugging_face = os.path.join(output, "mhf", "hugging_face")
    lm.export_to_transformers(hugging_face, overwrite=True)
    print(
        "Hugging Face checkpoint (the authors' format; from_preset loads it "
        f"back): {hugging_face}"
    )
    return {
        "MHF .keras file": keras_file,
        "MHF TF SavedModel (ids and text endpoints)": saved_model,
        "MHF Hugging Face checkpoint": hugging_face,
    }


def print_outputs(output, runs, exports, comparison):
    """Where each artifact of the quickstart went, relative to the working
    directory when `output` was given that way (the runs hold their paths
    resolved)."""
    print("\n=== Where everything went ===")
    for label, path in [
        ("tokenizer", runs["mhf"]["tokenizer"]),
        ("MHF preset (from_preset)", runs["mhf"]["preset"]),
        *exports.items(),
        ("Standard preset", runs["standard"]["preset"]),
        ("training logs", os.path.join(output, "*", "log.csv")),
        ("loss plots", os.path.join(output, "*", "loss.png")),
        (
            "validation perplexity, MHF vs Standard",
            comparison or "(not drawn: needs matplotlib)",
        ),
        (
            "evaluation (summary, per example)",
            os.path.join(output, "evaluation.json"),
        ),
    ]:
        if not os.path.isabs(output) and os.path.isabs(path):
            path = os.path.relpath(path)
        print(f"  {label:<44} {path}")


def main(argv=None, prog=None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.data is not None and os.path.isdir(args.data):
        # Its split and runs are written into --output: not into the
        # corpus folder (which the reader would take in), nor around it.
        refuse_output_over_input(
            parser, args.output, args.data, "--output", "--data"
        )
    from keras_mhf.pretraining.logs import plot_comparison
    from keras_mhf.utils.progress import show_progress

    show_progress()  # evaluation and calibration report progress
    started = time.time()
    os.makedirs(args.output, exist_ok=True)
    train_path, validation_path, held_out = split_corpus(args)
    lambada_path = write_last_word_task(args, held_out)
    models, runs = train_both(args, train_path, validation_path)
    standard_trunk = args.architecture.split("_")[0]
    comparison = plot_comparison(
        {
            f"MHF {args.architecture} (calibrated)": runs["mhf"]["log"],
            f"Standard {standard_trunk}": runs["standard"]["log"],
        },
        os.path.join(args.output, "comparison.png"),
    )
    generate_both(models, args.prompt)
    evaluate_both(args, runs, held_out, lambada_path)
    exports = export_mhf(models["mhf"], args.output)
    print_outputs(args.output, runs, exports, comparison)
    print(f"\nDone in {time.time() - started:.0f} s.")


if __name__ == "__main__":
    main()
