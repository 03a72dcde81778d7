"""Streaming generation: `generate`'s tokens, handed out as they are made.

`generate` runs KerasHub's decoding loop to the end in one compiled call.
Here the same loop (the same body: the sampler's or MultiHashFormer's top-k
step, prompt mask and stop tokens) runs a few steps at a time on a KV cache
kept between the calls: the prompt's forward pass (`prefill`), then
`advance` for one step (so the first token comes after the prompt's pass
and one step), `chunk_size` steps, and twice as many each call after, up to
`MAX_CHUNK_GROWTH * chunk_size`, compiled once per shape like
`generate` (`jax.jit`, `tf.function`; eagerly on PyTorch). The host reads each
row's new tokens between calls, ends a row at its first stop token or its
token limit, and stops when every row has ended. The random stream is the
sampler's own, carried from call to call, so greedy and seeded sampling
give `generate`'s tokens.

- `TokenStream`: new token ids per row, chunk by chunk, and why each row
  ended (`"stop"` or `"length"`).
- `TextPieces`: a row's ids as text pieces whose concatenation is what
  `generate(..., strip_prompt=True)` returns (the preprocessor's own
  `generate_postprocess`), holding back an unfinished UTF-8 character and
  any text that may begin a stop string.
- `generate_stream`: the public iterator (`CausalLM.generate_stream`).
"""

import collections
import json
import weakref

import keras
import keras_hub
import numpy as np
from keras import ops

from keras_mhf.models import generation
from keras_mhf.models.causal_lm_inputs import check_length_arguments
from keras_mhf.models.causal_lm_inputs import check_texts
from keras_mhf.models.causal_lm_inputs import pack_text_prompts
from keras_mhf.models.causal_lm_inputs import size_token_id_prompts
from keras_mhf.utils.compiled_generation import compile_like_generate
from keras_mhf.utils.concurrent_inference import inference
from keras_mhf.utils.token_ids import check_token_ids

# Decoding steps per compiled call after the first (which makes one token);
# the calls after it double their steps up to `MAX_CHUNK_GROWTH` times this,
# so a long answer pays few calls' fixed cost.
DEFAULT_CHUNK_SIZE = 8
MAX_CHUNK_GROWTH = 4

DecodingLoop = collections.namedtuple(
    "DecodingLoop", ["cond", "body", "initial", "statistics"]
)
DecodingLoop.__doc__ = """A task's decoding loop over `(prompt, cache, index,
*extra)`: `cond` and `body` as `ops.while_loop` takes them, `initial` the
extra loop variables' first values, and `statistics` (or `None`) a
`DecodingStatistics` to which the loop's last two extra values (fallbacks,
steps) are added when a stream ends."""


def any_stop_token(token_ids, stop_token_ids, mask):
    """`[b, s]` bool: a stop token at a generated (unmasked) position."""
    hits = ops.zeros_like(token_ids, dtype="bool")
    for stop in stop_token_ids:
        hits = ops.logical_or(hits, token_ids == stop)
    return ops.logical_and(hits, mask)


def stop_condition(prompt, stop_token_ids, mask):
    """A generation loop's `cond`: not every row has a generated stop
    token yet (`mask`: the prompt's positions)."""
    if stop_token_ids is None:
        return ops.convert_to_tensor(True, dtype="bool")
    ends = any_stop_token(prompt, stop_token_ids, ops.logical_not(mask))
    return ops.logical_not(ops.all(ops.any(ends, axis=-1)))


def empty_cache(backbone, token_ids, dtype):
    """A zero KV cache `[b, num_layers, 2, max_length, num_key_value_heads,
    head_dim]` for prompts `token_ids [b, max_length]`."""
    batch_size, max_length = ops.shape(token_ids)[0], ops.shape(token_ids)[1]
    shape = [
        batch_size,
        backbone.num_layers,
        2,
        max_length,
        backbone.num_key_value_heads,
        backbone.head_dim,
    ]
    return ops.zeros(shape, dtype=dtype)


# Prompts are run through the trunk up to the longest one, rounded up to a
# multiple of this (few compiled shapes), not over the whole width.
PREFILL_MULTIPLE = 32


def sampled_loop(causal_lm, sampler, mask, stop_token_ids):
    """KerasHub's sampler loop (`Sampler.__call__`'s body, as every causal
    LM's `generate_step` runs it) on `causal_lm.call_with_cache`'s scores,
    for samplers that draw from the whole distribution."""

    def cond(prompt, cache, index):
        return stop_condition(prompt, stop_token_ids, mask)

    def body(prompt, cache, index):
        batch_size = ops.shape(prompt)[0]
        previous = ops.slice(prompt, [0, index - 1], [batch_size, 1])
        logits, _, cache = causal_lm.call_with_cache(previous, cache, index - 1)
        probabilities = sampler.compute_probabilities(logits[:, 0])
        chosen = ops.cast(sampler.get_next_token(probabilities), prompt.dtype)
        chosen = ops.where(mask[:, index], prompt[:, index], chosen)
        prompt = ops.slice_update(prompt, [0, index], chosen[:, None])
        return prompt, cache, index + 1

    return DecodingLoop(cond, body, (), None)


def check_streamable(sampler):
    """Refuses samplers that do not choose one token per step from the
    scores so far (beam and contrastive search override the loop)."""
    if type(sampler).__call__ is not keras_hub.samplers.Sampler.__call__:
        raise ValueError(
            f"generate_stream: a {type(sampler).__name__} does not choose "
            "each token from the tokens before it alone, so its tokens "
            "cannot be streamed. Compile with sampler='greedy', 'top_k', "
            "'top_p' or 'random' (or pass sampler=...)."
        )


SAMPLERS = ("greedy", "top_k", "top_p", "random")


def make_sampler(name, temperature=1.0, top_k=5, top_p=0.9, seed=None):
    """A KerasHub sampler from command-line or API settings.

    Args:
        name: `"greedy"`, `"top_k"`, `"top_p"` or `"random"`.
        temperature: > 0, divides the scores before sampling (not greedy).
        top_k: int >= 1, for `"top_k"`.
        top_p: in (0, 1], for `"top_p"`.
        seed: int or `None`: the sampler's random stream (the same seed and
            prompt give the same tokens).

    Example:

    ```python
    lm.generate_stream("The cell", max_new_tokens=8,
                       sampler=make_sampler("top_p", 0.8, top_p=0.9, seed=1))
    ```
    """
    samplers = keras_hub.samplers
    if name not in SAMPLERS:
        raise ValueError(
            f"sampler must be one of {', '.join(SAMPLERS)}; got {name!r}."
        )
    if name == "greedy":
        return samplers.GreedySampler()
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0 to sample; got {temperature!r} (use "
            "the greedy sampler for temperature 0)."
        )
    if name == "top_k":
        if int(top_k) < 1:
            raise ValueError(f"top_k must be >= 1; got {top_k!r}.")
        return samplers.TopKSampler(
            k=int(top_k), seed=seed, temperature=temperature
        )
    if name == "top_p":
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {top_p!r}.")
        return samplers.TopPSampler(
            p=float(top_p), seed=seed, temperature=temperature
        )
    return samplers.RandomSampler(seed=seed, temperature=temperature)


def _sampler_key(sampler):
    config = dict(sampler.get_config())
    config.pop("seed", None)  # the state is copied in; see `_Decoder`
    return type(sampler), json.dumps(config, sort_keys=True, default=str)


class _Decoder:
    """A model's compiled `prefill` and `advance` for one sampler
    configuration and stop tokens. It runs with its own sampler (`template`)
    so that a new sampler of the same configuration (another seed) compiles
    nothing: a stream copies its sampler's random state in and back out."""

    def __init__(self, causal_lm, sampler, stop_token_ids):
        template = type(sampler).from_config(sampler.get_config())
        self.template = template

        def prefill(prompt_ids, token_ids):
            # The KV cache of the whole width, seeded with the prompts' part
            # only: what is past the longest prompt is generated anyway.
            cache = empty_cache(
                causal_lm.backbone, token_ids, causal_lm.compute_dtype
            )
            return causal_lm.prefill_cache(prompt_ids, cache)

        def advance(token_ids, cache, index, extra, mask, steps):
            loop = causal_lm.decoding_loop(template, mask, stop_token_ids)
            limit = ops.shape(token_ids)[-1] - index
            out = template.run_loop(
                loop.cond,
                loop.body,
                loop_vars=(token_ids, cache, index, *extra),
                maximum_iterations=ops.minimum(steps, limit),
                model=causal_lm,
            )
            return out[0], out[1], out[2], tuple(out[3:])

        self.prefill = compile_like_generate(causal_lm, template, prefill)
        self.advance = compile_like_generate(causal_lm, template, advance)


_DECODERS = weakref.WeakKeyDictionary()


def _decoder(causal_lm, sampler, stop_token_ids):
    """The model's `_Decoder` for this sampler configuration, stop tokens
    and (MHF) decoding settings, built once."""
    # Building the generation function refreshes MHF's bucket index; its
    # key changes when the table or the decoding settings change.
    generate_function = causal_lm.make_generate_function()
    key = (
        _sampler_key(sampler),
        None if stop_token_ids is None else tuple(stop_token_ids),
        getattr(generate_function, "decoding_key", None),
        # New variables (LoRA enabled, a quantized layer) build it again.
        tuple(id(v) for v in causal_lm.weights),
    )
    decoders = _DECODERS.setdefault(causal_lm, {})
    if key not in decoders:
        decoders[key] = _Decoder(causal_lm, sampler, stop_token_ids)
    return decoders[key]


def chunk_schedule(chunk_size):
    """The decoding steps of a stream's compiled calls, call after call:
    1, `chunk_size`, then twice the last, up to `MAX_CHUNK_GROWTH *
    chunk_size`."""
    yield 1
    steps, most = chunk_size, MAX_CHUNK_GROWTH * chunk_size
    while True:
        yield steps
        steps = min(2 * steps, most)


def _scalar(value):
    """An int32 scalar argument of a compiled call (on JAX a numpy scalar,
    which costs less to pass than a backend tensor)."""
    if keras.config.backend() == "jax":
        return np.int32(value)
    return ops.convert_to_tensor(value, "int32")


class TokenStream:
    """New token ids of a batch of prompts, chunk by chunk.

    Iterating yields, per compiled call, a list with each row's new ids
    (int32 numpy arrays, empty once the row has ended). A row ends before
    its first stop token (`finish_reasons[i] = "stop"`) or after `limits[i]`
    new tokens (`"length"`); the stream ends when every row has.

    Args:
        causal_lm: the causal LM.
        prompt: `{"token_ids", "padding_mask"}` `[b, total]`, right-padded
            (as `pack_text_prompts` / `size_token_id_prompts` make them).
        lengths: each row's prompt length.
        limits: each row's most new tokens.
        stop_token_ids: ids that end a row (`None`: none).
        sampler: a KerasHub sampler (default: the model's).
        chunk_size: decoding steps of the second compiled call (the first
            makes one token); each later call doubles them, up to
            `MAX_CHUNK_GROWTH` times `chunk_size`.

    Example:

    ```python
    prompt, lengths = pack_text_prompts(lm.preprocessor, ["Hi"], None, 8)
    for new_ids in TokenStream(lm, prompt, lengths, [8], [2]):
        print(new_ids[0])
    ```
    """

    def __init__(
        self,
        causal_lm,
        prompt,
        lengths,
        limits,
        stop_token_ids,
        sampler=None,
        chunk_size=DEFAULT_CHUNK_SIZE,
    ):
        self.causal_lm = causal_lm
        self.sampler = causal_lm.sampler if sampler is None else sampler
        check_streamable(self.sampler)
        self.token_ids = np.asarray(
            ops.convert_to_numpy(prompt["token_ids"]), "int32"
        )
        self.mask = np.asarray(
            ops.convert_to_numpy(prompt["padding_mask"])
        ).astype(bool)
        check_token_ids(self.token_ids, causal_lm.backbone.vocabulary_size)
        self.lengths = [int(n) for n in lengths]
        width = self.token_ids.shape[1]
        self.limits = [
            max(0, min(int(limit), width - n))
            for limit, n in zip(limits, self.lengths)
        ]
        self.stop_token_ids = (
            None if stop_token_ids is None else tuple(stop_token_ids)
        )
        self.chunk_size = int(chunk_size)
        self.finish_reasons = [
            "length" if limit == 0 else None for limit in self.limits
        ]
        self.steps = 0

    def end_row(self, row, reason):
        """Ends `row` now (a stop string, a client gone): the stream reads
        nothing more for it, and ends when every row has ended."""
        if self.finish_reasons[row] is None:
            self.finish_reasons[row] = reason

    @property
    def done(self):
        return all(reason is not None for reason in self.finish_reasons)

    def _read(self, token_ids, index):
        """Each row's new ids up to `index`, ending rows at a stop token or
        their limit."""
        pieces = []
        for row, (start, limit) in enumerate(zip(self.lengths, self.limits)):
            if self.finish_reasons[row] is not None:
                pieces.append(np.zeros((0,), "int32"))
                continue
            begin = start + self.emitted[row]
            end = min(index, start + limit)
            new = token_ids[row, begin:end]
            if self.stop_token_ids is not None and len(new):
                hits = np.flatnonzero(np.isin(new, self.stop_token_ids))
                if len(hits):
                    new = new[: hits[0]]
                    self.finish_reasons[row] = "stop"
            self.emitted[row] += len(new)
            if self.finish_reasons[row] is None and end >= start + limit:
                self.finish_reasons[row] = "length"
            pieces.append(np.asarray(new, "int32"))
        return pieces

    def __iter__(self):
        self.emitted = [0] * len(self.lengths)
        if self.done:
            return
        decoder = _decoder(self.causal_lm, self.sampler, self.stop_token_ids)
        template = decoder.template
        for mine, theirs in zip(template.variables, self.sampler.variables):
            mine.assign(theirs.value)
        token_ids = generation.distribute(self.token_ids)
        mask = ops.convert_to_tensor(self.mask)
        index = min(self.lengths)
        width = self.token_ids.shape[1]
        loop = self.causal_lm.decoding_loop(template, mask, None)
        extra = tuple(ops.convert_to_tensor(v) for v in loop.initial)
        try:
            prompt_width = min(
                width,
                -(-max(self.lengths) // PREFILL_MULTIPLE) * PREFILL_MULTIPLE,
            )
            prompt_ids = self.token_ids[:, :prompt_width]
            with inference(self.causal_lm):
                cache = decoder.prefill(prompt_ids, token_ids)
            schedule = chunk_schedule(self.chunk_size)
            steps, previous = next(schedule), index
            while not self.done and index < width:
                with inference(self.causal_lm):
                    token_ids, cache, index_tensor, extra = decoder.advance(
                        token_ids,
                        cache,
                        _scalar(index),
                        extra,
                        mask,
                        _scalar(steps),
                    )
                    host = np.asarray(ops.convert_to_numpy(token_ids))
                    index = int(ops.convert_to_numpy(index_tensor))
                yield self._read(host, index)
                steps = next(schedule)
                if index == previous:
                    break  # every row has a stop token (the loop's cond)
                previous = index
        finally:
            for mine, theirs in zip(self.sampler.variables, template.variables):
                mine.assign(theirs.value)
            if loop.statistics is not None and len(extra) >= 2:
                loop.statistics.fallbacks += int(ops.convert_to_numpy(extra[0]))
                loop.statistics.steps += int(ops.convert_to_numpy(extra[1]))
        for row, reason in enumerate(self.finish_reasons):
            if reason is None:
                self.finish_reasons[row] = "length"


class TextPieces:
    """One row's generated ids as text pieces.

    `push(new_ids)` returns the text that is certain so far; `finish()`
    returns the rest. Their concatenation is the preprocessor's
    `generate_postprocess` of all the ids (what `generate(...,
    strip_prompt=True)` returns), cut before the first of `stop` strings
    (then `stopped` is True). A piece never ends with half a UTF-8
    character (U+FFFD from an unfinished byte sequence) or with text that
    may begin a stop string.

    Example:

    ```python
    pieces = TextPieces(lm.preprocessor, stop=["\\n\\n"])
    text = pieces.push(new_ids) + pieces.finish()
    ```
    """

    def __init__(self, preprocessor, stop=None):
        self.preprocessor = preprocessor
        self.stop = [s for s in (stop or []) if s]
        self.ids = []
        self.emitted = ""
        self.stopped = False
        # `decoded` is the text of `ids[:read]`; `ids[prefix:read]` (the
        # previous push's ids) start the next push's window.
        self.decoded = ""
        self.prefix = self.read = 0

    def _text(self):
        """The text of every id so far, from two short decodes (the new ids
        with the previous push's before them, and those alone): the text
        the new ids add is what the first adds to the second, so a long
        answer is not decoded whole at every push."""
        if self.read == len(self.ids):
            return self.decoded
        before = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if not window.startswith(before):
            return self._decode(self.ids)  # not seen with SentencePiece
        text = self.decoded + window[len(before) :]
        if not window.endswith("\ufffd"):  # else: a character unfinished
            self.decoded, self.prefix, self.read = (
                text,
                self.read,
                len(self.ids),
            )
        return text

    def _decode(self, ids):
        """The preprocessor's `generate_postprocess` of `ids`."""
        if not ids:
            return ""
        ids = np.asarray([ids], "int32")
        text = self.preprocessor.generate_postprocess(
            {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
        )
        text = np.asarray(ops.convert_to_numpy(text)).reshape(-1)[0]
        return text.decode("utf-8") if isinstance(text, bytes) else str(text)

    def _cut_at_stop(self, text):
        found = [text.find(s) for s in self.stop]
        found = [i for i in found if i >= 0]
        if not found:
            return text, False
        return text[: min(found)], True

    def _held_back(self, text):
        """How many trailing characters may still change or begin a stop
        string."""
        held = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return held

    def _piece(self, text):
        if not text.startswith(self.emitted):
            # The decoder changed text it had given (not seen with
            # SentencePiece): give only what extends the longest common
            # start, so nothing already streamed is repeated.
            common = 0
            for a, b in zip(text, self.emitted):
                if a != b:
                    break
                common += 1
            text = self.emitted + text[common:]
        piece = text[len(self.emitted) :]
        self.emitted = text
        return piece

    def push(self, new_ids):
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in new_ids)
        text, self.stopped = self._cut_at_stop(self._text())
        if not self.stopped:
            text = text[: len(text) - self._held_back(text)]
        if len(text) < len(self.emitted):
            return ""
        return self._piece(text)

    def finish(self):
        if self.stopped:
            return ""
        # The whole answer decoded once, as `generate` decodes it.
        text, self.stopped = self._cut_at_stop(self._decode(self.ids))
        if len(text) < len(self.emitted):
            return ""
        return self._piece(text)


def _packed_prompts(causal_lm, inputs, max_length, max_new_tokens, truncate):
    """`(prompt, lengths, limits, scalar input)` for `generate_stream`."""
    preprocessor = causal_lm.preprocessor
    if preprocessor is None:
        if truncate is not None:
            raise ValueError(
                "generate_stream: truncate='left' applies to text prompts; "
                "token-id prompts are used as given."
            )
        prompt, lengths = size_token_id_prompts(
            inputs, max_length, max_new_tokens
        )
        return prompt, lengths, False
    scalar = isinstance(inputs, (str, bytes))
    texts = [inputs] if scalar else inputs
    if hasattr(texts, "dtype") and tuple(texts.shape) == ():
        texts, scalar = [np.asarray(texts).item()], True
    check_texts(texts, "prompts", allow_single=False)
    prompt, lengths = pack_text_prompts(
        preprocessor, texts, max_length, max_new_tokens, truncate
    )
    return prompt, lengths, scalar


def generate_stream(
    causal_lm,
    inputs,
    max_length=None,
    stop_token_ids="auto",
    max_new_tokens=None,
    truncate=None,
    stop=None,
    sampler=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
):
    """`generate`, streamed: an iterator of what each compiled call made.

    Prompts, lengths and stop tokens are checked and packed as `generate`
    does them (same arguments and errors), and the tokens are
    `generate`'s: greedy, and seeded sampling from a fresh sampler with
    the same seed.

    Args:
        causal_lm: a `MultiHashFormerCausalLM` or `StandardCausalLM`.
        inputs: a string, a list of strings (with a preprocessor), or token
            ids `{"token_ids", "padding_mask"}` `[b, s]` (without one).
        max_length, stop_token_ids, max_new_tokens, truncate: as in
            `generate`.
        stop: strings (text prompts only) that end a prompt's text before
            them, like a stop token.
        sampler: a KerasHub sampler (or its name) for this call instead of
            the model's compiled one.
        chunk_size: decoding steps of the second compiled call (the first
            makes one token; later calls double them, up to 4x).

    Returns:
        A `TextStream`, an iterable. For one string it yields text pieces
        (`str`), whose concatenation is `generate(..., strip_prompt=True)`'s
        text. For a list of strings: a
        list with one piece per prompt (`""` when a prompt has nothing
        new). For token ids: a list with each row's new ids (int32 arrays,
        stop token excluded). Its `finish_reasons` say, once it has ended,
        why each row did (`"stop"` or `"length"`).

    Example:

    ```python
    for piece in lm.generate_stream("The cell", max_new_tokens=32):
        print(piece, end="", flush=True)
    ```
    """
    check_length_arguments(max_length, max_new_tokens, truncate)
    if sampler is not None:
        sampler = keras_hub.samplers.get(sampler)
    stop_token_ids = generation.resolved_stop_token_ids(
        causal_lm, stop_token_ids
    )
    prompt, lengths, scalar = _packed_prompts(
        causal_lm, inputs, max_length, max_new_tokens, truncate
    )
    preprocessor = causal_lm.preprocessor
    if stop and preprocessor is None:
        raise ValueError(
            "generate_stream: stop strings need a preprocessor (text); with "
            "token ids, pass stop_token_ids."
        )
    if isinstance(stop, str):
        stop = [stop]
    width = int(np.shape(prompt["token_ids"])[1])
    if max_new_tokens is not None:
        limits = [max_new_tokens] * len(lengths)
    else:
        limits = [width - n for n in lengths]
    stream = TokenStream(
        causal_lm, prompt, lengths, limits, stop_token_ids, sampler, chunk_size
    )
    return TextStream(stream, preprocessor, stop, scalar)


class TextStream:
    """`generate_stream`'s iterator: a `TokenStream`'s ids as text pieces
    (`TextPieces` per row), one piece for a scalar prompt, else a list per
    chunk; ids as they are without a preprocessor. `finish_reasons` (after
    the stream ends): per row `"stop"` (a stop token or string) or
    `"length"`.

    Example:

    ```python
    stream = lm.generate_stream("The cell", max_new_tokens=8)
    text = "".join(stream)
    stream.finish_reasons  # ["length"] or ["stop"]
    ```
    """

    def __init__(self, tokens, preprocessor, stop, scalar):
        self.tokens = tokens
        self.preprocessor = preprocessor
        self.scalar = scalar
        self.rows = None
        if preprocessor is not None:
            self.rows = [TextPieces(preprocessor, stop) for _ in tokens.lengths]

    @property
    def finish_reasons(self):
        reasons = list(self.tokens.finish_reasons)
        for i, row in enumerate(self.rows or ()):
            if row.stopped:
                reasons[i] = "stop"
        return reasons

    def __iter__(self):
        if self.rows is None:
            yield from self.tokens
            return
        for new_ids in self.tokens:
            pieces = []
            for i, (row, ids) in enumerate(zip(self.rows, new_ids)):
                pieces.append(row.push(ids))
                if row.stopped:
                    self.tokens.end_row(i, "stop")
            if self.scalar:
                if pieces[0]:
                    yield pieces[0]
            else:
                yield pieces
        last = [row.finish() for row in self.rows]
        if self.scalar:
            if last[0]:
                yield last[0]
        elif any(last):
            yield last
