"""What `keras-mhf serve` says about the model it serves."""

import time

from keras_mhf.serving.served_tokenizer import ServedTokenizer


class ServedModel:
    """The served causal LM's facts: its API name, longest sequence, kind,
    scoring rule and tokenizer.

    Args:
        causal_lm: a `MultiHashFormerCausalLM` or `StandardCausalLM` with
            its preprocessor.
        name: the model's id in the API (`GET /v1/models`, the requests'
            `model`).
        max_length: the longest prompt plus completion, in tokens (start
            token included). Default: the preprocessor's `sequence_length`
            (the length the model was trained on).

    Example:

    ```python
    served = ServedModel(lm, "mhf")
    served.card()  # the /v1/models entry
    ```
    """

    def __init__(self, causal_lm, name, max_length=None):
        if causal_lm.preprocessor is None:
            raise ValueError(
                "keras-mhf serve: the model has no preprocessor (tokenizer); "
                "serve a preset saved with one."
            )
        self.causal_lm = causal_lm
        self.name = name
        if max_length is None:
            max_length = causal_lm.preprocessor.sequence_length
        if max_length is None or int(max_length) < 2:
            raise ValueError(
                "keras-mhf serve: the longest sequence is unknown or below 2 "
                f"({max_length!r}); pass --max-model-len."
            )
        self.max_length = int(max_length)
        self.tokenizer = ServedTokenizer(causal_lm.preprocessor.tokenizer)
        self.created = int(time.time())

    @property
    def kind(self):
        if hasattr(self.causal_lm, "scoring_temperature"):
            return "MultiHashFormer"
        return "Standard"

    @property
    def scoring_rule(self):
        """How log-probs are computed, in words."""
        temperature = getattr(self.causal_lm, "scoring_temperature", None)
        if temperature is None:
            return "log_softmax over the vocabulary's logits"
        if temperature == 1.0:
            return "the paper's rule: log_softmax_V(s(w)) (Sec. 3.4)"
        return (
            "calibrated: log_softmax_V(s(w) / tau), scoring temperature "
            f"tau = {temperature:g} (the paper's rule is tau = 1)"
        )

    def card(self):
        """The model's `GET /v1/models` entry."""
        temperature = getattr(self.causal_lm, "scoring_temperature", None)
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "keras-mhf",
            "architecture": self.kind,
            "max_model_len": self.max_length,
            "vocab_size": self.tokenizer.vocabulary_size,
            "scoring_rule": self.scoring_rule,
            "scoring_temperature": temperature,
        }
