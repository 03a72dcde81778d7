"""A `POST /v1/completions` body, read and checked."""

import math

from keras_mhf.serving.api_error import ApiError

# Fields of the OpenAI completions API that this server does not act on:
# a request that sets them to anything but their no-op value is refused
# rather than answered as if they had been applied.
NO_OP_FIELDS = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
}

MAX_LOGPROBS = 5  # as OpenAI's legacy completions


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _prompts(prompt):
    """The prompt field as a list of rows, each a string or a list of
    token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(
            isinstance(p, list) and p and all(_is_int(t) for t in p)
            for p in prompt
        ):
            return [list(p) for p in prompt]
    raise ApiError(
        422,
        "prompt must be a string, a list of strings, a list of token ids "
        "or a list of non-empty token-id lists.",
        param="prompt",
    )


class CompletionRequest:
    """The settings of one completions request, checked.

    `from_body(body, served)` reads the JSON body and raises `ApiError` for
    each bad field (one line: the field, the value, what is allowed).
    `prompts` are the rows as token ids, each starting with `<s>` (added
    unless the row's first id is it, as `generate` and `evaluate` start
    every text); `added_start[i]` says whether it was added (the response
    leaves it out).

    Args:
        served: the served model's facts: `name`, `max_length`,
            `tokenizer` (a `ServedTokenizer`).
        body: the parsed JSON body (a dict).

    Example:

    ```python
    request = CompletionRequest.from_body(
        {"model": "mhf", "prompt": "The cell", "max_tokens": 8}, served
    )
    ```
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)

    @classmethod
    def from_body(cls, body, served):
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        model = body.get("model")
        if model is not None and model != served.name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"`{served.name}` (GET /v1/models lists it).",
                param="model",
                code="model_not_found",
            )
        if "prompt" not in body:
            raise ApiError(400, "prompt is required.", param="prompt")
        rows = _prompts(body["prompt"])
        fields = {
            "model": served.name,
            "echo": cls._flag(body, "echo"),
            "stream": cls._flag(body, "stream"),
            "max_tokens": cls._max_tokens(body),
            "temperature": cls._number(body, "temperature", 1.0, 0.0),
            "top_p": cls._number(body, "top_p", 1.0, None),
            "top_k": cls._top_k(body),
            "seed": cls._seed(body),
            "stop": cls._stop(body),
            "logprobs": cls._logprobs(body),
            "include_usage": cls._include_usage(body),
        }
        cls._single_choice(body)
        cls._no_ops(body)
        if not 0 < fields["top_p"] <= 1:
            raise ApiError(
                400,
                f"top_p must be in (0, 1]; got {body['top_p']!r}.",
                param="top_p",
            )
        if fields["max_tokens"] == 0 and not fields["echo"]:
            raise ApiError(
                400,
                "max_tokens must be >= 1; 0 is allowed only with echo (to "
                "score the prompt).",
                param="max_tokens",
            )
        prompts, added = [], []
        tokenizer = served.tokenizer
        for row in rows:
            if isinstance(row, str):
                ids = tokenizer.encode(row)
            else:
                ids = row
                bad = [t for t in ids if not 0 <= t < tokenizer.vocabulary_size]
                if bad:
                    raise ApiError(
                        400,
                        f"token id {bad[0]} is out of range: the vocabulary "
                        f"has ids 0 to {tokenizer.vocabulary_size - 1}.",
                        param="prompt",
                    )
            add = not ids or ids[0] != tokenizer.start_token_id
            prompts.append([tokenizer.start_token_id] * add + list(ids))
            added.append(add)
        total = max(len(p) for p in prompts) + fields["max_tokens"]
        if total > served.max_length:
            longest = max(len(p) for p in prompts)
            raise ApiError(
                400,
                f"This model's maximum context length is {served.max_length} "
                f"tokens. However, you requested {total} tokens ({longest} "
                f"in the prompt, {fields['max_tokens']} in the completion). "
                "Please reduce the length of the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        fields["texts"] = [r if isinstance(r, str) else None for r in rows]
        return cls(prompts=prompts, added_start=added, **fields)

    @property
    def sampler_name(self):
        """The KerasHub sampler these settings choose: greedy at
        temperature 0, else top-k with `top_k`, top-p below 1, or random."""
        if self.temperature == 0:
            return "greedy"
        if self.top_k is not None:
            return "top_k"
        if self.top_p < 1:
            return "top_p"
        return "random"

    @staticmethod
    def _flag(body, name):
        value = body.get(name)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise ApiError(
                422, f"{name} must be true or false; got {value!r}.", name
            )
        return value

    @staticmethod
    def _max_tokens(body):
        value = body.get("max_tokens")
        if value is None:
            return 16  # OpenAI's default
        if not _is_int(value) or value < 0:
            raise ApiError(
                400,
                f"max_tokens must be an integer >= 0; got {value!r}.",
                param="max_tokens",
            )
        return value

    @staticmethod
    def _number(body, name, default, minimum):
        value = body.get(name)
        if value is None:
            return default
        if not _is_number(value):
            raise ApiError(
                422, f"{name} must be a number; got {value!r}.", param=name
            )
        if minimum is not None and value < minimum:
            raise ApiError(
                400,
                f"{name} must be >= {minimum:g}; got {value!r}.",
                param=name,
            )
        return float(value)

    @staticmethod
    def _top_k(body):
        value = body.get("top_k")
        if value is None or value == -1:
            return None  # vLLM's "off"
        if not _is_int(value) or value < 1:
            raise ApiError(
                400,
                f"top_k must be an integer >= 1 (or -1: off); got {value!r}.",
                param="top_k",
            )
        return value

    @staticmethod
    def _seed(body):
        value = body.get("seed")
        if value is not None and not _is_int(value):
            raise ApiError(
                422, f"seed must be an integer; got {value!r}.", param="seed"
            )
        return value

    @staticmethod
    def _stop(body):
        value = body.get("stop")
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return [s for s in value if s]
        raise ApiError(
            422,
            f"stop must be a string or a list of strings; got {value!r}.",
            param="stop",
        )

    @staticmethod
    def _logprobs(body):
        value = body.get("logprobs")
        if value is None:
            return None
        if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
            raise ApiError(
                400,
                f"logprobs must be an integer from 0 to {MAX_LOGPROBS}; got "
                f"{value!r}.",
                param="logprobs",
            )
        return value

    @staticmethod
    def _include_usage(body):
        options = body.get("stream_options")
        if options is None:
            return False
        if not isinstance(options, dict):
            raise ApiError(
                422, "stream_options must be an object.", "stream_options"
            )
        return bool(options.get("include_usage"))

    @staticmethod
    def _single_choice(body):
        value = body.get("n")
        if value is not None and value != 1:
            raise ApiError(
                400,
                f"n must be 1 (one completion per prompt); got {value!r}. "
                "Send the request again, with a seed each, for more.",
                param="n",
            )

    @staticmethod
    def _no_ops(body):
        for name, allowed in NO_OP_FIELDS.items():
            value = body.get(name)
            if value not in allowed:
                raise ApiError(
                    400,
                    f"{name} is not supported by this server; got {value!r} "
                    "(leave it out).",
                    param=name,
                )
