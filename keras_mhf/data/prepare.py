"""Tokenizes corpora once into flat token shards on disk (numpy +
sentencepiece).

`prepare_data` reads documents as a stream, tokenizes them with SentencePiece
in a pool of worker processes (each document prefixed with BOS, as
`pack_documents` does), splits them by document into a training and a
validation split, and appends each split's tokens to fixed-size shards
(`train_00000.bin`, `validation_00000.bin`, ...: raw little-endian `uint16`,
or `uint32` for vocabularies over 65,536 pieces). `index.json` is written
last; `PreparedCorpus` opens the result.

The output does not depend on the number of workers. A shard is written as
`NAME.partial` and renamed when full; `prepare_state.json` records, at
document boundaries, where the input stream stands and how far each shard in
progress is, so a killed run restarted with the same arguments continues
from there and ends with the same bytes as an uninterrupted run.

`keras_mhf.utils.hooks.event` fires `"shard_written"` after each shard's
rename, before it is checkpointed (tests stop a run there).

Example, for `data_dir` holding the shared `openstax_edu_en/` and
`mistral_v03_tokenizer/`:

```python
import os

from keras_mhf.data import prepare_data


def prepare_openstax(data_dir, output_dir):
    index = prepare_data(
        os.path.join(data_dir, "openstax_edu_en"),
        os.path.join(data_dir, "mistral_v03_tokenizer", "tokenizer.model"),
        output_dir,
    )
    return index["splits"]["train"]["tokens"]
```
"""

import collections
import datetime
import hashlib
import itertools
import multiprocessing
import os
import re
import signal
import sys
import time
import warnings

import numpy as np

from keras_mhf.data.documents import DEFAULT_TEXT_FIELD
from keras_mhf.data.documents import CorpusLineError
from keras_mhf.data.documents import DocumentReader
from keras_mhf.data.documents import ReadPosition
from keras_mhf.data.documents import list_corpus_files
from keras_mhf.data.prepared_corpus import FORMAT
from keras_mhf.data.prepared_corpus import FORMAT_VERSION
from keras_mhf.data.prepared_corpus import INDEX_FILE
from keras_mhf.data.prepared_corpus import SPLITS
from keras_mhf.data.prepared_corpus import STATE_FILE
from keras_mhf.data.prepared_corpus import read_index
from keras_mhf.utils import hooks
from keras_mhf.utils.arguments import check_positive_ints
from keras_mhf.utils.files import read_json
from keras_mhf.utils.files import write_json
from keras_mhf.utils.output_lock import LOCK_FILE
from keras_mhf.utils.output_lock import output_lock
from keras_mhf.utils.progress import Progress

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB per shard with uint16 tokens
CHUNK_TEXT_CHARS = 1 << 20  # text per tokenization task
CHUNK_DOCUMENTS = 4096  # documents per tokenization task, at most
CHECKPOINT_SECONDS = 10.0  # also checkpointed whenever a shard completes
VALIDATION_KEY = b"keras_mhf.validation"
VALIDATION_HASH = (
    "blake2b(UTF-8 text of the stripped document, digest_size=8, "
    "key=b'keras_mhf.validation'), read as a little-endian integer / 2**64"
)


def token_dtype(vocabulary_size):
    """`uint16` when every id fits (vocabulary of at most 65,536), else
    `uint32`.

    Example:

    >>> token_dtype(32768).name, token_dtype(65537).name
    ('uint16', 'uint32')
    """
    return np.dtype("<u2" if vocabulary_size <= 1 << 16 else "<u4")


def available_cores():
    """Cores this process may run on (its CPU affinity where the platform
    reports one, e.g. under a job scheduler; else `os.cpu_count()`).

    Example:

    >>> available_cores() >= 1
    True
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def validation_score(text):
    """The document's number in [0, 1) that decides its split: documents
    scoring below `validation_fraction` go to validation. It depends only on
    the text, so the split is the same for any order or number of workers.

    Example:

    >>> 0.0 <= validation_score("A document.") < 1.0
    True
    """
    digest = hashlib.blake2b(
        text.encode("utf-8"), digest_size=8, key=VALIDATION_KEY
    )
    return int.from_bytes(digest.digest(), "little") / 2.0**64


def _tokenize(sp, bos_id, dtype, fraction, texts, all_validation):
    """(flat tokens, per-document lengths, per-document is-validation)."""
    ids = sp.encode(texts, num_threads=1)
    lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
    starts = np.cumsum(lengths) - lengths
    tokens = np.empty(int(lengths.sum()), dtype)
    body = np.ones(tokens.size, bool)
    body[starts] = False
    tokens[starts] = bos_id
    tokens[body] = np.fromiter(
        itertools.chain.from_iterable(ids), dtype, tokens.size - len(ids)
    )
    if all_validation is None:
        flags = [validation_score(t) < fraction for t in texts]
        is_validation = np.array(flags, bool)
    else:
        is_validation = np.full(len(texts), all_validation, bool)
    return tokens, lengths, is_validation


_WORKER = None


def _init_worker(proto, bos_id, dtype, fraction):
    import sentencepiece as spm

    # A forked worker inherits the parent's handlers (e.g. the training
    # run's SIGTERM -> SystemExit): the pool's `terminate` must kill it, and
    # Ctrl-C is the parent's to handle.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    global _WORKER
    _WORKER = (
        spm.SentencePieceProcessor(model_proto=proto),
        bos_id,
        dtype,
        fraction,
    )


def _tokenize_in_worker(task):
    return _tokenize(*_WORKER, *task)


class _Done:
    """A result computed in this process (workers=1)."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class _ShardWriter:
    """Appends one split's tokens to fixed-size shards, resumably; fires
    `hooks.event("shard_written", path=..., split=...)` when a shard is
    complete."""

    def __init__(self, directory, split, dtype, shard_tokens, state):
        self.directory, self.split = directory, split
        self.dtype, self.shard_tokens = dtype, shard_tokens
        self.pattern = re.compile(rf"{split}_(\d+)\.bin(\.partial)?$")
        self.shards = list(state["shards"])
        self.tokens = state["pending_tokens"]
        self.documents = state["pending_documents"]
        self._restore()

    def _path(self, index):
        return os.path.join(self.directory, f"{self.split}_{index:05d}.bin")

    def _damaged(self, what):
        return ValueError(
            f"{self.directory} is inconsistent with its {STATE_FILE} ({what}); "
            "delete the directory and run prepare_data again."
        )

    def _restore(self):
        """Reopens the shard in progress at its checkpointed length and drops
        whatever was written after the checkpoint."""
        size = self.dtype.itemsize
        for shard in self.shards:
            path = os.path.join(self.directory, shard["file"])
            if (
                not os.path.isfile(path)
                or os.path.getsize(path) != shard["bytes"]
            ):
                raise self._damaged(
                    f"shard {path} is missing or has the wrong size"
                )
        index = len(self.shards)
        partial, final = self._path(index) + ".partial", self._path(index)
        if not os.path.exists(partial):
            if os.path.exists(final):  # renamed after the last checkpoint
                os.replace(final, partial)
            elif self.tokens == 0:
                open(partial, "wb").close()
            else:
                raise self._damaged(f"{partial} is missing")
        if os.path.getsize(partial) < self.tokens * size:
            raise self._damaged(f"{partial} is shorter than recorded")
        with open(partial, "r+b") as f:
            f.truncate(self.tokens * size)
        self.hash = hashlib.sha256()
        with open(partial, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                self.hash.update(block)
        for name in os.listdir(self.directory):
            match = self.pattern.match(name)
            if match and int(match.group(1)) > index:
                os.remove(os.path.join(self.directory, name))
        self.file = open(partial, "ab")

    def append(self, tokens, lengths):
        """Appends documents' tokens; `lengths` are their token counts."""
        starts = np.cumsum(lengths) - lengths
        position = 0
        while position < tokens.size:
            take = min(tokens.size - position, self.shard_tokens - self.tokens)
            data = tokens[position : position + take].tobytes()
            self.file.write(data)
            self.hash.update(data)
            first, last = np.searchsorted(starts, [position, position + take])
            self.documents += int(last - first)
            self.tokens += take
            position += take
            if self.tokens == self.shard_tokens:
                self._complete(reopen=True)

    def _complete(self, reopen):
        index = len(self.shards)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self._path(index) + ".partial", self._path(index))
        self.shards.append(
            {
                "file": os.path.basename(self._path(index)),
                "tokens": self.tokens,
                "documents": self.documents,
                "bytes": self.tokens * self.dtype.itemsize,
                "sha256": self.hash.hexdigest(),
            }
        )
        self.tokens, self.documents, self.hash = 0, 0, hashlib.sha256()
        if reopen:
            self.file = open(self._path(index + 1) + ".partial", "wb")
        hooks.event("shard_written", path=self._path(index), split=self.split)

    def state(self):
        self.file.flush()
        return {
            "shards": self.shards,
            "pending_tokens": self.tokens,
            "pending_documents": self.documents,
        }

    def finish(self):
        """Completes the last shard (or drops its empty file)."""
        if self.tokens:
            self._complete(reopen=False)
        else:
            self.file.close()
            os.remove(self._path(len(self.shards)) + ".partial")
        return {
            "tokens": sum(s["tokens"] for s in self.shards),
            "documents": sum(s["documents"] for s in self.shards),
            "shards": self.shards,
        }

    def close(self):
        if not self.file.closed:
            self.file.close()

    def remove_files(self):
        self.close()
        for name in os.listdir(self.directory):
            if self.pattern.match(name):
                os.remove(os.path.join(self.directory, name))


class _Progress(Progress):
    """prepare_data's progress line on stderr (bytes read, tokens,
    tokens/s, ETA), shown as often as `keras_mhf.utils.progress.Progress`
    shows its own (from the first update on), and one-line messages."""

    def __init__(self, enabled, total_bytes=0, start_bytes=0):
        super().__init__(
            "prepare_data",
            total_bytes,
            "bytes",
            enabled=bool(enabled),
            delay=0.0,
        )
        self.start_bytes, self.tokens = start_bytes, 0

    def update(self, done_bytes, tokens):
        """Records the bytes read and tokens written so far."""
        self.tokens = tokens
        super().update(done_bytes)

    def finish(self, done_bytes, tokens):
        """Shows the last line (always, when enabled)."""
        self.done, self.tokens = done_bytes, tokens
        if self.enabled:
            self._show(time.monotonic(), final=True)

    def _show(self, now, final=False):
        self.last, self.shown = now, True
        elapsed = max(now - self.started, 1e-9)
        rate = (self.done - self.start_bytes) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = (
            "--"
            if eta == float("inf")
            else f"{int(eta) // 60}m{int(eta) % 60:02d}s"
        )
        line = (
            f"prepare_data: {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
            f"({100 * self.done / self.total:.0f}%) | {self.tokens:,} tokens "
            f"| {self.tokens / elapsed:,.0f} tokens/s | ETA {eta}"
        )
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def message(self, text):
        if self.enabled:
            sys.stderr.write(text + "\n")


def _load_tokenizer(path):
    import sentencepiece as spm

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such tokenizer file: {path}")
    with open(path, "rb") as f:
        proto = f.read()
    try:
        sp = spm.SentencePieceProcessor(model_proto=proto)
    except (RuntimeError, OSError, TypeError) as error:
        raise ValueError(
            f"{path} is not a SentencePiece model ({error}); pass the "
            "tokenizer's .model file (e.g. "
            "mistral_v03_tokenizer/tokenizer.model)."
        ) from error
    if sp.bos_id() < 0:
        raise ValueError(
            f"The tokenizer {path} has no BOS piece (<s>); prepare_data puts "
            "it before every document. Use a model trained with a BOS piece."
        )
    return sp, proto


def _identity(record):
    """What must match for a run to continue or to be a no-op."""
    return {
        "format_version": record["format_version"],
        "tokenizer sha256": record["tokenizer"]["sha256"],
        "dtype": record["dtype"],
        "shard_tokens": record["shard_tokens"],
        "validation rule": record["validation"],
        "training inputs": record["sources"]["train"],
        "validation inputs": record["sources"]["validation"],
        # Corpora prepared before the field could be chosen read "text".
        "text field": record.get("text_field", DEFAULT_TEXT_FIELD),
    }


def _describe_change(key, old, new):
    if key == "tokenizer sha256":
        return f"tokenizer sha256 {str(old)[:12]}... -> {new[:12]}..."
    if key in ("training inputs", "validation inputs"):
        before = {f["path"]: f["bytes"] for f in old or []}
        after = {f["path"]: f["bytes"] for f in new}
        for path in after:
            if path not in before:
                return f"{key} differ: {path} is new"
            if before[path] != after[path]:
                return (
                    f"{key} differ: {path} had {before[path]} bytes, now "
                    f"{after[path]}"
                )
        for path in before:
            if path not in after:
                return f"{key} differ: {path} is no longer an input"
        return f"{key} differ: same files in another order"
    return f"{key}: {old!r} -> {new!r}"


def _check_same(directory, found, wanted, what, advice=None):
    old, new = _identity(found), _identity(wanted)
    changed = [key for key in new if old.get(key) != new[key]]
    if changed:
        details = "; ".join(
            _describe_change(k, old.get(k), new[k]) for k in changed
        )
        raise ValueError(
            f"{directory} holds {what} made with different settings "
            f"({details}). "
            + (
                advice
                or "Use another output directory, or delete this one to "
                "start again."
            )
        )


def _sources(files):
    return [
        {"path": os.path.abspath(f), "bytes": os.path.getsize(f)} for f in files
    ]


def _split_sizes_error(totals, fraction, validation_inputs, skipped):
    documents = totals["train"]["documents"] + totals["validation"]["documents"]
    skipped = f" ({skipped} bad lines skipped)" if skipped else ""
    if documents == 0:
        return ValueError(
            f"The inputs hold no documents{skipped}: every corpus file is "
            "empty or whitespace. Pass files with text."
        )
    plural = "document" if documents == 1 else "documents"
    if validation_inputs is not None:
        empty = (
            "training" if totals["train"]["documents"] == 0 else "validation"
        )
        return ValueError(
            f"The {empty} inputs hold no documents{skipped}; pass files with "
            "text."
        )
    if totals["train"]["documents"] == 0:
        return ValueError(
            f"The training split is empty: the corpus has {documents} {plural} "
            f"and validation_fraction={fraction} put all of them in the "
            "validation split; pass separate validation data (--validation "
            f"FILE to keras-mhf prepare, {_VALIDATION_DATA}) or use more "
            "documents."
        )
    return ValueError(
        f"The validation split is empty: the corpus has {documents} {plural} "
        f"and validation_fraction={fraction} held out none of them; pass "
        "separate validation data (--validation FILE to keras-mhf prepare, "
        f"{_VALIDATION_DATA}) or a larger --validation-fraction."
    )


# How `keras-mhf pretrain` and `finetune` (which prepare raw text through
# `prepare_data`) take separate validation text.
_VALIDATION_DATA = "--validation-data FILE to pretrain and finetune"


def prepare_data(
    inputs,
    tokenizer_path,
    output_dir,
    validation_fraction=0.005,
    validation_inputs=None,
    shard_tokens=DEFAULT_SHARD_TOKENS,
    workers=None,
    on_error="fail",
    progress=True,
    text_field=DEFAULT_TEXT_FIELD,
):
    """Tokenizes corpora into token shards plus `index.json` (see module doc).

    Args:
        inputs: corpus files, directories or glob patterns (`.txt`, `.jsonl`,
            `.jsonl.gz`, `.jsonl.zst`, `.txt.zst`, `.parquet`, `.arrow`,
            `datasets` save_to_disk folders; see `list_corpus_files`), or a
            list of them.
        tokenizer_path: SentencePiece `.model` file.
        output_dir: directory to write (created; must be new, empty, or an
            earlier run of this same preparation).
        validation_fraction: share of documents held out for validation,
            chosen by a keyed hash of each document's text
            (`validation_score`); ignored with `validation_inputs`.
        validation_inputs: separate validation corpus (then every document
            of `inputs` is for training).
        shard_tokens: tokens per shard file (the last one of a split may be
            shorter).
        workers: tokenizer processes (default: every core, see
            `available_cores`); the output is the same for any number.
        on_error: `"fail"` (default) or `"skip"` bad corpus lines (see
            `DocumentReader`).
        progress: report progress on stderr.
        text_field: the JSON field (`.jsonl*`) or Parquet/Arrow column that
            holds the text; recorded in the index, so a rerun with another
            one is refused.

    Returns:
        The index (the contents of `output_dir/index.json`).

    Raises:
        FileNotFoundError: an input or the tokenizer does not exist.
        ValueError: bad arguments, a tokenizer that is not a SentencePiece
            model, bad corpus lines (with `on_error="fail"`), an empty split,
            or an `output_dir` holding something else.

    Example:

    ```python
    prepare_data("corpus/", "tokenizer.model", "prepared/", workers=8)
    corpus = PreparedCorpus("prepared/")
    ```
    """
    options = _check_arguments(
        _Options(
            validation_fraction,
            validation_inputs,
            shard_tokens,
            workers,
            on_error,
            progress,
            text_field,
        )
    )
    job = _make_job(inputs, tokenizer_path, options)
    output_dir = os.fspath(output_dir)
    with output_lock(output_dir, "prepare_data"):
        return _prepare_locked(output_dir, job)


# The options of a `prepare_data` call (`workers` resolved by
# `_check_arguments`).
_Options = collections.namedtuple(
    "_Options",
    [
        "validation_fraction",
        "validation_inputs",
        "shard_tokens",
        "workers",
        "on_error",
        "progress",
        "text_field",
    ],
)

# What `prepare_data` was asked for: the tokenizer (`sp`, `proto`), the
# index header, the input files, and the options of the run.
_Job = collections.namedtuple(
    "_Job",
    ["sp", "proto", "header", "train_files", "validation_files", "options"],
)


def _check_arguments(options):
    """The checks of `prepare_data`'s arguments; returns `options` with the
    worker count resolved."""
    workers = options.workers
    if workers is None:
        workers = available_cores()
    try:
        check_positive_ints("prepare_data", workers=workers)
    except ValueError:
        raise ValueError(
            f"workers must be a positive number of processes, got {workers!r}; "
            f"pass --workers N with N >= 1, or leave it out to use every core "
            f"({available_cores()})."
        ) from None
    check_positive_ints("prepare_data", shard_tokens=options.shard_tokens)
    if options.on_error not in ("fail", "skip"):
        raise ValueError(
            f"on_error must be 'fail' or 'skip', got {options.on_error!r}."
        )
    if not isinstance(options.text_field, str) or not options.text_field:
        raise ValueError(
            "text_field (--text-field) must name a field or column, got "
            f"{options.text_field!r}."
        )
    fraction = options.validation_fraction
    if options.validation_inputs is None and not 0.0 < fraction < 1.0:
        raise ValueError(
            "validation_fraction must be between 0 and 1 (exclusive), got "
            f"{fraction!r}; or pass validation_inputs (--validation)."
        )
    return options._replace(workers=int(workers))


def _make_job(inputs, tokenizer_path, options):
    """The tokenizer, the input files and what defines the preparation
    (`index.json`'s header), before anything is written."""
    sp, proto = _load_tokenizer(tokenizer_path)
    train_files = list_corpus_files(inputs)
    validation_files = []
    if options.validation_inputs is not None:
        validation_files = list_corpus_files(options.validation_inputs)
        both = set(map(os.path.abspath, train_files)) & set(
            map(os.path.abspath, validation_files)
        )
        if both:
            raise ValueError(
                f"{sorted(both)[0]} is both a training and a validation input; "
                "a file can only be in one split."
            )
    if options.validation_inputs is None:
        rule = {"rule": "fraction", "fraction": options.validation_fraction}
        rule["hash"] = VALIDATION_HASH
    else:
        rule = {"rule": "inputs"}
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "complete": False,
        "tokenizer": {
            "sha256": hashlib.sha256(proto).hexdigest(),
            "vocabulary_size": sp.get_piece_size(),
            "bos_id": sp.bos_id(),
            "path": os.path.abspath(os.fspath(tokenizer_path)),
        },
        "dtype": token_dtype(sp.get_piece_size()).name,
        "shard_tokens": options.shard_tokens,
        "validation": rule,
        "sources": {
            "train": _sources(train_files),
            "validation": _sources(validation_files),
        },
        "on_error": options.on_error,
        "text_field": options.text_field,
    }
    return _Job(sp, proto, header, train_files, validation_files, options)


def _prepare_locked(output_dir, job):
    """`prepare_data` in `output_dir`, under its lock."""
    report = _Progress(job.options.progress)
    state_path = os.path.join(output_dir, STATE_FILE)
    if os.path.exists(os.path.join(output_dir, INDEX_FILE)):
        return _already_prepared(output_dir, job, state_path)
    state = _start_or_resume(output_dir, job, state_path, report)
    writers = {
        split: _ShardWriter(
            output_dir,
            split,
            np.dtype(job.header["dtype"]),
            job.header["shard_tokens"],
            state["splits"][split],
        )
        for split in SPLITS
    }
    try:
        totals = _tokenize_all(job, state, state_path, writers)
    except CorpusLineError as error:
        _record_bad_line_stop(state_path, error)
        raise
    finally:
        for writer in writers.values():
            writer.close()
    return _write_index(output_dir, job, state, state_path, writers, totals)


def _already_prepared(output_dir, job, state_path):
    """The index of a complete preparation of the same inputs."""
    index = read_index(output_dir)
    _check_same(output_dir, index, job.header, "a prepared corpus")
    if os.path.exists(state_path):
        os.remove(state_path)  # left over if killed right after the index
    sys.stderr.write(
        f"{output_dir} already holds this prepared corpus "
        f"({INDEX_FILE} is complete); nothing to do.\n"
    )
    return index


def _record_bad_line_stop(state_path, error):
    """Notes in the last checkpointed state that the run stopped on a bad
    line, so that a rerun on the corrected input may start afresh."""
    try:
        state = read_json(state_path)
    except (OSError, ValueError):
        return
    state["stopped_on_bad_line"] = str(error).split(". Fix or remove")[0]
    write_json(state_path, state)


def _run_files(output_dir):
    """The files an unfinished run wrote: its shards, whole and in progress
    (`*.partial`), of every split, and its state."""
    pattern = re.compile(rf"({'|'.join(SPLITS)})_\d+\.bin(\.partial)?$")
    names = [n for n in os.listdir(output_dir) if pattern.match(n)]
    return sorted(names) + [STATE_FILE]


def _unfinished_run_advice(output_dir, state):
    """What to delete to prepare other inputs in `output_dir`."""
    complete = sum(len(state["splits"][split]["shards"]) for split in SPLITS)
    stopped = state.get("stopped_on_bad_line")
    done = (
        f"It completed {complete} shard{'s' if complete != 1 else ''}, which "
        "a fresh start would drop. "
        if complete
        else ""
    )
    return (
        (f"It stopped at {stopped}. " if stopped else "")
        + done
        + "To prepare these inputs there from the start, delete "
        + f"{STATE_FILE}, "
        + " and ".join(f"{split}_*.bin*" for split in SPLITS)
        + f" in {output_dir} (or the whole directory), or use another "
        "output directory; to finish that run, rerun it with its own inputs "
        "and settings."
    )


def _start_afresh_after_bad_line(output_dir, state, report):
    """Removes an unfinished run whose inputs or settings changed, so that
    this run starts afresh, when it stopped on a bad line (which the user
    has since fixed) before any shard was complete: nothing finished is
    lost. Returns whether it did."""
    complete = any(state["splits"][split]["shards"] for split in SPLITS)
    stopped = state.get("stopped_on_bad_line")
    if not stopped or complete:
        return False
    for name in _run_files(output_dir):
        os.remove(os.path.join(output_dir, name))
    report.message(
        f"prepare_data: the unfinished run in {output_dir} stopped at "
        f"{stopped} before any shard was complete, and its inputs have "
        "changed since; starting afresh."
    )
    return True


def _start_or_resume(output_dir, job, state_path, report):
    """The checkpointed state of an unfinished run of the same inputs, or a
    new one (written) for an empty directory. An unfinished run with other
    inputs or settings is refused, unless it stopped on a bad line before
    completing a shard: then the corrected input starts afresh."""
    if os.path.exists(state_path):
        state = read_json(state_path)
        try:
            _check_same(
                output_dir,
                state,
                job.header,
                "an unfinished prepare_data run",
                _unfinished_run_advice(output_dir, state),
            )
        except ValueError:
            if not _start_afresh_after_bad_line(output_dir, state, report):
                raise
        else:
            state.pop("stopped_on_bad_line", None)
            state["on_error"] = job.options.on_error
            report.message(
                f"prepare_data: resuming the unfinished run in {output_dir}."
            )
            return state
    if set(os.listdir(output_dir)) - {LOCK_FILE}:
        raise ValueError(
            f"{output_dir} is not empty and holds no prepare_data run; "
            "choose a new or empty output directory."
        )
    empty = {"shards": [], "pending_tokens": 0, "pending_documents": 0}
    state = dict(job.header)
    state["position"] = {"source": 0, "read": list(ReadPosition())}
    state["skipped_before_source"] = 0
    state["empty_before_source"] = 0
    state["splits"] = {split: dict(empty) for split in SPLITS}
    write_json(state_path, state)
    return state


def _write_index(output_dir, job, state, state_path, writers, totals):
    """Writes `index.json` (last) for a complete run, or removes the run's
    files and raises when a split came out empty."""
    skipped = state["skipped_before_source"]
    empty = state.get("empty_before_source", 0)
    if not all(totals[split]["documents"] for split in SPLITS):
        error = _split_sizes_error(
            totals,
            job.options.validation_fraction,
            job.options.validation_inputs,
            skipped,
        )
        for writer in writers.values():
            writer.remove_files()
        os.remove(state_path)
        # The lock's release removes the directory if it created it and
        # nothing else is left in it.
        raise error
    index = dict(job.header)
    index["complete"] = True
    index["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"
    )
    index["skipped_lines"] = skipped
    index["empty_documents"] = empty
    index["splits"] = totals
    write_json(os.path.join(output_dir, INDEX_FILE), index)
    os.remove(state_path)
    _Progress(job.options.progress).message(
        f"prepare_data: wrote {totals['train']['tokens']:,} training and "
        f"{totals['validation']['tokens']:,} validation tokens to {output_dir}"
        + (f" ({skipped} bad lines skipped)" if skipped else "")
        + (f" ({empty} empty texts left out)" if empty else "")
        + "."
    )
    return index


def _tokenize_all(job, state, state_path, writers):
    """Tokenizes from the checkpointed position to the end; returns the
    split totals. Updates `state` and checkpoints it to `state_path`."""
    return _Tokenization(job, state, state_path, writers).run()


def _start_pool(job, dtype):
    """The worker processes of a run with `workers > 1`.

    fork: workers start at once and do not re-import keras_mhf (whose
    package imports Keras). They only run SentencePiece, numpy and hashlib,
    never JAX, so JAX's warning that forking a process that uses it may
    deadlock (in the child, if it used JAX) does not apply.
    """
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"os\.fork\(\) was called",
            category=RuntimeWarning,
        )
        return context.Pool(
            job.options.workers,
            initializer=_init_worker,
            initargs=(
                job.proto,
                job.sp.bos_id(),
                dtype,
                job.options.validation_fraction,
            ),
        )


class _Tokenization:
    """One tokenization pass of `prepare_data`, from the checkpointed
    position (`state["position"]`) to the end of the inputs: reads chunks of
    documents, tokenizes them (in worker processes when `workers > 1`),
    appends them to the split writers in input order, and checkpoints
    `state` whenever a shard completes or `CHECKPOINT_SECONDS` passed."""

    def __init__(self, job, state, state_path, writers):
        self.job, self.state, self.state_path = job, state, state_path
        self.writers = writers
        self.sources = [job.train_files]
        if job.validation_files:
            self.sources.append(job.validation_files)
        # Per source: None (the split follows each document's score) or
        # whether every document is for validation.
        self.all_validation = [None if not job.validation_files else False]
        self.all_validation.append(True)
        self.sizes = [
            sum(os.path.getsize(f) for f in files) for files in self.sources
        ]
        self.position = state["position"]
        total = sum(self.sizes)
        self.report = _Progress(
            job.options.progress, total, min(self._start_bytes(), total)
        )
        self.tokens_done = 0
        self.last_checkpoint = time.monotonic()
        self.completed_before = self._completed()

    def _start_bytes(self):
        """Input bytes before the checkpointed position."""
        source = self.position["source"]
        done = sum(self.sizes[:source])
        if source < len(self.sources):
            reader = DocumentReader(
                self.sources[source],
                start=ReadPosition(*self.position["read"]),
                text_field=self.job.options.text_field,
            )
            done += reader.start_bytes()
        return done

    def _completed(self):
        return [len(w.shards) for w in self.writers.values()]

    def _chunks(self):
        """(source, texts, end position, bytes read); texts=None marks the
        end of a source (`end` is then its counts of skipped lines and of
        empty texts)."""
        position = self.position
        for source in range(position["source"], len(self.sources)):
            start = None
            if source == position["source"]:
                start = ReadPosition(*position["read"])
            reader = DocumentReader(
                self.sources[source],
                on_error=self.job.options.on_error,
                start=start,
                text_field=self.job.options.text_field,
            )
            before = sum(self.sizes[:source])
            texts, chars, end = [], 0, None
            for document in reader:
                texts.append(document.text)
                chars += len(document.text)
                end = document.end
                if chars >= CHUNK_TEXT_CHARS or len(texts) >= CHUNK_DOCUMENTS:
                    yield source, texts, end, before + reader.bytes_read
                    texts, chars = [], 0
            if texts:
                yield source, texts, end, before + reader.bytes_read
            counts = (reader.skipped, reader.empty)
            yield source, None, counts, before + self.sizes[source]

    def _submit(self, pool, source, texts):
        """The (pending) tokenization of a chunk: `.get()` gives `_tokenize`'s
        result."""
        if texts is None:
            return None
        if pool is None:
            sp = self.job.sp
            return _Done(
                _tokenize(
                    sp,
                    sp.bos_id(),
                    self.writers["train"].dtype,
                    self.job.options.validation_fraction,
                    texts,
                    self.all_validation[source],
                )
            )
        task = (texts, self.all_validation[source])
        return pool.apply_async(_tokenize_in_worker, (task,))

    def _consume(self, source, texts, end, done_bytes, result):
        """Appends a tokenized chunk (or ends a source), then checkpoints
        when due and reports progress."""
        position = self.position
        if texts is None:  # the end of a source
            self.state["skipped_before_source"] += end[0]
            self.state["empty_before_source"] = (
                self.state.get("empty_before_source", 0) + end[1]
            )
            position["source"] = source + 1
            position["read"] = list(ReadPosition())
        else:
            tokens, lengths, is_validation = result.get()
            mask = np.repeat(is_validation, lengths)
            train, validation = (
                self.writers["train"],
                self.writers["validation"],
            )
            train.append(tokens[~mask], lengths[~is_validation])
            validation.append(tokens[mask], lengths[is_validation])
            self.tokens_done += tokens.size
            position["source"], position["read"] = source, list(end)
        completed = self._completed()
        now = time.monotonic()
        if (
            completed != self.completed_before
            or now - self.last_checkpoint >= CHECKPOINT_SECONDS
        ):
            self.state["splits"] = {
                split: self.writers[split].state() for split in SPLITS
            }
            write_json(self.state_path, self.state)
            self.last_checkpoint, self.completed_before = now, completed
        self.report.update(done_bytes, self.tokens_done)

    def run(self):
        """Tokenizes to the end; returns the split totals."""
        workers = self.job.options.workers
        pool = None
        if workers > 1:
            pool = _start_pool(self.job, self.writers["train"].dtype)
        try:
            in_flight = collections.deque()
            for source, texts, end, done_bytes in self._chunks():
                result = self._submit(pool, source, texts)
                in_flight.append((source, texts, end, done_bytes, result))
                while len(in_flight) > 2 * workers:
                    self._consume(*in_flight.popleft())
            while in_flight:
                self._consume(*in_flight.popleft())
        except BaseException:
            if pool is not None:
                pool.terminate()
                pool.join()
            raise
        if pool is not None:
            # Every result is in: the workers exit on their own. `terminate`
            # here hung now and then (a worker the pool had just forked was
            # never signalled and `join` waited on it forever).
            pool.close()
            pool.join()
        totals = {split: self.writers[split].finish() for split in SPLITS}
        self.report.finish(sum(self.sizes), self.tokens_done)
        return totals
