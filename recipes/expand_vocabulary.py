"""Expand the vocabulary of a trained MHF and a trained Standard model with
Arabic, Chinese and Hindi tokens, continue pre-training both, and compare
(paper Sec. 4.4).

    python recipes/expand_vocabulary.py --mhf runs/mhf/preset \
        --standard runs/std/preset \
        --data ../shared/data/multilingual_ar_zh_hi --output runs/ve

New pieces are learned per language with SentencePiece on DATA/<lang>/ (all
files but the FLORES devtest one, held out for validation) and appended after
the old ids; the old tokenizer's output on English is checked to be unchanged.
MHF gets the new tokens with `expand_vocabulary` (zero new parameters); Standard
grows its embedding with mean-initialised rows. Both then continue pre-training
on the same mix of English and the new languages, training the embeddings/hash
interface, the first two and last two blocks and the final norm, the other
blocks frozen. The report (report.md, report.json) gives parameters added,
tokens per character and validation perplexity / nats per character per
language, before and after.
"""

import argparse
import glob
import json
import os


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--mhf", required=True, help="preset of a trained MultiHashFormer"
    )
    p.add_argument(
        "--standard",
        required=True,
        help="preset of a Standard model with the same tokenizer",
    )
    p.add_argument(
        "--data",
        default="../shared/data/multilingual_ar_zh_hi",
        help="folder with one sub-folder of .txt files per language",
    )
    p.add_argument("--languages", nargs="+", default=["ar", "zh", "hi"])
    p.add_argument(
        "--english",
        default=None,
        help="folder of English .txt mixed into continual pre-training and "
        "evaluated (default: DATA/en)",
    )
    p.add_argument("--pieces-per-language", type=int, default=1000)
    p.add_argument(
        "--steps", type=int, default=200, help="continual pre-training steps"
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument(
        "--max-train-lines",
        type=int,
        default=20000,
        help="training lines read per language",
    )
    p.add_argument(
        "--validation-lines",
        type=int,
        default=200,
        help="held-out lines scored per language",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", required=True)
    return p.parse_args(argv)


def read_language(folder, max_train_lines, validation_lines):
    """(train lines, validation lines): FLORES devtest is held out."""
    from keras_mhf.data import read_documents

    files = sorted(glob.glob(os.path.join(folder, "*.txt")))
    if not files:
        raise ValueError(f"No .txt files in {folder}.")
    held = [f for f in files if "flores" in os.path.basename(f)] or files[-1:]
    train = [line for f in files if f not in held for line in read_documents(f)]
    validation = [line for f in held for line in read_documents(f)]
    if not train:  # a single file: split it
        train, validation = validation[validation_lines:], validation
    return train[:max_train_lines], validation[:validation_lines]


def expand_vocabulary_experiment(
    mhf,
    standard,
    data,
    output,
    languages=("ar", "zh", "hi"),
    english=None,
    pieces_per_language=1000,
    steps=200,
    batch_size=8,
    sequence_length=128,
    learning_rate=1e-3,
    warmup_steps=20,
    max_train_lines=20000,
    validation_lines=200,
    seed=0,
    verbose=1,
):
    """Runs the experiment; returns the report dict (also written to disk)."""
    import keras
    import keras_hub
    import numpy as np
    import sentencepiece as spm

    import keras_mhf  # noqa: F401 (registers the MHF classes)
    from keras_mhf.data import pack_documents
    from keras_mhf.evaluation import document_likelihood
    from keras_mhf.models import MultiHashFormerTokenizer
    from keras_mhf.pretraining import data_order
    from keras_mhf.pretraining import fit_blocks
    from keras_mhf.pretraining import make_optimizer
    from keras_mhf.utils.keras_utils import count_trainable_parameters
    from keras_mhf.vocabulary_expansion import expand_sentencepiece
    from keras_mhf.vocabulary_expansion import expand_standard_vocabulary
    from keras_mhf.vocabulary_expansion import freeze_for_continual_pretraining

    os.makedirs(output, exist_ok=True)
    models = {
        "mhf": keras_hub.models.CausalLM.from_preset(mhf),
        "standard": keras_hub.models.CausalLM.from_preset(standard),
    }
    old_tokenizer = models["mhf"].preprocessor.tokenizer
    if (
        models["standard"].preprocessor.tokenizer.get_vocabulary()
        != old_tokenizer.get_vocabulary()
    ):
        raise ValueError(
            "The MHF and Standard models must share one tokenizer."
        )

    texts = {
        lang: read_language(
            os.path.join(data, lang), max_train_lines, validation_lines
        )
        for lang in languages
    }
    texts["en"] = read_language(
        english or os.path.join(data, "en"), max_train_lines, validation_lines
    )

    # 1. New tokenizer: old pieces first, new pieces appended.
    new_proto, new_pieces = expand_sentencepiece(
        old_tokenizer.proto,
        {lang: texts[lang][0] for lang in languages},
        pieces_per_language,
    )
    tokenizer_path = os.path.join(output, "tokenizer.model")
    with open(tokenizer_path, "wb") as f:
        f.write(new_proto)
    new_tokenizer = MultiHashFormerTokenizer(tokenizer_path)
    old_sp = spm.SentencePieceProcessor(model_proto=old_tokenizer.proto)
    new_sp = spm.SentencePieceProcessor(model_proto=new_proto)
    english_lines = texts["en"][0][:2000] + texts["en"][1]
    changed = sum(old_sp.encode(t) != new_sp.encode(t) for t in english_lines)
    if changed:
        raise RuntimeError(
            f"The expanded tokenizer changed {changed} English lines."
        )

    def evaluate(model, tokenizer):
        return {
            lang: document_likelihood(
                model, tokenizer, texts[lang][1], sequence_length, batch_size
            )
            for lang in list(languages) + ["en"]
        }

    report = {
        "new_pieces": len(new_pieces),
        "old_vocabulary": old_sp.get_piece_size(),
        "new_vocabulary": new_sp.get_piece_size(),
        "english_lines_checked": len(english_lines),
        "english_lines_changed": changed,
        "models": {},
    }
    # 2. Continual pre-training data: the same packed mix for both models.
    train_blocks = np.concatenate(
        [
            pack_documents(
                texts[lang][0],
                new_sp.encode,
                new_tokenizer.start_token_id,
                sequence_length,
            )
            for lang in list(languages) + ["en"]
        ]
    )
    order = data_order(len(train_blocks), steps * batch_size, seed)

    for name, model in models.items():
        before = evaluate(model, old_tokenizer)
        trainable_before = count_trainable_parameters(model)
        if name == "mhf":
            expanded = model.expand_vocabulary(tokenizer=new_tokenizer)
        else:
            expanded = expand_standard_vocabulary(model, new_tokenizer)
        trainable_after = count_trainable_parameters(expanded)
        frozen = freeze_for_continual_pretraining(expanded)
        keras.utils.set_random_seed(seed)
        expanded.compile(
            optimizer=make_optimizer(learning_rate, steps, warmup_steps),
            loss="auto" if name == "mhf" else expanded.loss,
        )
        if verbose:
            print(
                f"Continual pre-training of {name} ({steps} steps, blocks "
                f"{frozen} frozen)"
            )
        fit_blocks(expanded, train_blocks[order], batch_size, verbose)
        after = evaluate(expanded, new_tokenizer)
        expanded.save_to_preset(os.path.join(output, f"{name}_expanded"))
        report["models"][name] = {
            "parameters_before": trainable_before,
            "parameters_added": trainable_after - trainable_before,
            "frozen_blocks": frozen,
            "before": before,
            "after": after,
        }
    with open(os.path.join(output, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(output, "report.md"), "w") as f:
        f.write(markdown_report(report, list(languages) + ["en"]))
    return report


def markdown_report(report, languages):
    lines = [
        f"Vocabulary {report['old_vocabulary']} -> {report['new_vocabulary']} "
        f"({report['new_pieces']} new pieces); English lines whose "
        "tokenization changed: "
        f"{report['english_lines_changed']} of "
        f"{report['english_lines_checked']}.",
        "",
        "| model | parameters added | language | tokens/char before | after | "
        "perplexity before | after | nats/char before | after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["models"].items():
        for lang in languages:
            b, a = r["before"][lang], r["after"][lang]
            lines.append(
                f"| {name} | {r['parameters_added']:,} | {lang} | "
                f"{b['tokens_per_character']:.3f} | "
                f"{a['tokens_per_character']:.3f} | "
                f"{b['perplexity']:.1f} | {a['perplexity']:.1f} | "
                f"{b['nats_per_character']:.3f} | "
                f"{a['nats_per_character']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    report = expand_vocabulary_experiment(
        args.mhf,
        args.standard,
        args.data,
        args.output,
        args.languages,
        args.english,
        args.pieces_per_language,
        args.steps,
        args.batch_size,
        args.sequence_length,
        args.learning_rate,
        args.warmup_steps,
        args.max_train_lines,
        args.validation_lines,
        args.seed,
    )
    print(markdown_report(report, list(args.languages) + ["en"]))
    return report


if __name__ == "__main__":
    main()
