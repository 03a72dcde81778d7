"""Opens a directory written by `prepare_data` and reads its tokens (numpy
only).

A prepared directory holds flat token-id shards (`train_00000.bin`, ...,
`validation_00000.bin`, ...: raw little-endian `uint16` or `uint32`) and an
`index.json` written last. `PreparedCorpus` refuses a directory without a
complete index of a known format version, checks that every shard has exactly
its recorded size, memory-maps shards only when they are read, and treats the
shards of a split as one logical token stream.

Example:

```python
from keras_mhf.data import PreparedCorpus

corpus = PreparedCorpus("prepared/openstax")
corpus.check_tokenizer("tokenizer.model")
print(corpus.num_tokens("train"), corpus.dtype)
first = corpus.read("train", 0, 17)  # int32, may cross shard boundaries
```
"""

import hashlib
import os
import time

import numpy as np

from keras_mhf.utils.files import check_format
from keras_mhf.utils.files import file_sha256
from keras_mhf.utils.files import read_json

FORMAT = "keras_mhf.prepared_corpus"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
STATE_FILE = "prepare_state.json"
SPLITS = ("train", "validation")
TOKEN_DTYPES = ("uint16", "uint32")


def tokenizer_file_sha256(path_or_bytes):
    """sha256 hex digest of a tokenizer model file or of its bytes: which
    file the corpus was prepared with (not how it tokenizes, see
    the models' `tokenization_fingerprint`).

    Args:
        path_or_bytes: path of a SentencePiece `.model` file, or its bytes.

    Example:

    >>> tokenizer_file_sha256(b"")[:16]
    'e3b0c44298fc1c14'
    """
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        return hashlib.sha256(path_or_bytes).hexdigest()
    path = os.fspath(path_or_bytes)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such tokenizer file: {path}")
    return file_sha256(path)


def _sha256_of(tokenizer):
    """The tokenizer file's sha256 of a path, bytes, a KerasHub SentencePiece tokenizer
    (`.proto`) or a `sentencepiece.SentencePieceProcessor`."""
    if isinstance(tokenizer, (str, os.PathLike, bytes, bytearray, memoryview)):
        return tokenizer_file_sha256(tokenizer)
    proto = getattr(tokenizer, "proto", None)
    if isinstance(proto, (str, os.PathLike, bytes, bytearray)):
        return tokenizer_file_sha256(proto)
    if hasattr(tokenizer, "serialized_model_proto"):
        return tokenizer_file_sha256(tokenizer.serialized_model_proto())
    raise TypeError(
        "check_tokenizer expects a tokenizer .model path, its bytes, a "
        "KerasHub SentencePiece tokenizer or a "
        "sentencepiece.SentencePieceProcessor, got "
        f"{type(tokenizer).__name__}."
    )


def read_index(directory):
    """Loads and checks `index.json` of a prepared directory.

    Raises:
        FileNotFoundError: the directory does not exist.
        ValueError: no index (or only an unfinished run), an unreadable
            index, an unknown format version, or an incomplete index.

    Example:

    ```python
    index = read_index("prepared/openstax")
    index["splits"]["train"]["tokens"]
    ```
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"No such prepared corpus directory: {directory}"
        )
    path = os.path.join(directory, INDEX_FILE)
    if not os.path.exists(path):
        if os.path.exists(os.path.join(directory, STATE_FILE)):
            raise ValueError(
                f"{directory} holds an unfinished prepare_data run "
                f"({STATE_FILE}, no {INDEX_FILE}): re-run "
                "keras-mhf prepare with the same arguments to finish it."
            )
        raise ValueError(
            f"{directory} has no {INDEX_FILE}, so it is not a prepared corpus; "
            "create one with keras-mhf prepare."
        )
    try:
        index = read_json(path)
    except ValueError as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}); re-run keras-mhf prepare "
            "into a new directory."
        ) from error
    check_format(
        index,
        FORMAT,
        FORMAT_VERSION,
        lambda: ValueError(f"{path} is not a keras_mhf prepared-corpus index."),
        lambda found: ValueError(
            f"{path} has format version {found!r}; this keras_mhf reads "
            f"version {FORMAT_VERSION}. Re-run keras-mhf prepare with "
            "this version of keras_mhf."
        ),
    )
    if index.get("complete") is not True:
        raise ValueError(
            f"{path} is not marked complete; re-run keras-mhf prepare with "
            "the same arguments to finish it."
        )
    if index.get("dtype") not in TOKEN_DTYPES:
        raise ValueError(
            f"{path} has an unknown token dtype {index.get('dtype')!r}."
        )
    return index


class PreparedCorpus:
    """A prepared corpus directory: verified index, lazily mapped shards.

    Args:
        directory: a directory written by `prepare_data`.

    Raises:
        ValueError: no complete index of a known version, or a shard that
            is missing or does not have its recorded size.

    Example:

    ```python
    corpus = PreparedCorpus("prepared/openstax")
    windows = corpus.windows("train", np.array([0, 1000]), 129)  # [2, 129]
    ```
    """

    def __init__(self, directory):
        self.directory = os.fspath(directory)
        self.index = read_index(self.directory)
        self.dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        self._shards = {}
        self._offsets = {}
        for split in SPLITS:
            shards = self.index["splits"][split]["shards"]
            for shard in shards:
                path = os.path.join(self.directory, shard["file"])
                expected = shard["tokens"] * self.dtype.itemsize
                if not os.path.isfile(path):
                    raise ValueError(
                        f"Shard {path} is missing; re-run "
                        "keras-mhf prepare into a new directory."
                    )
                size = os.path.getsize(path)
                if size != expected:
                    raise ValueError(
                        f"Shard {path} has {size} bytes, expected {expected} "
                        f"({shard['tokens']} {self.dtype.name} tokens): it is "
                        "truncated or damaged. Re-run keras-mhf prepare "
                        "into a new directory."
                    )
            self._shards[split] = shards
            self._offsets[split] = np.cumsum(
                [0] + [s["tokens"] for s in shards]
            )
        self._maps = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"] = {}  # memory maps are reopened after unpickling
        return state

    def __repr__(self):
        sizes = ", ".join(f"{s}={self.num_tokens(s):,}" for s in SPLITS)
        return f"PreparedCorpus({self.directory!r}, tokens: {sizes})"

    @property
    def vocabulary_size(self):
        """Vocabulary size of the tokenizer the corpus was prepared with."""
        return self.index["tokenizer"]["vocabulary_size"]

    @property
    def bos_id(self):
        """The id put before every document."""
        return self.index["tokenizer"]["bos_id"]

    @property
    def tokenizer_sha256(self):
        """sha256 hex digest of the tokenizer model file used."""
        return self.index["tokenizer"]["sha256"]

    def _check_split(self, split):
        if split not in SPLITS:
            raise ValueError(
                f"split must be 'train' or 'validation', got {split!r}."
            )

    def num_tokens(self, split):
        """Tokens in a split (`"train"` or `"validation"`)."""
        self._check_split(split)
        return int(self._offsets[split][-1])

    def num_documents(self, split):
        """Documents in a split."""
        self._check_split(split)
        return int(self.index["splits"][split]["documents"])

    def shard_paths(self, split):
        """Paths of a split's shard files, in stream order."""
        self._check_split(split)
        return [
            os.path.join(self.directory, s["file"]) for s in self._shards[split]
        ]

    def _map(self, split, shard):
        key = (split, shard)
        if key not in self._maps:
            info = self._shards[split][shard]
            self._maps[key] = np.memmap(
                os.path.join(self.directory, info["file"]),
                dtype=self.dtype,
                mode="r",
                shape=(info["tokens"],),
            )
        return self._maps[key]

    def read(self, split, start, length):
        """int32 tokens `[start, start + length)` of a split's stream.

        Example:

        ```python
        corpus.read("validation", 0, 5)  # e.g. array([1, 415, 2290, ...])
        ```
        """
        self._check_split(split)
        total = self.num_tokens(split)
        if start < 0 or length < 0 or start + length > total:
            raise ValueError(
                f"Tokens [{start}, {start + length}) are outside the {split} "
                f"split, which has {total} tokens."
            )
        offsets = self._offsets[split]
        out = np.empty(length, np.int32)
        done, first = 0, start
        shard = int(np.searchsorted(offsets, start, side="right")) - 1
        while done < length:
            local = start + done - int(offsets[shard])
            take = min(
                length - done, int(offsets[shard + 1] - offsets[shard]) - local
            )
            out[done : done + take] = self._map(split, shard)[
                local : local + take
            ]
            done += take
            shard += 1
        self._check_window_ids(split, out[None], np.array([first]))
        return out

    def windows(self, split, starts, length):
        """int32 `[len(starts), length]`: the windows of `length` tokens that
        begin at `starts` in a split's stream (crossing shard boundaries
        where needed).

        Example:

        ```python
        corpus.windows("train", np.array([0, 7]), 4)  # shape (2, 4)
        ```
        """
        self._check_split(split)
        starts = np.asarray(starts, np.int64).reshape(-1)
        total = self.num_tokens(split)
        if starts.size and (starts.min() < 0 or starts.max() + length > total):
            raise ValueError(
                f"Windows of {length} tokens at starts in [{starts.min()}, "
                f"{starts.max()}] do not fit in the {split} split ({total} "
                "tokens)."
            )
        out = np.empty((starts.size, length), np.int32)
        offsets = self._offsets[split]
        shard_of = np.searchsorted(offsets, starts, side="right") - 1
        for shard in np.unique(shard_of):
            rows = np.flatnonzero(shard_of == shard)
            local = starts[rows] - offsets[shard]
            inside = local + length <= offsets[shard + 1] - offsets[shard]
            if inside.any():
                tokens = self._map(split, int(shard))
                view = np.lib.stride_tricks.sliding_window_view(tokens, length)
                out[rows[inside]] = view[local[inside]]
            for row in rows[~inside]:
                out[row] = self.read(split, int(starts[row]), length)
        self._check_window_ids(split, out, starts)
        return out

    def check_tokenizer(self, tokenizer):
        """Raises if `tokenizer` is not the one the corpus was prepared with.

        Args:
            tokenizer: a `.model` path, its bytes, a KerasHub SentencePiece
                tokenizer (e.g. `MultiHashFormerTokenizer`) or a
                `sentencepiece.SentencePieceProcessor`.

        Example:

        ```python
        corpus.check_tokenizer(causal_lm.preprocessor.tokenizer)
        ```
        """
        found = _sha256_of(tokenizer)
        if found != self.tokenizer_sha256:
            raise ValueError(
                f"{self.directory} was prepared with tokenizer sha256 "
                f"{self.tokenizer_sha256[:16]}..., the model's tokenizer "
                f"is {found[:16]}...; re-run keras-mhf prepare with the "
                "model's tokenizer."
            )

    def verify_checksums(self):
        """Re-hashes every shard and checks its token ids, streaming (the
        constructor only checks sizes); raises naming the first damaged
        shard.

        Returns:
            dict: `shards`, `bytes` and `seconds` (the time it took).

        Raises:
            ValueError: a shard whose sha256 differs from `index.json`, or
                that holds a token id outside the tokenizer's vocabulary
                (named with its token offset).

        Example:

        ```python
        PreparedCorpus("prepared/openstax").verify_checksums()["bytes"]
        ```
        """
        started = time.perf_counter()
        count = total = 0
        block = (1 << 20) // self.dtype.itemsize * self.dtype.itemsize
        for split in SPLITS:
            for shard, path in zip(
                self._shards[split], self.shard_paths(split)
            ):
                digest = hashlib.sha256()
                offset = 0
                with open(path, "rb") as f:
                    for data in iter(lambda: f.read(block), b""):
                        digest.update(data)
                        ids = np.frombuffer(data, self.dtype)
                        self._check_ids(ids, path, offset)
                        offset += ids.size
                        total += len(data)
                if digest.hexdigest() != shard["sha256"]:
                    raise ValueError(
                        f"Shard {path} does not match its sha256 in "
                        f"{INDEX_FILE}: it is damaged. Re-run "
                        "keras-mhf prepare into a new directory."
                    )
                count += 1
        return {
            "shards": count,
            "bytes": total,
            "seconds": time.perf_counter() - started,
        }

    def _check_ids(self, ids, path, offset):
        """Raises if a token id of `ids` (tokens `offset...` of the shard
        `path`) is outside the tokenizer's vocabulary."""
        if ids.size and int(ids.max()) >= self.vocabulary_size:
            where = int(np.argmax(ids >= self.vocabulary_size))
            raise ValueError(
                f"Shard {path} holds token id {int(ids[where])} at token "
                f"offset {offset + where} (byte "
                f"{(offset + where) * self.dtype.itemsize}), outside the "
                f"tokenizer's vocabulary [0, {self.vocabulary_size - 1}]: the "
                "shard is damaged. Re-run keras-mhf prepare into a new "
                "directory."
            )

    def _check_window_ids(self, split, out, starts):
        """Names the shard and offset of an out-of-vocabulary id in windows
        `out` that start at stream offsets `starts`."""
        if not out.size or int(out.max()) < self.vocabulary_size:
            return
        row, column = np.argwhere(out >= self.vocabulary_size)[0]
        position = int(starts[row]) + int(column)
        offsets = self._offsets[split]
        shard = int(np.searchsorted(offsets, position, side="right")) - 1
        local = position - int(offsets[shard])
        path = self.shard_paths(split)[shard]
        self._check_ids(
            np.asarray(self._map(split, shard)[local : local + 1]),
            path,
            local,
        )
