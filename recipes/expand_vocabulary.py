"""Expand the vocabulary of trained MHF and Standard models with Arabic,
Chinese and Hindi tokens, continue pre-training them, and compare
(paper Sec. 4.4 / 5.3, Fig. 2).

    python recipes/expand_vocabulary.py \
        --mhf runs/rep/seed0/mhf_h3b10729/preset runs/rep/seed0/mhf_h4b16384/preset \
        --standard runs/rep/seed0/standard/preset \
        --data ../shared/data/multilingual_ar_zh_hi \
        --english ../shared/data/openstax_edu_en \
        --pieces-per-language 5000 --steps 600 --seeds 3 \
        --output recipes/results/expansion --work-dir runs/expansion

New pieces are learned per language with SentencePiece on DATA/<lang>/ (all
files but the FLORES devtest one, held out) and appended after the old ids;
the old tokenizer's output on English is checked to be unchanged. Each MHF
model gets the new tokens with `expand_vocabulary` (zero new parameters);
each Standard model grows its embedding with mean-initialised rows. Every
model then continues pre-training, once per seed (the seed draws the data
order), on the same mix of the new languages and English (`--english-share`
of the blocks), training the embeddings/hash interface, the first two and
last two blocks and the final norm, the other blocks frozen.

Held out per language: the first `--validation-lines` lines of the FLORES
devtest (English: of `--english`'s validation or FLORES file) are scored, the
next `--calibration-lines` of every language, interleaved, fit an MHF
model's scoring temperature (its calibrated rule; the paper's rule is
reported beside it). Scores are bits per character, so tokenizers compare.
Every `--eval-every` steps (and at step 0, right after the expansion) the
held-out text is scored again: the curves (of the first `--curve-seeds`
seeds; the others are scored at the end only). Each model and seed writes its
result to WORK_DIR/<model>/seed<k>/result.json when it ends; a rerun skips
what is done. The report (OUTPUT/report.md, report.json, curves.png) gives,
per language, bits per character before and after (mean +- std over seeds),
tokens per character with the old and the new tokenizer, parameters added
and wall time.
"""

import argparse
import glob
import math
import os
import time

DATA = os.path.join(
    os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ),
    "shared",
    "data",
)
HELD_OUT_MARKERS = ("flores", "validation")
CALIBRATION_TOKENS = 4096


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--mhf", nargs="*", default=[], help="presets of trained MHF models"
    )
    p.add_argument(
        "--standard",
        nargs="*",
        default=[],
        help="presets of Standard models with the same tokenizer",
    )
    p.add_argument(
        "--data",
        default=os.path.join(DATA, "multilingual_ar_zh_hi"),
        help="folder with one sub-folder of corpus files (.txt, .jsonl, "
        ".parquet, ...) per language",
    )
    p.add_argument("--languages", nargs="+", default=["ar", "zh", "hi"])
    p.add_argument(
        "--english",
        default=None,
        help="folder of English corpus files (.txt, .jsonl, .parquet, ...) "
        "mixed into continual pre-training and evaluated; a file named "
        "*validation* or *flores* is held out (default: DATA/en)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        help="the JSON field (.jsonl) or Parquet/Arrow column of the text",
    )
    p.add_argument(
        "--english-share",
        type=float,
        default=0.25,
        help="at most this share of the training blocks is English",
    )
    p.add_argument("--pieces-per-language", type=int, default=5000)
    p.add_argument(
        "--steps", type=int, default=600, help="continual pre-training steps"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="steps between points of the held-out curves",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="continual pre-training seeds 0..N-1; N > 1 reports mean +- std",
    )
    p.add_argument(
        "--curve-seeds",
        type=int,
        default=None,
        help="seeds whose curves are scored (the first N; default: all); "
        "the others are scored only at the end",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument(
        "--max-train-lines",
        type=int,
        default=20000,
        help="training lines (documents) read per language",
    )
    p.add_argument(
        "--validation-lines",
        type=int,
        default=100,
        help="held-out lines scored per language",
    )
    p.add_argument(
        "--calibration-lines",
        type=int,
        default=100,
        help="held-out lines per language for the MHF scoring temperature",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=256,
        help="held-out lines are scored on their own, cut to this many tokens",
    )
    p.add_argument(
        "--run-models",
        nargs="*",
        default=None,
        help="models this process runs (default: all); the others' finished "
        "runs are read from WORK_DIR, so several processes can share the "
        "work",
    )
    p.add_argument(
        "--run-seeds",
        nargs="*",
        type=int,
        default=None,
        help="seeds this process runs (default: 0..--seeds-1)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report the finished runs in WORK_DIR",
    )
    p.add_argument("--output", required=True)
    p.add_argument(
        "--work-dir",
        default=None,
        help="the expanded tokenizer, per-run results and expanded presets "
        "(default: OUTPUT/runs); OUTPUT keeps the report and the plot",
    )
    return p.parse_args(argv)


def model_name(preset):
    """`runs/rep/seed0/mhf_h4b16384/preset` -> `mhf_h4b16384`."""
    path = os.path.normpath(preset)
    if os.path.basename(path) == "preset":
        path = os.path.dirname(path)
    return os.path.basename(path)


def read_language(folder, max_train_lines, held_out_lines, text_field="text"):
    """(train documents, held-out documents) of the corpus files in
    `folder` (`.txt`, `.jsonl`, `.parquet`, ...: `keras_mhf.data`'s
    `CORPUS_EXTENSIONS`; `text_field` names the JSON field or column):
    files whose name has `flores` or `validation` in it are held out (or
    the last file); with a single file, its first `held_out_lines` are."""
    from keras_mhf.data import CORPUS_EXTENSIONS
    from keras_mhf.data import is_corpus_file
    from keras_mhf.data import read_documents

    files = sorted(
        f for f in glob.glob(os.path.join(folder, "*")) if is_corpus_file(f)
    )
    if not files:
        raise ValueError(
            f"No corpus files ({', '.join(CORPUS_EXTENSIONS)}) in {folder}."
        )
    held = [
        f
        for f in files
        if any(m in os.path.basename(f) for m in HELD_OUT_MARKERS)
    ] or files[-1:]
    train = []
    for f in files:
        if f not in held and len(train) < max_train_lines:
            train.extend(
                read_documents(
                    f, limit=max_train_lines - len(train), text_field=text_field
                )
            )
    held_out = [
        line for f in held for line in read_documents(f, text_field=text_field)
    ]
    if not train:  # a single file: split it
        train, held_out = held_out[held_out_lines:], held_out
    return train[:max_train_lines], held_out[:held_out_lines]


def interleave(groups):
    """Round-robin over lists: [a0, b0, c0, a1, b1, ...]."""
    out = []
    for i in range(max(len(g) for g in groups)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def mean_std(values):
    import numpy as np

    values = np.asarray(values, "float64")
    std = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    return float(values.mean()), std


class Experiment:
    """The data, tokenizers and held-out sets shared by every run."""

    def __init__(self, args, verbose=1):
        import keras_hub
        import numpy as np
        import sentencepiece as spm

        import keras_mhf  # noqa: F401 (registers the MHF classes)
        from keras_mhf.data import pack_documents
        from keras_mhf.evaluation import encode_documents
        from keras_mhf.expansion.tokenizer_expansion import expand_sentencepiece
        from keras_mhf.expansion.tokenizer_expansion import in_script
        from keras_mhf.models import MultiHashFormerTokenizer
        from keras_mhf.utils.files import write_atomically

        self.args, self.verbose = args, verbose
        self.specs = [(model_name(p), "mhf", p) for p in args.mhf] + [
            (model_name(p), "standard", p) for p in args.standard
        ]
        names = [name for name, _, _ in self.specs]
        if not names:
            raise ValueError("Pass at least one preset (--mhf, --standard).")
        if len(set(names)) != len(names):
            raise ValueError(
                f"Two presets have the same name: {names}; each preset's "
                "folder (or the folder above `preset`) names its model."
            )
        self.languages = list(args.languages)
        self.evaluated = self.languages + ["en"]
        held = args.validation_lines + args.calibration_lines
        texts = {
            lang: read_language(
                os.path.join(args.data, lang),
                args.max_train_lines,
                held,
                args.text_field,
            )
            for lang in self.languages
        }
        texts["en"] = read_language(
            args.english or os.path.join(args.data, "en"),
            args.max_train_lines,
            held,
            args.text_field,
        )
        self.validation = {
            lang: held_out[: args.validation_lines]
            for lang, (_, held_out) in texts.items()
        }
        calibration = interleave(
            [
                held_out[args.validation_lines :]
                for _, held_out in texts.values()
            ]
        )
        if not calibration:
            raise ValueError(
                "No held-out lines are left for calibration: lower "
                "--validation-lines or pass more held-out text."
            )
        self.calibration = calibration

        first = keras_hub.models.CausalLM.from_preset(self.specs[0][2])
        self.old_tokenizer = first.preprocessor.tokenizer
        for name, _, preset in self.specs[1:]:
            other = keras_hub.models.CausalLM.from_preset(preset)
            if (
                other.preprocessor.tokenizer.get_vocabulary()
                != self.old_tokenizer.get_vocabulary()
            ):
                raise ValueError(
                    f"{name} ({preset}) has another tokenizer than "
                    f"{self.specs[0][0]}: every model must share one."
                )
        del first

        # 1. The expanded tokenizer: old pieces first, new pieces appended
        # (made once per work directory, so every run shares it).
        self.work_dir = args.work_dir or os.path.join(args.output, "runs")
        os.makedirs(self.work_dir, exist_ok=True)
        tokenizer_path = os.path.join(self.work_dir, "tokenizer.model")
        new_proto, new_pieces = expand_sentencepiece(
            self.old_tokenizer.proto,
            {lang: texts[lang][0] for lang in self.languages},
            args.pieces_per_language,
        )
        if os.path.exists(tokenizer_path):
            with open(tokenizer_path, "rb") as f:
                if f.read() != new_proto:
                    raise ValueError(
                        f"{tokenizer_path} is not the tokenizer these "
                        "settings make: its runs used other data or "
                        "--pieces-per-language. Use another --work-dir."
                    )
        else:
            write_atomically(tokenizer_path, new_proto)
        self.new_tokenizer = MultiHashFormerTokenizer(tokenizer_path)
        old_sp = spm.SentencePieceProcessor(
            model_proto=self.old_tokenizer.proto
        )
        new_sp = spm.SentencePieceProcessor(model_proto=new_proto)
        english = texts["en"][0][:2000] + texts["en"][1]
        changed = sum(old_sp.encode(t) != new_sp.encode(t) for t in english)
        if changed:
            raise RuntimeError(
                f"The expanded tokenizer changed {changed} English lines."
            )
        self.tokenizer_report = {
            "new_pieces": len(new_pieces),
            "new_pieces_per_language": {
                lang: sum(in_script(p, lang) for p in new_pieces)
                for lang in self.languages
            },
            "old_vocabulary": old_sp.get_piece_size(),
            "new_vocabulary": new_sp.get_piece_size(),
            "english_lines_checked": len(english),
            "english_lines_changed": changed,
        }

        # 2. Continual pre-training blocks: the same mix for every run.
        start = self.new_tokenizer.start_token_id
        packed = {
            lang: pack_documents(
                texts[lang][0], new_sp.encode, start, args.sequence_length
            )
            for lang in self.evaluated
        }
        others = sum(len(packed[lang]) for lang in self.languages)
        english_cap = int(
            others * args.english_share / max(1e-9, 1 - args.english_share)
        )
        if len(packed["en"]) > english_cap:
            keep = np.random.default_rng(0).permutation(len(packed["en"]))
            packed["en"] = packed["en"][np.sort(keep[:english_cap])]
        self.train_blocks = np.concatenate([packed[k] for k in self.evaluated])
        self.block_counts = {k: int(len(v)) for k, v in packed.items()}

        # 3. Held-out lines, encoded once per tokenizer.
        self.encoded = {
            which: {
                lang: encode_documents(
                    tokenizer, self.validation[lang], args.max_length
                )
                for lang in self.evaluated
            }
            for which, tokenizer in (
                ("old", self.old_tokenizer),
                ("new", self.new_tokenizer),
            )
        }
        self.tokens_per_character = {
            lang: {
                which: sum(len(s) - 1 for s in self.encoded[which][lang][0])
                / self.encoded[which][lang][1]
                for which in ("old", "new")
            }
            for lang in self.evaluated
        }

    def log(self, message):
        if self.verbose:
            print(message, flush=True)

    def score(self, lm, kind, which, paper_rule_too=False):
        """Bits per character per language under the model's rule (MHF: a
        temperature fit on the calibration lines first); with
        `paper_rule_too`, MHF's paper-rule numbers beside them."""
        from keras_mhf.evaluation import calibrate
        from keras_mhf.evaluation import encoded_document_likelihood
        from keras_mhf.evaluation import paper_rule

        result = {}
        if kind == "mhf":
            lm.scoring_temperature = 1.0
            report = calibrate(
                lm,
                self.calibration,
                batch_size=self.args.batch_size,
                sequence_length=self.args.sequence_length,
                max_tokens=CALIBRATION_TOKENS,
            )
            result["temperature"] = report["temperature"]
        # The calibrated rule for every language, then the paper rule.
        for lang in self.evaluated:
            metrics = encoded_document_likelihood(
                lm, self.encoded[which][lang], 16
            )
            result[lang] = {"bits_per_character": metrics["bits_per_character"]}
        if kind == "mhf" and paper_rule_too:
            with paper_rule(lm):
                for lang in self.evaluated:
                    metrics = encoded_document_likelihood(
                        lm, self.encoded[which][lang], 16
                    )
                    result[lang]["paper_rule_bits_per_character"] = metrics[
                        "bits_per_character"
                    ]
        return result

    def before(self, name, kind, preset):
        """The base model on the held-out text with the old tokenizer
        (cached in WORK_DIR/<name>/before.json). An MHF model is scored
        with a temperature fit on the calibration lines, as after the
        expansion, and also with the temperature its preset ships (fit on
        its pre-training text): `shipped_temperature`, and per language
        `shipped_bits_per_character`."""
        import keras_hub

        from keras_mhf.evaluation import encoded_document_likelihood
        from keras_mhf.utils.files import read_json
        from keras_mhf.utils.files import write_json

        path = os.path.join(self.work_dir, name, "before.json")
        result = read_json(path) if os.path.exists(path) else None
        if result is not None and (
            kind != "mhf" or "shipped_temperature" in result
        ):
            return result
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lm = keras_hub.models.CausalLM.from_preset(preset)
        self.log(f"Scoring {name} before the expansion")
        if kind == "mhf":
            shipped = {"shipped_temperature": lm.scoring_temperature}
            for lang in self.evaluated:
                metrics = encoded_document_likelihood(
                    lm, self.encoded["old"][lang], 16
                )
                shipped[lang] = metrics["bits_per_character"]
        if result is None:
            result = self.score(lm, kind, "old", paper_rule_too=True)
        if kind == "mhf":
            result["shipped_temperature"] = shipped["shipped_temperature"]
            for lang in self.evaluated:
                result[lang]["shipped_bits_per_character"] = shipped[lang]
        write_json(path, result, indent=2)
        return result

    def run(self, name, kind, preset, seed):
        """Expansion and continual pre-training of one model with one seed
        (the result is cached in WORK_DIR/<name>/seed<k>/result.json)."""
        from keras_mhf.utils.files import read_json
        from keras_mhf.utils.output_lock import output_lock

        args = self.args
        folder = os.path.join(self.work_dir, name, f"seed{seed}")
        path = os.path.join(folder, "result.json")
        if os.path.exists(path):
            return read_json(path)
        runs_here = (args.run_models is None or name in args.run_models) and (
            args.run_seeds is None or seed in args.run_seeds
        )
        if args.report_only or not runs_here:
            return None  # another process's, or not run yet
        with output_lock(folder, f"the {name} seed {seed} run"):
            return self._run(name, kind, preset, seed, folder, path)

    def _run(self, name, kind, preset, seed, folder, path):
        import keras
        import keras_hub

        from keras_mhf.expansion.tokenizer_expansion import (
            expand_standard_vocabulary,
        )
        from keras_mhf.expansion.tokenizer_expansion import (
            freeze_for_continual_pretraining,
        )
        from keras_mhf.pretraining import data_order
        from keras_mhf.pretraining import fit_blocks
        from keras_mhf.pretraining import make_optimizer
        from keras_mhf.pretraining import save_preset
        from keras_mhf.utils.files import write_json
        from keras_mhf.utils.keras_utils import count_trainable_parameters

        args = self.args
        started = time.time()
        keras.config.set_dtype_policy("float32")
        keras.utils.set_random_seed(seed)
        model = keras_hub.models.CausalLM.from_preset(preset)
        # Parameters: trainable weights. The signature table and the bucket
        # index derived from it are integers, counted apart (MHF: 2 H per
        # new token).
        parameters_before = count_trainable_parameters(model)
        stored_before = model.count_params()
        if kind == "mhf":
            lm = model.expand_vocabulary(tokenizer=self.new_tokenizer)
        else:
            lm = expand_standard_vocabulary(model, self.new_tokenizer)
        added = count_trainable_parameters(lm) - parameters_before
        stored_added = lm.count_params() - stored_before - added
        frozen = freeze_for_continual_pretraining(lm)
        lm.compile(
            optimizer=make_optimizer(
                args.learning_rate, args.steps, args.warmup_steps
            ),
            loss="auto" if kind == "mhf" else lm.loss,
        )
        order = data_order(
            len(self.train_blocks), args.steps * args.batch_size, seed
        )
        with_curve = args.curve_seeds is None or seed < args.curve_seeds
        curve = []
        if with_curve:
            curve.append({"step": 0, **self.score(lm, kind, "new")})
        self.log(
            f"{name} seed {seed}: {args.steps} steps of continual "
            f"pre-training, blocks {frozen} frozen"
            + (f"; step 0: {self._bits(curve[-1])}" if curve else "")
        )
        training_seconds = 0.0
        every = args.eval_every if with_curve else args.steps
        for step in range(0, args.steps, every):
            end = min(step + every, args.steps)
            tick = time.time()
            history = fit_blocks(
                lm,
                self.train_blocks[
                    order[step * args.batch_size : end * args.batch_size]
                ],
                args.batch_size,
                verbose=0,
            )
            training_seconds += time.time() - tick
            loss = float(history.history["loss"][-1])
            if not math.isfinite(loss):
                raise RuntimeError(
                    f"{name} seed {seed}: the training loss is {loss} at "
                    f"step {end}; nothing was written for this run."
                )
            last = end == args.steps
            curve.append(
                {
                    "step": end,
                    "train_loss": loss,
                    **self.score(lm, kind, "new", paper_rule_too=last),
                }
            )
            self.log(f"  step {end}: loss {loss:.3f}; " + self._bits(curve[-1]))
        after = curve[-1]
        if not all(
            math.isfinite(after[lang]["bits_per_character"])
            for lang in self.evaluated
        ):
            raise RuntimeError(
                f"{name} seed {seed}: non-finite held-out scores; nothing "
                "was written for this run."
            )
        save_preset(lm, os.path.join(folder, "preset"))
        result = {
            "model": name,
            "kind": kind,
            "seed": seed,
            "parameters_before": int(parameters_before),
            "parameters_added": int(added),
            "integers_added": int(stored_added),
            "frozen_blocks": frozen,
            "after": after,
            "curve": curve,
            "training_seconds": round(training_seconds, 1),
            "seconds": round(time.time() - started, 1),
        }
        write_json(path, result, indent=2)
        return result

    def _bits(self, point):
        return (
            ", ".join(
                f"{lang} {point[lang]['bits_per_character']:.3f}"
                for lang in self.evaluated
            )
            + " bits/char"
        )


def expand_vocabulary_experiment(args, verbose=1):
    """Runs every model and seed (skipping finished runs), then writes and
    returns the report."""
    from keras_mhf.utils.files import write_atomically
    from keras_mhf.utils.files import write_json
    from keras_mhf.utils.output_lock import output_lock

    os.makedirs(args.output, exist_ok=True)
    with output_lock(args.output, "a vocabulary-expansion experiment"):
        experiment = Experiment(args, verbose)
        models = {}
        for name, kind, preset in experiment.specs:
            models[name] = {
                "kind": kind,
                "preset": os.path.abspath(preset),
                "before": experiment.before(name, kind, preset),
                "runs": [],
            }
        report = None
        for seed in range(args.seeds):
            for name, kind, preset in experiment.specs:
                result = experiment.run(name, kind, preset, seed)
                if result is None:
                    continue
                models[name]["runs"].append(result)
                report = make_report(experiment, models)
                write_json(
                    os.path.join(args.output, "report.json"), report, indent=2
                )
                write_atomically(
                    os.path.join(args.output, "report.md"),
                    markdown_report(report).encode("utf-8"),
                )
                plot_curves(report, os.path.join(args.output, "curves.png"))
    if report is None:
        raise RuntimeError(f"No finished run in {experiment.work_dir}.")
    return report


def make_report(experiment, models):
    args = experiment.args
    languages = experiment.evaluated
    summary = {}
    for name, m in models.items():
        runs = m["runs"]
        if not runs:  # not run yet
            continue
        entry = {
            "kind": m["kind"],
            "seeds": [r["seed"] for r in runs],
            "parameters_before": runs[0]["parameters_before"],
            "parameters_added": runs[0]["parameters_added"],
            "integers_added": runs[0]["integers_added"],
            "training_seconds": mean_std([r["training_seconds"] for r in runs]),
            "seconds": mean_std([r["seconds"] for r in runs]),
            "languages": {},
        }
        if "shipped_temperature" in m["before"]:
            entry["shipped_temperature"] = m["before"]["shipped_temperature"]
        for lang in languages:
            before = m["before"][lang]
            after = [r["after"][lang] for r in runs]
            row = {
                "before": before["bits_per_character"],
                "after": mean_std([a["bits_per_character"] for a in after]),
            }
            if m["kind"] == "mhf":
                row["before_paper_rule"] = before[
                    "paper_rule_bits_per_character"
                ]
                if "shipped_bits_per_character" in before:
                    row["before_shipped_temperature"] = before[
                        "shipped_bits_per_character"
                    ]
                row["after_paper_rule"] = mean_std(
                    [a["paper_rule_bits_per_character"] for a in after]
                )
            entry["languages"][lang] = row
        summary[name] = entry
    return {
        "config": {
            k: v
            for k, v in vars(args).items()
            if k not in ("output", "work_dir")
        },
        "tokenizer": experiment.tokenizer_report,
        "training_blocks": experiment.block_counts,
        "tokens_per_character": experiment.tokens_per_character,
        "validation_lines": {
            lang: len(experiment.validation[lang]) for lang in languages
        },
        "languages": languages,
        "summary": summary,
        "models": models,
    }


def _pm(value, digits=3):
    mean, std = value
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown_report(report):
    t = report["tokenizer"]
    c = report["config"]
    languages = report["languages"]
    lines = [
        f"Vocabulary {t['old_vocabulary']:,} -> {t['new_vocabulary']:,} "
        f"({t['new_pieces']:,} new pieces); English lines whose "
        "tokenization changed: "
        f"{t['english_lines_changed']} of {t['english_lines_checked']}.",
        f"Continual pre-training: {c['steps']} steps of {c['batch_size']} x "
        f"{c['sequence_length']} tokens, learning rate {c['learning_rate']}; "
        f"training blocks per language: "
        + ", ".join(f"{k} {v:,}" for k, v in report["training_blocks"].items())
        + ".",
        "Held-out lines per language: "
        + ", ".join(f"{k} {v}" for k, v in report["validation_lines"].items())
        + ". Bits per character, lower is better; after: mean ± std over "
        "seeds; MHF: calibrated (the paper's rule in brackets).",
        "",
        "| language | tokens/char old tokenizer | new tokenizer |",
        "|---|---|---|",
    ]
    for lang in languages:
        tpc = report["tokens_per_character"][lang]
        lines.append(f"| {lang} | {tpc['old']:.3f} | {tpc['new']:.3f} |")
    lines += [
        "",
        "| model | parameters before | added | seeds | language | "
        "bits/char before | after | change | continual pre-training s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["summary"].items():
        for lang in languages:
            row = s["languages"][lang]
            before, after = row["before"], row["after"]
            text_before = f"{before:.3f}"
            text_after = _pm(after)
            if "before_paper_rule" in row:
                text_before += f" ({row['before_paper_rule']:.2f})"
                text_after += f" ({row['after_paper_rule'][0]:.2f})"
            lines.append(
                f"| {name} | {s['parameters_before']:,} | "
                f"{s['parameters_added']:,} | {len(s['seeds'])} | {lang} | "
                f"{text_before} | {text_after} | "
                f"{after[0] - before:+.3f} | "
                f"{s['training_seconds'][0]:.0f} |"
            )
    shipped = {
        name: s
        for name, s in report["summary"].items()
        if "shipped_temperature" in s
    }
    if shipped:
        lines += [
            "",
            "MHF before the expansion with the scoring temperature its preset "
            "ships (fit on its English pre-training text), bits/char:",
            "",
            "| model | temperature | " + " | ".join(languages) + " |",
            "|---|---|" + "---|" * len(languages),
        ]
        for name, s in shipped.items():
            lines.append(
                f"| {name} | {s['shipped_temperature']:.2f} | "
                + " | ".join(
                    f"{s['languages'][lang]['before_shipped_temperature']:.3f}"
                    for lang in languages
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def plot_curves(report, path):
    """Held-out bits per character against continual pre-training steps,
    one panel per language, mean over the seeds with curves (a band of ±
    one std when there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    languages = report["languages"]
    fig, axes = plt.subplots(
        1, len(languages), figsize=(4 * len(languages), 3.4)
    )
    for ax, lang in zip(np.atleast_1d(axes), languages):
        for name, m in report["models"].items():
            if not m["runs"] or not any(r["curve"] for r in m["runs"]):
                continue
            longest = max(len(r["curve"]) for r in m["runs"])
            runs = [r for r in m["runs"] if len(r["curve"]) == longest]
            steps = [p["step"] for p in runs[0]["curve"]]
            values = np.array(
                [
                    [p[lang]["bits_per_character"] for p in r["curve"]]
                    for r in runs
                ]
            )
            mean = values.mean(0)
            (line,) = ax.plot(steps, mean, marker=".", label=name)
            if len(values) > 1:
                std = values.std(0, ddof=1)
                ax.fill_between(
                    steps,
                    mean - std,
                    mean + std,
                    alpha=0.2,
                    color=line.get_color(),
                )
            ax.axhline(
                m["before"][lang]["bits_per_character"],
                color=line.get_color(),
                linestyle=":",
                linewidth=1,
            )
        ax.set_title(f"{lang} (dotted: before expansion)")
        ax.set_xlabel("continual pre-training step")
        ax.set_ylabel("held-out bits / character")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    report = expand_vocabulary_experiment(args)
    print(markdown_report(report))
    return report


if __name__ == "__main__":
    main()
