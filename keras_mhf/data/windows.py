"""Deterministic, resumable, multi-host token windows for `model.fit`.

Window `i` of a run (`i = global_step * batch_size + row`) holds
`sequence_length + 1` consecutive tokens of a split's token stream (all of
its shards, end to end; windows may cross document and shard boundaries). Its
start is drawn from `(seed, i)` alone: the `i`-th output of a SplitMix64
generator keyed by the seed, modulo the number of valid starts (uniform up to
a bias below `num_starts / 2**64`). The data of a step therefore depends only
on the seed and the step: a run resumed at step `s` reads exactly what an
uninterrupted run reads from step `s` on, and nothing before it. Process `p`
of `P` reads rows `[p * b, (p + 1) * b)` of every global batch,
`b = batch_size // P`. With gradient accumulation over `N` micro-batches,
micro-batch `j` of a step is rows `[j * b / N, (j + 1) * b / N)` of each
process's rows: the `N` micro-batches of a step are its batch.

Numpy only (arguments are checked with
`keras_mhf.utils.arguments.check_positive_ints`), except that
`window_dataset` imports `grain` to return a `grain.MapDataset`.

Example:

```python
from keras_mhf.data import PreparedCorpus, validation_windows, window_dataset

corpus = PreparedCorpus("prepared/openstax")
train = window_dataset(corpus, "train", sequence_length=128, batch_size=32,
                       seed=0, start_step=0, num_steps=1000)
causal_lm.fit(train, epochs=1)
held_out = validation_windows(corpus, sequence_length=128, count=64)
```
"""

import os

import numpy as np

from keras_mhf.data.packing import blocks_to_features
from keras_mhf.data.prepared_corpus import PreparedCorpus
from keras_mhf.utils.arguments import check_positive_ints

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _mix64(z):
    """SplitMix64's output function on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def window_starts(seed, indices, num_starts):
    """Starts of windows `indices` for a seed: int64 in `[0, num_starts)`.

    Window `i` starts at `splitmix64(key + (i + 1) * golden) % num_starts`,
    with `key = splitmix64(seed)`: counter-based, so any window can be drawn
    without drawing the ones before it.

    Args:
        seed: integer seed (taken modulo 2**64).
        indices: window indices (non-negative integers).
        num_starts: number of valid starts (`tokens - sequence_length`).

    Example:

    >>> window_starts(0, [0, 1, 2], 1000).shape
    (3,)
    """
    if num_starts < 1:
        raise ValueError(f"num_starts must be at least 1, got {num_starts}.")
    key = _mix64(np.array([int(seed) % (1 << 64)], np.uint64))
    indices = np.asarray(indices, np.int64)
    if indices.size and indices.min() < 0:
        raise ValueError("Window indices must be non-negative.")
    with np.errstate(over="ignore"):
        counters = key + (indices.astype(np.uint64) + np.uint64(1)) * _GOLDEN
    return (_mix64(counters) % np.uint64(num_starts)).astype(np.int64)


def _open(corpus):
    if isinstance(corpus, PreparedCorpus):
        return corpus
    if isinstance(corpus, (str, os.PathLike)):
        return PreparedCorpus(corpus)
    raise TypeError(
        "corpus must be a PreparedCorpus or its directory, got "
        f"{type(corpus).__name__}."
    )


def _positive_int(owner, name, value):
    """`value` as an int, after `check_positive_ints`."""
    check_positive_ints(owner, **{name: value})
    return int(value)


def _non_negative_int(owner, name, value):
    """`value` as an int, refusing anything but an int >= 0 (a step or a
    process index, where `check_positive_ints` is for counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{owner}: `{name}` must be an int; got {value!r}.")
    if value < 0:
        raise ValueError(f"{owner}: `{name}` must be >= 0; got {value}.")
    return int(value)


def _check_length(corpus, split, sequence_length):
    window = sequence_length + 1
    tokens = corpus.num_tokens(split)
    if tokens < window:
        raise ValueError(
            f"The {split} split of {corpus.directory} has {tokens} tokens, "
            f"fewer than one window of sequence_length + 1 = {window}; use a "
            "shorter sequence_length or prepare more data."
        )
    return tokens


class WindowSampler:
    """The batches of one process: `sampler(step)` is the local batch of
    global step `step` (see the module docstring for the rule).

    Args:
        corpus: a `PreparedCorpus` or its directory.
        split: `"train"` or `"validation"`.
        sequence_length: model sequence length `L` (windows hold `L + 1`).
        batch_size: global batch size (all processes together).
        seed: integer seed of the window order.
        process_index: this process, in `[0, process_count)`.
        process_count: number of processes that share each global batch.
        micro_batches: parts of each step (gradient accumulation); then
            `sampler(index)` is part `index % micro_batches` of step
            `index // micro_batches`.

    Example:

    ```python
    sampler = WindowSampler(corpus, "train", 128, 32, seed=0)
    x, y, sample_weight = sampler(step=10)
    ```
    """

    def __init__(
        self,
        corpus,
        split,
        sequence_length,
        batch_size,
        seed,
        process_index=0,
        process_count=1,
        micro_batches=1,
    ):
        self.corpus = _open(corpus)
        self.split = split
        check_positive_ints(
            "WindowSampler",
            sequence_length=sequence_length,
            batch_size=batch_size,
            process_count=process_count,
            micro_batches=micro_batches,
        )
        self.micro_batches = int(micro_batches)
        if batch_size % process_count:
            raise ValueError(
                f"batch_size={batch_size} does not divide by "
                f"process_count={process_count}; use a global batch size "
                "that is a multiple of the number of processes."
            )
        if batch_size % (process_count * micro_batches):
            raise ValueError(
                f"batch_size={batch_size} does not split into "
                f"process_count={process_count} x micro_batches="
                f"{micro_batches} equal parts; use a multiple of "
                f"{process_count * micro_batches}."
            )
        self.sequence_length = int(sequence_length)
        self.batch_size = int(batch_size)
        self.process_count = int(process_count)
        self.process_index = _non_negative_int(
            "WindowSampler", "process_index", process_index
        )
        if self.process_index >= self.process_count:
            raise ValueError(
                f"process_index must be in [0, {self.process_count}), got "
                f"{self.process_index}."
            )
        self.seed = int(seed)
        tokens = _check_length(self.corpus, split, self.sequence_length)
        self.num_starts = tokens - self.sequence_length
        self.local_batch_size = self.batch_size // self.process_count

    def window_indices(self, step):
        """Run-wide indices of this process's windows at global `step`."""
        first = (
            step * self.batch_size + self.process_index * self.local_batch_size
        )
        return first + np.arange(self.local_batch_size, dtype=np.int64)

    def starts(self, step):
        """Token offsets of this process's windows at global `step`."""
        return window_starts(
            self.seed, self.window_indices(step), self.num_starts
        )

    def windows(self, step):
        """int32 `[local_batch_size, sequence_length + 1]` at global `step`."""
        starts = self.starts(int(step))
        return self.corpus.windows(self.split, starts, self.sequence_length + 1)

    def __call__(self, index):
        if self.micro_batches == 1:
            return blocks_to_features(self.windows(index))
        step, part = divmod(int(index), self.micro_batches)
        size = self.local_batch_size // self.micro_batches
        starts = self.starts(step)[part * size : (part + 1) * size]
        return blocks_to_features(
            self.corpus.windows(self.split, starts, self.sequence_length + 1)
        )


def window_dataset(
    corpus,
    split,
    sequence_length,
    batch_size,
    seed,
    start_step=0,
    num_steps=None,
    process_index=0,
    process_count=1,
    micro_batches=1,
):
    """A `grain.MapDataset` of `num_steps` batches, from global `start_step`.

    Element `k` is `(x, y, sample_weight)` for global step `start_step + k`
    (with `micro_batches=N`: `num_steps * N` elements, element `k` being
    micro-batch `k % N` of step `start_step + k // N`):
    `x = {"token_ids": int32 [b, L], "padding_mask": int32 [b, L] (ones)}`,
    `y = int32 [b, L]` (the next tokens), `sample_weight = float32 [b, L]`
    (ones), with `b = batch_size // process_count`. Random access: resuming
    at step `s` is `window_dataset(..., start_step=s)`.

    Args:
        corpus: a `PreparedCorpus` or its directory.
        split: `"train"` or `"validation"`.
        sequence_length: model sequence length `L`.
        batch_size: global batch size (must divide by `process_count`).
        seed: integer seed of the window order.
        start_step: first global step.
        num_steps: number of steps (batches) in the dataset.
        process_index: this process, in `[0, process_count)`.
        process_count: processes sharing each global batch (multi-host).
        micro_batches: parts of each step, for gradient accumulation (the
            batch size must divide by `process_count * micro_batches`).

    Raises:
        ValueError: the split is shorter than one window, or bad arguments.

    Example:

    ```python
    dataset = window_dataset("prepared/openstax", "train", 128, 32, seed=0,
                             start_step=resumed_step, num_steps=500)
    causal_lm.fit(dataset, epochs=1)
    ```
    """
    try:
        import grain
    except ImportError as error:
        raise ImportError(
            "window_dataset needs grain (`pip install grain`); WindowSampler "
            "gives the same batches without it."
        ) from error

    sampler = WindowSampler(
        corpus,
        split,
        sequence_length,
        batch_size,
        seed,
        process_index,
        process_count,
        micro_batches,
    )
    start_step = _non_negative_int("window_dataset", "start_step", start_step)
    if num_steps is None:
        raise ValueError(
            "Pass num_steps, the number of batches the dataset holds."
        )
    num_steps = _positive_int("window_dataset", "num_steps", num_steps)
    parts = sampler.micro_batches
    return grain.MapDataset.range(
        start_step * parts, (start_step + num_steps) * parts
    ).map(sampler)


def validation_windows(corpus, sequence_length, count=None, split="validation"):
    """The first `count` non-overlapping windows of a split, in order.

    Window `k` is tokens `[k * (L + 1), (k + 1) * (L + 1))` of the split's
    stream: fixed and deterministic, for evaluation.

    Args:
        corpus: a `PreparedCorpus` or its directory.
        sequence_length: model sequence length `L`.
        count: number of windows (`None`: all that fit); fewer are returned
            when the split holds fewer.
        split: `"validation"` (default) or `"train"`.

    Returns:
        int32 array `[n, sequence_length + 1]`, `n = min(count, available)`.

    Example:

    ```python
    blocks = validation_windows(corpus, 128, count=64)
    perplexity(causal_lm, blocks, batch_size=8)
    ```
    """
    corpus = _open(corpus)
    sequence_length = _positive_int(
        "validation_windows", "sequence_length", sequence_length
    )
    tokens = _check_length(corpus, split, sequence_length)
    window = sequence_length + 1
    available = tokens // window
    count = (
        available
        if count is None
        else min(_positive_int("validation_windows", "count", count), available)
    )
    starts = np.arange(count, dtype=np.int64) * window
    return corpus.windows(split, starts, window)
