"""What the measurement scripts of `benchmarks/` share, apart from their
Markdown tables (those are `benchmarks/result_tables.py`):

- where things are: `ROOT` (the repository), `RESULTS` (the committed
  measurements, `benchmarks/results`), `DATA` (the shared data sets beside
  the checkout; `KERAS_MHF_DATA` overrides it), `OPENSTAX`, `MISTRAL`;
- running things: `argument_parser` (a script's options, its usage naming
  `python -m benchmarks.NAME`), `module_command` / `run_module` (a module as
  `python -m benchmarks.NAME` from the repository root: a worker process),
  `keras_mhf_command` (`keras-mhf COMMAND` in this Python), and the
  workers' `RESULT {json}` lines (`print_result`, `results_in`);
- writing and measuring: `write_json`, the peak memory readers
  (`peak_rss_bytes`, `children_peak_rss_bytes`, `current_rss_bytes`,
  `peak_memory_bytes`);
- the models measured and their FLOP counts: MultiHashFormer and the
  Standard baseline on the same trunk for a given vocabulary size
  (synthetic token strings beyond a real tokenizer's), random batches and
  prompts, generation and scoring speed, and a tiny SentencePiece model
  trained on the fly.

Only the standard library is imported here at module level (its portable
modules: `resource` is imported where memory is read): the page writer
(`write_performance_docs`, which runs anywhere) and the probe of
`check_transformers_versions` (run in environments without keras) import
this module too, and scripts such as `profile_step` set `KERAS_BACKEND` and
`XLA_FLAGS` before keras is imported. Functions import numpy, keras and
keras_mhf when called.

Example:

```python
from benchmarks import common

trunk = common.trunk_kwargs(512, 4)
model = common.benchmark_model("h4b16384", 32768, trunk)
common.flops_per_token("h4b16384", 32768, trunk, context=256)
```
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DATA = os.environ.get(
    "KERAS_MHF_DATA", os.path.join(os.path.dirname(ROOT), "shared", "data")
)
OPENSTAX = os.path.join(DATA, "openstax_edu_en")
MISTRAL = os.path.join(DATA, "mistral_v03_tokenizer", "tokenizer.model")


# --- processes --------------------------------------------------------------


def argument_parser(name, doc, **kwargs):
    """The `argparse.ArgumentParser` of `benchmarks.<name>`: its usage line
    names the command (`python -m benchmarks.NAME`) and its description is
    the first paragraph of `doc` (the module's docstring) unless `kwargs`
    give one."""
    kwargs.setdefault("description", doc.split("\n\n")[0])
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}", **kwargs
    )


def module_command(name, *args, python=None):
    """The command that runs `benchmarks.<name>` as a module (`python -m
    benchmarks.NAME ARGS`); run it with `cwd=ROOT` (`run_module` does).
    `python`: another interpreter (default: this one)."""
    return [python or sys.executable, "-m", f"benchmarks.{name}"] + [
        str(a) for a in args
    ]


def run_module(name, *args, python=None, **kwargs):
    """Runs `benchmarks.<name>` in a new process from the repository root
    (`subprocess.run`'s keyword arguments pass through) and returns the
    finished process."""
    return subprocess.run(
        module_command(name, *args, python=python), cwd=ROOT, **kwargs
    )


def keras_mhf_command(*args):
    """`keras-mhf ARGS` run by this Python (`python -m keras_mhf.cli.main`),
    so it needs no console script on PATH."""
    return [sys.executable, "-m", "keras_mhf.cli.main"] + [str(a) for a in args]


def print_result(result):
    """A worker's result: one `RESULT {json}` line on stdout."""
    print("RESULT " + json.dumps(result), flush=True)


def results_in(stdout):
    """The results (dicts) of the `RESULT` lines of a worker's stdout, in
    order (empty when it printed none)."""
    return [
        json.loads(line[len("RESULT ") :])
        for line in stdout.splitlines()
        if line.startswith("RESULT ")
    ]


# --- files and memory -------------------------------------------------------


def write_json(path, data, indent=2):
    """Writes `data` as JSON (and a final newline) to `path`, making its
    folder first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=indent)
        f.write("\n")


def peak_rss_bytes():
    """Peak resident memory of this process so far (`ru_maxrss`)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def children_peak_rss_bytes():
    """The largest peak resident memory among the child processes waited
    for so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def current_rss_bytes():
    """Resident memory of this process now (Linux: `/proc/self/statm`)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory_bytes():
    """Peak device memory of this process (JAX's device statistics, CUDA's
    under PyTorch); on a CPU, the peak resident memory."""
    import keras

    if keras.config.backend() == "jax":
        import jax

        stats = jax.local_devices()[0].memory_stats()
        if stats and "peak_bytes_in_use" in stats:
            return stats["peak_bytes_in_use"]
    if keras.config.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated()
    return peak_rss_bytes()


# --- data -------------------------------------------------------------------


def openstax_training_files():
    """The OpenStax training files (`train_*.jsonl`) under `OPENSTAX`."""
    return sorted(
        os.path.join(OPENSTAX, name)
        for name in os.listdir(OPENSTAX)
        if name.startswith("train_") and name.endswith(".jsonl")
    )


# The sentences of the tiny SentencePiece models (those of the tests'
# `tests/conftest.py::CORPUS`, which is `SENTENCES * 4`).
SENTENCES = [
    "The cell is the basic unit of life and every organism is made of cells.",
    "Energy is conserved in a closed system, so work and heat balance out.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "A market price rises when demand grows faster than supply.",
    "The mitochondria release energy that the cell uses to do work.",
    "Light travels faster than sound, which is why thunder comes later.",
    "Plants turn sunlight, water and carbon dioxide into sugar and oxygen.",
    "An atom has a nucleus of protons and neutrons with electrons around it.",
]


def small_sentencepiece(sentences=SENTENCES * 4, vocabulary_size=120):
    """The bytes of a BPE SentencePiece model trained here on `sentences`
    (no data files; the defaults give the tests' `small_proto_bytes`).
    Without byte fallback, unlike `keras_mhf.pretraining.train_sentencepiece`,
    whose 256 byte pieces would not fit a vocabulary this small."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocabulary_size,
        model_type="bpe",
        minloglevel=2,
    )
    return model.getvalue()


OPENSTAX_SAMPLE = os.path.join(
    ROOT, "tests", "testdata", "openstax_edu_en", "train_00.jsonl"
)


def benchmark_sentencepiece(vocabulary_size):
    """The bytes of the generation benchmarks' SentencePiece model
    (`small_sentencepiece`): trained on the repository's OpenStax sample
    (its paragraphs) for vocabularies above 120, else on `SENTENCES`."""
    if vocabulary_size <= 120:
        return small_sentencepiece(vocabulary_size=vocabulary_size)
    with open(OPENSTAX_SAMPLE, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    paragraphs = [p for t in texts for p in t.split("\n") if p.strip()]
    return small_sentencepiece(paragraphs, vocabulary_size)


# --- models -----------------------------------------------------------------


def synthetic_tokens(vocabulary_size):
    """`vocabulary_size` synthetic token strings
    (`keras_mhf.models.model_size.synthetic_tokens`)."""
    from keras_mhf.models.model_size import synthetic_tokens

    return synthetic_tokens(vocabulary_size)


def weight_bytes(model):
    """A model's weight bytes by part
    (`keras_mhf.models.model_size.weight_bytes`)."""
    from keras_mhf.models.model_size import weight_bytes

    return weight_bytes(model)


def synthetic_expansion(vocabulary, vocabulary_size):
    """New token strings that take a vocabulary to `vocabulary_size`
    entries (none of them a real piece)."""
    existing = set(vocabulary)
    count = vocabulary_size - len(vocabulary)
    tokens = [f"\u27e8synthetic{i}\u27e9" for i in range(count)]
    if existing.intersection(tokens):
        raise ValueError("Synthetic token strings clash with the vocabulary.")
    return tokens


def paper_trunk(name):
    """The trunk settings of a named architecture trunk (`"100m"`,
    `"1b"`, ...)."""
    from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
        TRUNKS,
    )

    return TRUNKS[name]


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


def synthetic_mhf(vocabulary_size, architecture, seed=0, **overrides):
    """A MultiHashFormerCausalLM of `architecture` on `vocabulary_size`
    synthetic tokens (pad id 2), built after `keras.utils.set_random_seed
    (seed)` (`seed=None`: not seeded); `overrides` go to `from_tokens`."""
    import keras

    from keras_mhf.models import MultiHashFormerCausalLM

    if seed is not None:
        keras.utils.set_random_seed(seed)
    return MultiHashFormerCausalLM.from_tokens(
        synthetic_tokens(vocabulary_size),
        architecture,
        pad_token_id=2,
        **overrides,
    )


def synthetic_standard(vocabulary_size, trunk, seed=0, **overrides):
    """The Standard baseline (KerasHub Qwen3, no preprocessor) of `trunk` (a
    trunk name; `overrides` go to `standard_backbone`) at
    `vocabulary_size`, built after `keras.utils.set_random_seed(seed)`
    (`seed=None`: not seeded)."""
    import keras

    from keras_mhf.models import StandardCausalLM
    from keras_mhf.models import standard_backbone

    if seed is not None:
        keras.utils.set_random_seed(seed)
    return StandardCausalLM(
        standard_backbone(vocabulary_size, trunk, **overrides), None
    )


def benchmark_model(config, vocabulary_size, trunk, seed=0):
    """`"standard"` or an `"h<H>b<B>"` MHF on `trunk` (`trunk_kwargs`),
    compiled with AdamW(1e-4) and the greedy sampler, no preprocessor."""
    import keras

    if config == "standard":
        model = synthetic_standard(vocabulary_size, "tiny", seed, **trunk)
    else:
        h, b = parse_config(config)
        model = synthetic_mhf(vocabulary_size, f"tiny_h{h}b{b}", seed, **trunk)
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


# --- inputs and speed -------------------------------------------------------


def random_batch(vocabulary_size, batch_size, sequence_length, seed=0):
    """A training batch `(x, y)` of random token ids in `[3, V)`: `x` the
    `token_ids` and an all-ones `padding_mask` (int32), `y` the next ids."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(
        3, vocabulary_size, (batch_size, sequence_length + 1)
    ).astype("int32")
    x = {
        "token_ids": ids[:, :-1],
        "padding_mask": np.ones((batch_size, sequence_length), "int32"),
    }
    return x, ids[:, 1:]


def generation_prompt(batch_size, prompt_length, new_tokens, tokens=None):
    """A `generate` input of `batch_size` rows: `tokens` (default: the ids
    3, 4, ...) in the first `prompt_length` places, room for `new_tokens`
    after them."""
    import numpy as np

    if tokens is None:
        tokens = np.arange(3, 3 + prompt_length)
    total = prompt_length + new_tokens
    prompt = {
        "token_ids": np.zeros((batch_size, total), "int32"),
        "padding_mask": np.zeros((batch_size, total), bool),
    }
    prompt["token_ids"][:, :prompt_length] = tokens
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

    prompt = generation_prompt(batch_size, prompt_length, new_tokens)
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

    import keras
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
