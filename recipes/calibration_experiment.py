"""Beyond one scalar temperature: two ways to close MultiHashFormer's
remaining calibration gap, measured against the scalar on the replicate
harness's trained models.

    python recipes/replicate.py --output recipes/results --work-dir RUNS
    python recipes/calibration_experiment.py --work-dir RUNS \\
        --output recipes/results/calibration_experiment

For every trained MultiHashFormer of the replicate run (`RUNS/seed*/mhf_*`,
`single_id_*`), with the replicate's own validation windows (the first half
fits, the second half reports, as in `keras-mhf pretrain`):

- `scalar`: the shipped rule, `log_softmax_V(s(w) / tau)` with one `tau`
  fitted exactly on the fit half (`keras_mhf.evaluation.calibration.fit_temperature`).
- `context`: a context-dependent temperature, `log_softmax_V(s(w) *
  beta(x))` with `beta(x) = softplus(w . phi(x) + c)` a tiny head on the
  final hidden state `phi(x)` (standardised), initialised at the scalar
  (`w = 0`) and fitted with the vocabulary-normalised NLL on the fit half
  (Adam, early stopping on the fit half's last quarter).
- `context+scores`: the same head with two more features of the raw
  scores: the top score and its margin over the second.
- `finetune`: the hash decoder's mixers (paper Sec. 3.3) trained for a few
  hundred steps with the vocabulary-normalised loss
  `-log_softmax_V(s(w) * beta)[target]` (`beta` trained with them) on
  training windows, trunk and bucket tables frozen (the tables are tied to
  the encoder); then a scalar is re-fitted on the fit half as above.

Each method is scored on the reported half: perplexity, loss, accuracy, ECE.
The scalar and the context heads never change the argmax (a positive scale
per position), so their accuracy is the paper rule's; the fine-tune changes
the decoder and so may change it. Writes `results.json` and `results.md`.
"""

import argparse
import glob
import json
import os
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--work-dir",
        required=True,
        help="replicate.py's --work-dir: data/ and seed*/<model>/preset",
    )
    p.add_argument("--output", required=True)
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--validation-blocks", type=int, default=64)
    p.add_argument(
        "--train-windows",
        type=int,
        default=256,
        help="training windows for the decoder fine-tune",
    )
    p.add_argument("--finetune-epochs", type=int, default=2)
    p.add_argument("--finetune-learning-rate", type=float, default=1e-3)
    p.add_argument("--models", nargs="*", default=None)
    return p.parse_args(argv)


def _metrics(logits, targets):
    """Metrics of per-position logits `[n, V]` already scaled."""
    from keras_mhf.evaluation.calibration import metrics_at

    return metrics_at(logits, targets, 1.0)


def hidden_states(lm, blocks, batch_size=8):
    """Final hidden states `[n*L, d]` of the positions predicting a token."""
    out = []
    for start in range(0, len(blocks), batch_size):
        batch = np.asarray(blocks[start : start + batch_size], "int32")
        hidden = lm.backbone.predict_on_batch(
            {"token_ids": batch, "padding_mask": np.ones_like(batch)}
        )
        hidden = np.asarray(hidden, "float32")[:, :-1]
        out.append(hidden.reshape(-1, hidden.shape[-1]))
    return np.concatenate(out)


def _score_features(scores):
    top2 = np.partition(scores, -2, axis=-1)[:, -2:]
    top, second = top2.max(-1), top2.min(-1)
    return np.stack([top, top - second], axis=-1)


def _standardise(train, *others):
    mean, std = train.mean(0), train.std(0) + 1e-6
    return [(x - mean) / std for x in (train,) + others]


def fit_context_temperature(features, scores, targets, tau, epochs=30):
    """`beta(phi) = softplus(w . phi + c)` fitted with the vocabulary-
    normalised NLL; returns a function `phi -> beta`."""
    import keras

    class Scale(keras.layers.Layer):
        def call(self, inputs):
            beta, s = inputs
            return s * beta

    start = float(np.log(np.expm1(1.0 / tau)))  # softplus^-1(1 / tau)
    phi = keras.Input((features.shape[-1],))
    s = keras.Input((scores.shape[-1],))
    head = keras.layers.Dense(
        1,
        activation="softplus",
        kernel_initializer="zeros",
        bias_initializer=keras.initializers.Constant(start),
    )
    beta = head(phi)
    model = keras.Model([phi, s], Scale()([beta, s]))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    split = (3 * len(targets)) // 4
    model.fit(
        [features[:split], scores[:split]],
        targets[:split],
        validation_data=(
            [features[split:], scores[split:]],
            targets[split:],
        ),
        batch_size=256,
        epochs=epochs,
        verbose=0,
        callbacks=[
            keras.callbacks.EarlyStopping(patience=3, restore_best_weights=True)
        ],
    )
    predictor = keras.Model(phi, beta)
    return lambda x: np.asarray(
        predictor.predict(x, batch_size=1024, verbose=0), "float32"
    )


def finetune_decoder(lm, train_blocks, tau, epochs, learning_rate):
    """Trains the decoder's mixers (and a scalar `beta`) with the
    vocabulary-normalised loss on frozen final hidden states; returns the
    steps run and the final training loss."""
    import keras
    from keras import ops

    from keras_mhf.models.multi_hash_former import (
        multi_hash_former_inference as inference,
    )

    backbone = lm.backbone
    hidden = hidden_states(lm, train_blocks)
    targets = np.asarray(train_blocks[:, 1:], "int32").reshape(-1)
    backbone.hash_encoder.trainable = False  # tied tables stay as trained

    class VocabularyScores(keras.layers.Layer):
        def __init__(self, lookup, **kwargs):
            super().__init__(**kwargs)
            self.lookup = lookup
            self.log_beta = self.add_weight(
                shape=(),
                initializer=keras.initializers.Constant(np.log(1.0 / tau)),
                name="log_beta",
            )

        def call(self, bucket_logits):
            s = inference.token_scores(
                inference.head_log_probs(bucket_logits), self.lookup.signatures
            )
            return s * ops.exp(self.log_beta)

    h = keras.Input((hidden.shape[-1],))
    logits = VocabularyScores(backbone.signature_lookup)(
        backbone.hash_decoder(h)
    )
    model = keras.Model(h, logits)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(
        hidden, targets, batch_size=256, epochs=epochs, shuffle=True, verbose=0
    )
    backbone.hash_encoder.trainable = True
    steps = epochs * -(-len(targets) // 256)
    return steps, float(history.history["loss"][-1])


def run_model(preset, corpus, args):
    """All methods on one trained model; returns its results dict."""
    from keras_mhf.data import WindowSampler
    from keras_mhf.data import validation_windows
    from keras_mhf.evaluation import calibration
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.pretraining.validation import split_validation_windows

    lm = MultiHashFormerCausalLM.from_preset(preset)
    lm.scoring_temperature = 1.0
    blocks = validation_windows(
        corpus, args.sequence_length, count=args.validation_blocks
    )
    (a, b), (c, d) = split_validation_windows(len(blocks))
    fit_blocks, report_blocks = blocks[a:b], blocks[c:d]
    fit_s, fit_y = calibration.raw_scores(lm, fit_blocks)
    rep_s, rep_y = calibration.raw_scores(lm, report_blocks)
    results = {"preset": preset, "fit_tokens": int(len(fit_y))}
    timings = {}

    results["paper_rule"] = _metrics(rep_s, rep_y)
    started = time.time()
    tau = calibration.fit_temperature(fit_s, fit_y)
    timings["scalar"] = time.time() - started
    results["scalar"] = {"temperature": tau, **_metrics(rep_s / tau, rep_y)}

    fit_h = hidden_states(lm, fit_blocks)
    rep_h = hidden_states(lm, report_blocks)
    for name, extra in (("context", False), ("context+scores", True)):
        started = time.time()
        fit_phi, rep_phi = fit_h, rep_h
        if extra:
            fit_phi = np.concatenate([fit_h, _score_features(fit_s)], -1)
            rep_phi = np.concatenate([rep_h, _score_features(rep_s)], -1)
        fit_phi, rep_phi = _standardise(fit_phi, rep_phi)
        beta = fit_context_temperature(fit_phi, fit_s, fit_y, tau)
        rep_beta = beta(rep_phi)
        timings[name] = time.time() - started
        results[name] = {
            "beta_mean": float(rep_beta.mean()),
            "beta_std": float(rep_beta.std()),
            **_metrics(rep_s * rep_beta, rep_y),
        }

    started = time.time()
    sampler = WindowSampler(
        corpus, "train", args.sequence_length, args.train_windows, seed=4242
    )
    train_blocks = sampler.windows(0)
    steps, loss = finetune_decoder(
        lm,
        train_blocks,
        tau,
        args.finetune_epochs,
        args.finetune_learning_rate,
    )
    fit_s2, _ = calibration.raw_scores(lm, fit_blocks)
    rep_s2, _ = calibration.raw_scores(lm, report_blocks)
    tau2 = calibration.fit_temperature(fit_s2, fit_y)
    timings["finetune"] = time.time() - started
    results["finetune"] = {
        "temperature": tau2,
        "steps": steps,
        "train_tokens": int(train_blocks[:, 1:].size),
        "final_train_loss": loss,
        "paper_rule": _metrics(rep_s2, rep_y),
        **_metrics(rep_s2 / tau2, rep_y),
    }
    results["seconds"] = timings
    return results


METHODS = ("paper_rule", "scalar", "context", "context+scores", "finetune")


def markdown(all_results, args):
    lines = [
        "| model | method | val perplexity | loss (nats) | next-token acc | "
        "ECE | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, r in all_results.items():
        for method in METHODS:
            m = r[method]
            if method in ("scalar", "finetune"):
                note = f"tau {m['temperature']:.3g}"
                if method == "finetune":
                    note += (
                        f", {m['steps']} steps on {m['train_tokens']:,} tokens"
                    )
            elif method.startswith("context"):
                note = f"beta {m['beta_mean']:.3g} +- {m['beta_std']:.2g}"
            else:
                note = "tau 1"
            lines.append(
                f"| {model} | {method} | {m['perplexity']:.1f} | "
                f"{m['loss']:.3f} | {m['accuracy']:.3f} | {m['ece']:.3f} | "
                f"{note} |"
            )
    lines += [
        "",
        f"Reported on validation windows {args.validation_blocks // 2}.."
        f"{args.validation_blocks - 1} ({args.sequence_length} tokens each);"
        " every fit (temperature, context heads) used windows "
        f"0..{args.validation_blocks // 2 - 1} only; the fine-tune trained on"
        f" {args.train_windows} training windows.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    import keras

    from keras_mhf.data import PreparedCorpus

    corpus = PreparedCorpus(os.path.join(args.work_dir, "data"))
    presets = sorted(
        glob.glob(os.path.join(args.work_dir, "seed*", "mhf_*", "preset"))
        + glob.glob(
            os.path.join(args.work_dir, "seed*", "single_id_*", "preset")
        )
    )
    if args.models:
        presets = [
            p
            for p in presets
            if os.path.basename(os.path.dirname(p)) in args.models
        ]
    if not presets:
        raise SystemExit(
            f"No trained MultiHashFormer presets under {args.work_dir}: run "
            "recipes/replicate.py with this --work-dir first."
        )
    os.makedirs(args.output, exist_ok=True)
    all_results = {}
    for preset in presets:
        name = os.path.relpath(os.path.dirname(preset), args.work_dir)
        print(f"=== {name} ===", flush=True)
        keras.utils.set_random_seed(0)
        all_results[name] = run_model(preset, corpus, args)
        for method in METHODS:
            m = all_results[name][method]
            print(
                f"{method:<16} perplexity {m['perplexity']:10.1f}  "
                f"acc {m['accuracy']:.3f}  ECE {m['ece']:.3f}",
                flush=True,
            )
    with open(os.path.join(args.output, "results.json"), "w") as f:
        json.dump(all_results, f, indent=1)
    with open(os.path.join(args.output, "results.md"), "w") as f:
        f.write(markdown(all_results, args))
    print(markdown(all_results, args))


if __name__ == "__main__":
    main()
