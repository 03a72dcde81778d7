"""Models and FLOP counts shared by `tools/benchmark.py` and
`tools/profile_step.py`: MultiHashFormer and the Standard baseline on the same
trunk, for a given vocabulary size (synthetic token strings beyond a real
tokenizer's), and the analytic FLOPs per token of either."""

import keras

from keras_mhf.models.model_size import synthetic_tokens
from keras_mhf.models.model_size import weight_bytes  # noqa: F401
from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm import (
    MultiHashFormerCausalLM,
)
from keras_mhf.models.standard.standard_causal_lm import StandardCausalLM
from keras_mhf.models.standard.standard_causal_lm import standard_backbone


def trunk_kwargs(hidden_dim, num_layers):
    """A Qwen3 trunk of width `hidden_dim` (heads of 64, 4 query heads per KV
    head, MLP 3d)."""
    heads = max(1, hidden_dim // 64)
    return dict(
        num_layers=num_layers,
        hidden_dim=hidden_dim,
        num_query_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=hidden_dim // heads,
        intermediate_dim=3 * hidden_dim,
    )


def parse_config(config):
    """`"h4b16384"` -> `(4, 16384)`."""
    h, b = config[1:].split("b")
    return int(h), int(b)


def benchmark_model(config, vocabulary_size, trunk, seed=0):
    """`"standard"` or an `"h<H>b<B>"` MHF on `trunk` (`trunk_kwargs`),
    compiled with AdamW(1e-4) and the greedy sampler, no preprocessor."""
    keras.utils.set_random_seed(seed)
    if config == "standard":
        backbone = standard_backbone(vocabulary_size, "tiny", **trunk)
        model = StandardCausalLM(backbone=backbone, preprocessor=None)
    else:
        h, b = parse_config(config)
        model = MultiHashFormerCausalLM.from_tokens(
            synthetic_tokens(vocabulary_size),
            f"tiny_h{h}b{b}",
            pad_token_id=2,
            **trunk,
        )
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), sampler="greedy")
    return model


def flops_per_token(config, vocabulary_size, trunk, context, factor=6):
    """Analytic FLOPs per token of a trunk (`trunk_kwargs` keys): training
    is `6 x` the forward multiply-adds at `context` = the sequence length;
    generation is `2 x` them at the average context of the new tokens."""
    d, L, s = trunk["hidden_dim"], trunk["num_layers"], context
    q, kv, hd, ff = (
        trunk["num_query_heads"],
        trunk["num_key_value_heads"],
        trunk["head_dim"],
        trunk["intermediate_dim"],
    )
    body = L * (d * hd * (2 * q + 2 * kv) + 3 * d * ff)
    attention = L * 2 * q * hd * s  # QK^T and AV, causal average over positions
    if config == "standard":
        head = vocabulary_size * d
    else:
        h, b = parse_config(config)
        # H bucket logits + H-1 soft retrievals, the H-1 mixers and the gate.
        head = (2 * h - 1) * b * d + (h - 1) * 3 * 64 * d + h * d * 64 + d * d
    return factor * (body + attention + head)


def _generation_prompt(batch_size, prompt_length, new_tokens):
    import numpy as np

    total = prompt_length + new_tokens
    prompt = {
        "token_ids": np.zeros((batch_size, total), "int32"),
        "padding_mask": np.zeros((batch_size, total), bool),
    }
    prompt["token_ids"][:, :prompt_length] = np.arange(3, 3 + prompt_length)
    prompt["padding_mask"][:, :prompt_length] = True
    return prompt


def generation_ms_per_token(model, batch_size, prompt_length=16, new_tokens=32):
    """Median (of 3 calls, after a compiling call) milliseconds per generated
    token with the KV cache; the model's sampler and decoding as set."""
    return interleaved_generation_ms_per_token(
        {"model": model}, batch_size, prompt_length, new_tokens
    )["model"]


def interleaved_generation_ms_per_token(
    models, batch_size, prompt_length=16, new_tokens=32, rounds=3
):
    """`generation_ms_per_token` of several models measured in turns (one
    call of each per round, after a compiling call of each), so that a
    change in the machine's load between them shows in every model's
    times alike: `{name: median ms per token}`.

    Example:

    ```python
    interleaved_generation_ms_per_token({"a": lm_a, "b": lm_b}, 1)
    ```
    """
    import time

    import numpy as np

    prompt = _generation_prompt(batch_size, prompt_length, new_tokens)
    for model in models.values():
        model.generate(prompt, stop_token_ids=None)
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            model.generate(prompt, stop_token_ids=None)
            elapsed = time.perf_counter() - start
            times[name].append(1000 * elapsed / new_tokens)
    return {name: float(np.median(t)) for name, t in times.items()}


def scoring_tokens_per_s(model, vocabulary_size, batch_size=8, length=128):
    """Tokens per second of `score(..., scoring_mode="loss")` (median of 3
    calls after a warm-up call)."""
    return interleaved_scoring_tokens_per_s(
        {"model": model}, vocabulary_size, batch_size, length
    )["model"]


def interleaved_scoring_tokens_per_s(
    models, vocabulary_size, batch_size=8, length=128, rounds=3
):
    """`scoring_tokens_per_s` of several models measured in turns (one call
    of each per round, after a warm-up call of each) on the same random
    ids, so that a change in the machine's load between them shows in
    every model's times alike: `{name: median tokens per second}`.

    Example:

    ```python
    interleaved_scoring_tokens_per_s({"a": lm_a, "b": lm_b}, 32768)
    ```
    """
    import time

    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocabulary_size, size=(batch_size, length + 1))
    ids = ids.astype("int32")
    x, targets = ids[:, :-1], ids[:, 1:]

    def score(model):
        keras.ops.convert_to_numpy(
            model.score(x, scoring_mode="loss", target_ids=targets)
        )

    for model in models.values():
        score(model)
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            score(model)
            times[name].append(time.perf_counter() - start)
    return {
        name: batch_size * length / float(np.median(t))
        for name, t in times.items()
    }


def synthetic_expansion(vocabulary, vocabulary_size):
    """New token strings that take a vocabulary to `vocabulary_size`
    entries (none of them a real piece)."""
    existing = set(vocabulary)
    count = vocabulary_size - len(vocabulary)
    tokens = [f"\u27e8synthetic{i}\u27e9" for i in range(count)]
    if existing.intersection(tokens):
        raise ValueError("Synthetic token strings clash with the vocabulary.")
    return tokens
