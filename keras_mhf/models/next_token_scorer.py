"""Compiled next-token scoring for evaluation (used by `keras_mhf.evaluation`
and the lm-eval adapter).

`model.score()` runs eagerly and returns `[b, s, V]` scores that evaluation
then moves to the host; on JAX every new padded length also meant a new
trace. `NextTokenScorer` instead compiles, once per input shape, a function
that returns only what evaluation needs per position (the next token's
log-probability, whether it is the argmax, the top log-probability), and pads
batches to a fixed number of rows and lengths to a multiple of
`length_multiple`, so a whole evaluation compiles a handful of shapes. Padding
never changes a number: positions are causal, pad rows are separate.
"""

import weakref

import keras
import numpy as np
from keras import ops

from keras_mhf.utils.concurrent_inference import inference
from keras_mhf.utils.token_ids import check_token_ids


class CausalLMHead(keras.layers.Layer):
    """A layer that reads a causal LM's output head.

    It tracks only the layers whose weights the head reads (the backbone
    and, for MHF, the cascade decoder), so that a compiled function receives
    them as state, and holds the task itself through a weak reference: were
    the task a sublayer, its never-built preprocessor and tokenizer would
    make every Keras `predict_on_batch` call run the whole model eagerly,
    op by op, before the compiled function (Keras builds unbuilt models by
    calling them), and the scorer cache could never release the task."""

    def __init__(self, causal_lm, **kwargs):
        super().__init__(**kwargs)
        self._causal_lm = weakref.ref(causal_lm)
        self.head_layers = [causal_lm.backbone] + [
            layer
            for layer in (getattr(causal_lm, "hash_decoder", None),)
            if layer is not None
        ]

    @property
    def causal_lm(self):
        return self._causal_lm()


class _NextTokenHead(CausalLMHead):
    """Final hidden states and token ids (and, for MHF, the scoring
    temperature per row) -> per-position statistics of the next token:
    `(log_prob [b, s-1], is_argmax [b, s-1], max_log_prob [b, s-1])`, all
    float32, and the argmax's id `[b, s-1]` (int32)."""

    def call(self, hidden_states, token_ids, temperature=None):
        hidden_states = hidden_states[:, :-1]
        targets = ops.cast(token_ids[:, 1:], "int32")
        statistics = getattr(self.causal_lm, "next_token_statistics", None)
        if statistics is not None:  # MHF: never forms [b, s, V]
            picked, best, argmax = statistics(
                hidden_states, targets, temperature=temperature[0]
            )
            argmax = ops.cast(argmax, "int32")
            return picked, ops.cast(argmax == targets, "float32"), best, argmax
        log_probs = self.causal_lm.token_log_probs(hidden_states)
        picked = ops.take_along_axis(log_probs, targets[..., None], axis=-1)
        best = ops.max(log_probs, axis=-1)
        argmax = ops.cast(ops.argmax(log_probs, axis=-1), "int32")
        is_argmax = argmax == targets
        return picked[..., 0], ops.cast(is_argmax, "float32"), best, argmax

    def compute_output_spec(self, hidden_states, token_ids, temperature=None):
        batch, length = token_ids.shape[0], token_ids.shape[1]
        length = None if length is None else length - 1
        return tuple(
            keras.KerasTensor((batch, length), dtype=dtype)
            for dtype in ("float32", "float32", "float32", "int32")
        )


class _TargetLossHead(CausalLMHead):
    """Final hidden states, target ids and the scoring temperature per row
    -> per-position negative log-likelihood of the targets `[b, s]`
    (float32), through the model's `next_token_statistics` (MHF: never
    forms `[b, s, V]`)."""

    def call(self, hidden_states, target_ids, temperature):
        picked, _, _ = self.causal_lm.next_token_statistics(
            hidden_states,
            ops.cast(target_ids, "int32"),
            with_argmax=False,
            temperature=temperature[0],
        )
        return -picked

    def compute_output_spec(self, hidden_states, target_ids, temperature):
        return keras.KerasTensor(target_ids.shape, dtype="float32")


def scoring_model(inputs, outputs):
    """`keras.Model(inputs, outputs)` for compiled scoring. On TensorFlow
    its `predict_on_batch` runs under XLA (`jit_compile=True`; Keras leaves
    XLA off on CPU), which fuses the vocabulary scan's gathers, sums and
    exponentials into one loop. JAX compiles it anyway; PyTorch runs
    eagerly."""
    model = keras.Model(inputs, outputs)
    if keras.config.backend() == "tensorflow":
        model.jit_compile = True
    return model


def temperature_input():
    """A compiled scorer's temperature input: `scoring_temperature` once
    per row (`temperature_rows` feeds it), so that changing the temperature
    (calibration, `paper_rule`) never compiles a scorer again."""
    return keras.Input((), dtype="float32", name="temperature")


def temperature_rows(causal_lm, rows):
    """The `temperature_input` value for a batch of `rows`."""
    return np.full((rows,), causal_lm.scoring_temperature, "float32")


# A model's compiled scorers by name, weakly keyed by the model (a scorer
# never keeps its model alive). Read through `compiled_scorer` and
# `built_scorer`, emptied by `forget_compiled`.
_compiled_scorers = weakref.WeakKeyDictionary()

# The name of `target_losses`' compiled scorer.
TARGET_LOSSES = "target_losses"


def compiled_scorer(causal_lm, name, build):
    """The compiled scorer `name` of `causal_lm`: built by `build()` on
    first use, then kept until the model is released or `forget_compiled`
    drops it (`NextTokenScorer.for_model`, `target_losses`,
    `keras_mhf.evaluation.calibration.raw_scores`)."""
    scorers = _compiled_scorers.setdefault(causal_lm, {})
    if name not in scorers:
        scorers[name] = build()
    return scorers[name]


def predict(causal_lm, scorer, inputs):
    """`scorer.predict_on_batch(inputs)` for a compiled scorer of
    `causal_lm`, one call at a time per model (JAX's compiled predict
    donates the weights it shares with the model; see
    `keras_mhf.utils.concurrent_inference`)."""
    with inference(causal_lm):
        return scorer.predict_on_batch(inputs)


def built_scorer(causal_lm, name):
    """The compiled scorer `name` of `causal_lm` if it was built (and not
    forgotten since), else `None`; builds nothing."""
    return _compiled_scorers.get(causal_lm, {}).get(name)


def target_losses(causal_lm, token_ids, padding_mask, target_ids):
    """`score(..., scoring_mode="loss")` of a MultiHashFormer, compiled: a
    function of the model built once (and kept until `forget_compiled`), so
    repeated calls of one shape run one compiled program instead of tracing
    the vocabulary scan eagerly every time. Inputs are checked by the
    caller; returns float32 numpy `[b, s]`."""

    def build():
        ids = keras.Input((None,), dtype="int32", name="token_ids")
        mask = keras.Input((None,), dtype="int32", name="padding_mask")
        targets = keras.Input((None,), dtype="int32", name="target_ids")
        temperature = temperature_input()
        hidden = causal_lm.backbone({"token_ids": ids, "padding_mask": mask})
        losses = _TargetLossHead(causal_lm)(hidden, targets, temperature)
        return scoring_model([ids, mask, targets, temperature], losses)

    scorer = compiled_scorer(causal_lm, TARGET_LOSSES, build)
    token_ids = np.asarray(ops.convert_to_numpy(token_ids), "int32")
    out = predict(
        causal_lm,
        scorer,
        [
            token_ids,
            np.asarray(ops.convert_to_numpy(padding_mask), "int32"),
            np.asarray(ops.convert_to_numpy(target_ids), "int32"),
            temperature_rows(causal_lm, len(token_ids)),
        ],
    )
    return np.asarray(ops.convert_to_numpy(out), "float32")


def forget_compiled(causal_lm):
    """Drops a model's compiled generation function and scorers: they
    captured its weights' structure (e.g. after quantization)."""
    causal_lm.generate_function = None
    _compiled_scorers.pop(causal_lm, None)


class NextTokenScorer:
    """Compiled per-position scores of a `MultiHashFormerCausalLM` or
    `StandardCausalLM` (anything with `backbone` and `token_log_probs`).

    Args:
        causal_lm: the model.
        batch_size: rows per compiled call (shorter batches are padded).
        length_multiple: lengths are padded up to a multiple of this.

    Example:

    ```python
    scorer = NextTokenScorer.for_model(lm)
    log_probs, is_argmax, max_log_probs = scorer(token_ids, padding_mask)
    ```
    """

    def __init__(self, causal_lm, batch_size=8, length_multiple=64):
        # Weak: the scorer is kept per model (`compiled_scorer`).
        self._causal_lm = weakref.ref(causal_lm)
        self.batch_size = int(batch_size)
        self.length_multiple = int(length_multiple)
        # Input shapes called so far: one compiled program each.
        self.shapes = set()
        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        padding_mask = keras.Input((None,), dtype="int32", name="padding_mask")
        hidden = causal_lm.backbone(
            {"token_ids": token_ids, "padding_mask": padding_mask}
        )
        # MHF: the temperature is an input, so one program serves every
        # temperature.
        self.takes_temperature = hasattr(causal_lm, "next_token_statistics")
        temperature = temperature_input() if self.takes_temperature else None
        outputs = _NextTokenHead(causal_lm)(hidden, token_ids, temperature)
        inputs = [token_ids, padding_mask]
        self.model = scoring_model(
            inputs + [temperature] if self.takes_temperature else inputs,
            outputs,
        )

    @property
    def causal_lm(self):
        return self._causal_lm()

    @classmethod
    def for_model(cls, causal_lm, batch_size=8):
        """The scorer of `causal_lm` (built once per model and batch size,
        kept until `forget_compiled`)."""
        return compiled_scorer(
            causal_lm,
            cls._scorer_name(batch_size),
            lambda: cls(causal_lm, batch_size=batch_size),
        )

    @classmethod
    def cached(cls, causal_lm, batch_size=8):
        """The scorer `for_model` built for `causal_lm` and `batch_size`, or
        `None` if there is none; builds nothing."""
        return built_scorer(causal_lm, cls._scorer_name(batch_size))

    @staticmethod
    def _scorer_name(batch_size):
        return ("next_token", batch_size)

    def __call__(self, token_ids, padding_mask=None, with_argmax=False):
        """Scores `[n, s]` ids: `(log_probs, is_argmax, max_log_probs)`, each
        `[n, s-1]` numpy (float32, bool, float32), where `log_probs[i, t] =
        log p(token_ids[i, t+1] | token_ids[i, :t+1])` over the whole
        vocabulary; `with_argmax`: also the argmax's ids (int32)."""
        token_ids = np.asarray(token_ids, "int32")
        if padding_mask is None:
            padding_mask = np.ones_like(token_ids)
        padding_mask = np.asarray(padding_mask, "int32")
        check_tokenizer = getattr(self.causal_lm, "check_tokenizer", None)
        if check_tokenizer is not None:
            check_tokenizer()
        check_token_ids(token_ids, self.causal_lm.backbone.vocabulary_size)
        count, length = token_ids.shape
        padded = -(-length // self.length_multiple) * self.length_multiple
        self.shapes.add((self.batch_size, padded))
        outputs = [[], [], [], []]
        for start in range(0, count, self.batch_size):
            ids = np.zeros((self.batch_size, padded), "int32")
            mask = np.zeros((self.batch_size, padded), "int32")
            rows = min(self.batch_size, count - start)
            ids[:rows, :length] = token_ids[start : start + rows]
            mask[:rows, :length] = padding_mask[start : start + rows]
            mask[rows:, 0] = 1  # pad rows: one real token, never read
            inputs = [ids, mask]
            if self.takes_temperature:
                inputs.append(temperature_rows(self.causal_lm, len(ids)))
            result = predict(self.causal_lm, self.model, inputs)
            for output, values in zip(outputs, result):
                values = np.asarray(ops.convert_to_numpy(values))
                output.append(values[:rows, : length - 1])
        log_probs, is_argmax, best, argmax = (
            np.concatenate(o) for o in outputs
        )
        if with_argmax:
            return log_probs, is_argmax > 0.5, best, argmax
        return log_probs, is_argmax > 0.5, best
