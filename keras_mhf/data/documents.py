"""Streams documents from text corpora as they are published (numpy-free;
pyarrow for Parquet and Arrow, zstandard for `.zst`, imported when needed).

Corpus files are:

- `.txt` and `.txt.zst`: blank-line separated documents, or one document per
  line when the start of the file has no blank line;
- `.jsonl`, `.jsonl.gz` and `.jsonl.zst`: one JSON object per line, the text
  in its `"text"` field (`text_field` picks another);
- `.parquet` (FineWeb-Edu, FineWeb2, smollm-corpus, ...) and `.arrow`: one
  document per row, the text in the `text` column (`text_field` picks
  another); only that column is read, one record batch at a time;
- folders written by Hugging Face `datasets`' `save_to_disk`: their Arrow
  files in the dataset's order (`keras_mhf.data.saved_datasets`; a
  `DatasetDict` folder must hold one split, or be named as FOLDER/SPLIT).
  Reading them needs pyarrow only, not `datasets`.

Inputs are files, directories (read recursively, in sorted order, corpus
files only) and glob patterns, or a list of them. Files are streamed (lines,
or record batches), so memory does not grow with the corpus, and every
document carries the position just after it, from which a reader can resume
(`DocumentReader(..., start=position)`).

Example:

```python
from keras_mhf.data import DocumentReader

reader = DocumentReader(
    ["books/", "extra/*.jsonl.zst", "fineweb-edu/sample/10BT/*.parquet"],
    on_error="skip",
)
for document in reader:
    print(reader.files[document.file_index], document.line, document.text[:40])
print(reader.skipped, "bad lines skipped,", reader.empty, "empty texts")
```
"""

import gzip
import io
import json
import os
import warnings
import zlib
from glob import glob
from typing import NamedTuple

from keras_mhf.data.saved_datasets import dataset_files

CORPUS_EXTENSIONS = (
    ".txt",
    ".jsonl",
    ".jsonl.gz",
    ".jsonl.zst",
    ".txt.zst",
    ".parquet",
    ".arrow",
)
# One document per row, the text in a column (`keras_mhf.data.arrow_documents`).
TABLE_EXTENSIONS = (".parquet", ".arrow")
JSONL_EXTENSIONS = (".jsonl", ".jsonl.gz", ".jsonl.zst")
DEFAULT_TEXT_FIELD = "text"
# A `.txt` file holds blank-line separated documents when this first part of
# it (after leading whitespace) contains an empty line, else one per line.
TXT_HEAD_BYTES = 1 << 20
# With on_error="skip", each of the first bad lines gets its own warning.
WARN_LINES = 20
_ON_ERROR = ("fail", "skip")
_BOM = b"\xef\xbb\xbf"


def _lone_surrogate(text):
    """The first lone surrogate of `text` as its escape (`\\ud800`), or
    `None` when the text encodes as UTF-8."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return ascii(text[error.start])[1:-1]
    return None


class CorpusWarning(UserWarning):
    """A bad corpus line skipped with `on_error="skip"`."""


class CorpusLineError(ValueError):
    """A bad corpus line (or Parquet/Arrow row) that stopped a reader with
    `on_error="fail"`; its message names it (`file:line`)."""


class ReadPosition(NamedTuple):
    """Where a `DocumentReader` stands between two documents.

    Attributes:
        file_index: index into `DocumentReader.files` of the file to read next.
        offset: byte offset in that file (in the uncompressed stream for
            `.gz` and `.zst`); for Parquet and Arrow, the 0-based row.
        line: 1-based line number at `offset` (Parquet, Arrow: the row + 1).
        skipped: bad lines (or rows) skipped before this position
            (`on_error="skip"`).
        empty: empty or whitespace texts (`.jsonl` records, Parquet and
            Arrow rows) left out before this position.
    """

    file_index: int = 0
    offset: int = 0
    line: int = 1
    skipped: int = 0
    empty: int = 0


class Document(NamedTuple):
    """One document with its place in the corpus.

    Attributes:
        text: the stripped document text (never empty).
        file_index: index into `DocumentReader.files`.
        line: 1-based line where the document starts in that file (for
            Parquet and Arrow, its 1-based row).
        end: the `ReadPosition` just after the document; a reader started
            there yields the documents that follow this one.
    """

    text: str
    file_index: int
    line: int
    end: ReadPosition


def is_corpus_file(path):
    """Whether `path` has a corpus extension (`CORPUS_EXTENSIONS`: `.txt`,
    `.jsonl`, `.jsonl.gz`, `.jsonl.zst`, `.txt.zst`, `.parquet`, `.arrow`).

    Example:

    >>> is_corpus_file("train_00.jsonl"), is_corpus_file("manifest.json")
    (True, False)
    """
    return os.fspath(path).endswith(CORPUS_EXTENSIONS)


def _extensions():
    return ", ".join(CORPUS_EXTENSIONS)


def _walk(directory):
    """Corpus files under `directory`, recursively; files of a directory come
    before those of its subdirectories, each level in sorted order. A
    `datasets` save_to_disk folder contributes its Arrow files in the
    dataset's order, and nothing else under it."""
    found, datasets = [], []
    for root, _, names in sorted(os.walk(directory)):
        if any(root.startswith(d + os.sep) for d in datasets):
            continue
        files = dataset_files(root)
        if files is not None:
            found += files
            datasets.append(root)
            continue
        found += [
            os.path.join(root, n) for n in sorted(names) if is_corpus_file(n)
        ]
    return found


def list_corpus_files(inputs):
    """Resolves inputs to the ordered list of corpus files they name.

    Args:
        inputs: a path or glob pattern, or a list of them. A directory (or a
            directory matched by a pattern) contributes the corpus files under
            it, recursively, and skips every other file (`manifest.json`,
            licenses, ...). A pattern contributes the corpus files it matches.
            A file named explicitly must be a corpus file. A folder written
            by `datasets`' `save_to_disk` contributes its Arrow files in the
            dataset's order (a `DatasetDict` folder: its one split; with
            several, name one as FOLDER/SPLIT).

    Returns:
        List of file paths, in input order (sorted within a directory or a
        pattern).

    Raises:
        FileNotFoundError: a path does not exist or a pattern matches nothing.
        ValueError: a named file is not a corpus file, a directory or
            pattern holds no corpus file, or a `DatasetDict` folder has
            several splits.

    Example:

    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> for name in ("b.txt", "a.jsonl", "manifest.json"):
    ...     open(os.path.join(root, name), "w").close()
    >>> [os.path.basename(path) for path in list_corpus_files(root)]
    ['a.jsonl', 'b.txt']
    """
    if isinstance(inputs, (str, bytes, os.PathLike)):
        inputs = [inputs]
    inputs = [os.fsdecode(item) for item in inputs]
    if not inputs:
        raise ValueError(
            "No corpus inputs given: pass at least one file or directory."
        )
    files = []
    for item in inputs:
        if any(c in item for c in "*?["):
            matches = sorted(glob(item, recursive=True))
            if not matches:
                raise FileNotFoundError(
                    f"The pattern {item!r} matches no files."
                )
            found = []
            for match in matches:
                if os.path.isdir(match):
                    found += _walk(match)
                elif is_corpus_file(match):
                    found.append(match)
            if not found:
                raise ValueError(
                    f"The pattern {item!r} matches no corpus files (files "
                    f"ending in {_extensions()})."
                )
        elif os.path.isdir(item):
            found = _walk(item)
            if not found:
                raise ValueError(
                    f"No corpus files (ending in {_extensions()}) under {item}."
                )
        elif os.path.exists(item):
            if not is_corpus_file(item):
                raise ValueError(
                    f"{item} is not a corpus file: corpus files end in "
                    f"{_extensions()}. Rename it, or pass its directory to "
                    "read only the corpus files in it."
                )
            found = [item]
        else:
            raise FileNotFoundError(f"No such corpus file or directory: {item}")
        files += found
    return files


def _open_binary(path):
    """(line source, raw file) for a corpus file; the raw file's position
    tells how many bytes of the file on disk were read."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if path.endswith(".zst"):
        from keras_mhf.data.zstd_stream import ZstdStream

        return io.BufferedReader(ZstdStream(raw), 1 << 20), raw
    return raw, raw


def _skip_forward(stream, offset):
    """Moves a stream to `offset`: `seek` where it can, else by reading
    (what `gzip`'s seek does too)."""
    if stream.seekable():
        stream.seek(offset)
        return
    while offset > 0:
        data = stream.read(min(offset, 1 << 20))
        if not data:
            return
        offset -= len(data)


def _compression_errors():
    """What a cut-short or damaged `.gz` / `.zst` raises while it is read."""
    import zstandard

    return (EOFError, OSError, zlib.error, zstandard.ZstdError)


def _blank_line_separated(path):
    """The `.txt` rule: blank-line separated documents when the first
    `TXT_HEAD_BYTES` of the file, without its leading whitespace (and without
    its trailing whitespace when the whole file fits), contain an empty line;
    otherwise one document per line. For files up to `TXT_HEAD_BYTES` this is
    exactly `"\\n\\n" in text.strip()` on the whole text."""
    stream, raw = _open_binary(path)
    parts, size = [], 0
    with raw, stream:
        try:
            while size <= TXT_HEAD_BYTES:
                part = stream.read(min(1 << 16, TXT_HEAD_BYTES + 1 - size))
                if not part:
                    break
                parts.append(part)
                size += len(part)
        except _compression_errors():
            pass  # reading the file names the line where it breaks
    head = b"".join(parts)
    text = (
        head[:TXT_HEAD_BYTES].decode("utf-8", "replace").replace("\r\n", "\n")
    )
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.strip() if len(head) <= TXT_HEAD_BYTES else text.lstrip()
    return "\n\n" in text


class DocumentReader:
    """Streams the documents of corpus files, with their positions.

    `.txt` / `.txt.zst` files hold documents separated by empty lines; a
    file whose first `TXT_HEAD_BYTES` (1 MiB) have no empty line between
    text holds one document per line. `.jsonl` / `.jsonl.gz` / `.jsonl.zst`
    files hold one JSON object with a string `text_field` per line; blank
    lines are ignored. `.parquet` and `.arrow` files (and `datasets`
    save_to_disk folders) hold one document per row, in their `text_field`
    column. Documents are stripped; empty ones are left out, and those of
    `.jsonl` records and of rows are counted in `empty`. A UTF-8 byte-order
    mark at the start of a file is ignored; lines end with `\\n` or
    `\\r\\n`.

    A bad line or row (not UTF-8, invalid JSON, not an object, no
    `text_field`, a text that is null or not a string) raises a
    `ValueError` naming `file:line` (`file row N`) with `on_error="fail"`;
    with `on_error="skip"` it is skipped (in a blank-line separated `.txt`
    file, with the document it belongs to), counted in `skipped` and
    reported with a `CorpusWarning` (the first `WARN_LINES` one by one, then
    a count at the end). A `.gz` or `.zst` file cut short or damaged is a
    bad line where it breaks (with "skip", the rest of it is left out). A
    Parquet or Arrow file without the column, with a column that does not
    hold strings, or damaged or cut short is a `ValueError` whatever
    `on_error` says: skipping it would silently shorten the corpus.

    Args:
        inputs: files, directories or glob patterns (see `list_corpus_files`).
        on_error: `"fail"` (default) or `"skip"`.
        start: a `ReadPosition` (e.g. a document's `end`) to resume from.
        text_field: the JSON field (`.jsonl*`) or the column (Parquet,
            Arrow) that holds the text; `.txt` files have none.

    Example:

    ```python
    reader = DocumentReader("corpus/")
    first = next(iter(reader))
    rest = DocumentReader("corpus/", start=first.end)  # the documents after it
    rows = DocumentReader("dump/*.parquet", text_field="content")
    ```
    """

    def __init__(
        self, inputs, on_error="fail", start=None, text_field=DEFAULT_TEXT_FIELD
    ):
        if on_error not in _ON_ERROR:
            raise ValueError(
                f"on_error must be 'fail' or 'skip', got {on_error!r}."
            )
        if not isinstance(text_field, str) or not text_field:
            raise ValueError(
                "text_field (--text-field) must name a field or column, got "
                f"{text_field!r}."
            )
        self.files = list_corpus_files(inputs)
        self.on_error = on_error
        self.text_field = text_field
        self.start = (
            ReadPosition(*start) if start is not None else ReadPosition()
        )
        if not 0 <= self.start.file_index <= len(self.files):
            raise ValueError(
                f"start={tuple(self.start)} points past the {len(self.files)} "
                "corpus files."
            )
        self.file_sizes = [os.path.getsize(f) for f in self.files]
        self.total_bytes = sum(self.file_sizes)
        self._reset()

    def _reset(self):
        self.skipped = self.start.skipped
        self.empty = self.start.empty
        self._done_bytes = sum(self.file_sizes[: self.start.file_index])
        self._raw = None

    @property
    def bytes_read(self):
        """Bytes of the files on disk read so far (compressed for `.gz` and
        `.zst`; for Parquet, the file's size in proportion to its rows
        read)."""
        position = self._raw.tell() if self._raw and not self._raw.closed else 0
        return self._done_bytes + position

    def start_bytes(self):
        """About how many bytes of the files on disk come before `start`
        (for progress reports): the files before it, and the offset in its
        file (for Parquet, the file's size in proportion to the rows before
        it; for Arrow, not counted)."""
        file_index, offset = self.start.file_index, self.start.offset
        done = sum(self.file_sizes[:file_index])
        if file_index >= len(self.files) or not offset:
            return done
        path, size = self.files[file_index], self.file_sizes[file_index]
        if path.endswith(".parquet"):
            from keras_mhf.data.arrow_documents import TextColumn

            try:
                with TextColumn(path, self.text_field) as column:
                    return done + size * offset // max(column.rows, 1)
            except ValueError:
                return done  # the reader will say what is wrong
        if path.endswith(".arrow"):
            return done
        return done + min(offset, size)

    def _bad(self, path, number, problem, what=None, unit="line"):
        where = f"{path}:{number}" if unit == "line" else f"{path} row {number}"
        if self.on_error == "fail":
            raise CorpusLineError(
                f"{where}: {problem}. Fix or remove the {unit}, or pass "
                f"on_error='skip' (--on-error skip) to skip bad {unit}s."
            )
        what = what or f"the {unit}"
        self.skipped += 1
        if self.skipped <= WARN_LINES:
            more = (
                " Further bad lines are counted, not shown one by one."
                if self.skipped == WARN_LINES
                else ""
            )
            warnings.warn(
                f"{where}: {problem}; skipped {what}.{more}",
                CorpusWarning,
                stacklevel=3,
            )

    def __iter__(self):
        self._reset()
        start = self.start
        for file_index in range(start.file_index, len(self.files)):
            path = self.files[file_index]
            if file_index == start.file_index:
                offset, line = start.offset, start.line
            else:
                offset, line = 0, 1
            if path.endswith(TABLE_EXTENSIONS):
                documents = self._rows(path, file_index, offset)
            elif path.endswith(JSONL_EXTENSIONS):
                documents = self._jsonl(path, file_index, offset, line)
            elif _blank_line_separated(path):
                documents = self._blocks(path, file_index, offset, line)
            else:
                documents = self._lines(path, file_index, offset, line)
            yield from documents
            self._done_bytes += self.file_sizes[file_index]
            self._raw = None
        if self.skipped > WARN_LINES:
            warnings.warn(
                f"Skipped {self.skipped} bad lines in all (only the first "
                f"{WARN_LINES} were reported one by one).",
                CorpusWarning,
                stacklevel=2,
            )

    def _numbered_lines(self, path, offset, line):
        """Yields (line number, decoded line or None if not UTF-8, error,
        offset after the line) from `offset`, which is at line `line`."""
        stream, raw = _open_binary(path)
        self._raw = raw
        with raw, stream:
            if offset:
                _skip_forward(stream, offset)
            for data in self._compressed_lines(stream, path, line):
                if offset == 0 and data.startswith(_BOM):
                    data = data[len(_BOM) :]
                    offset += len(_BOM)
                offset += len(data)
                if data.endswith(b"\n"):
                    data = data[:-1]
                if data.endswith(b"\r"):
                    data = data[:-1]
                try:
                    text, error = data.decode("utf-8"), None
                except UnicodeDecodeError as e:
                    text, error = None, e
                yield line, text, error, offset
                line += 1

    def _compressed_lines(self, stream, path, line):
        """The raw lines of `stream`; a `.gz` or `.zst` file that ends
        early or is damaged goes to `_bad` at the line where it breaks (with
        "skip", the rest of that file is left out)."""
        errors = _compression_errors()
        lines = iter(stream)
        while True:
            try:
                data = next(lines)
            except StopIteration:
                return
            except errors as error:
                self._bad(
                    path,
                    line,
                    f"the compressed file is cut short or damaged ({error})",
                    what="the rest of the file",
                )
                return
            yield data
            line += 1

    def _decoded_lines(self, path, offset, line):
        """`(line number, text, end offset)` of `_numbered_lines`, without
        the lines that are not valid UTF-8 (each one goes to `_bad`)."""
        for number, text, error, end in self._numbered_lines(
            path, offset, line
        ):
            if error is not None:
                self._bad(path, number, f"not valid UTF-8 ({error})")
                continue
            yield number, text, end

    def _jsonl(self, path, file_index, offset, line):
        field = self.text_field
        for number, text, end in self._decoded_lines(path, offset, line):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except ValueError as e:
                self._bad(path, number, f"invalid JSON ({e})")
                continue
            if not isinstance(record, dict):
                kind = type(record).__name__
                self._bad(path, number, f"expected a JSON object, got a {kind}")
                continue
            if field not in record:
                keys = ", ".join(map(repr, list(record)[:5])) or "none"
                self._bad(
                    path,
                    number,
                    f"no {field!r} field (its fields: {keys}; --text-field "
                    "names the one that holds the text)",
                )
                continue
            value = record[field]
            if not isinstance(value, str):
                kind = "null" if value is None else f"a {type(value).__name__}"
                self._bad(path, number, f"{field!r} is {kind}, not a string")
                continue
            surrogate = _lone_surrogate(value)
            if surrogate is not None:
                # JSON's "\ud800" escape decodes to a str that no tokenizer
                # (nor UTF-8) takes.
                self._bad(
                    path,
                    number,
                    f"{field!r} holds a lone surrogate ({surrogate}), which "
                    "is not valid Unicode text",
                )
                continue
            document = self._document(value, file_index, number, end, number)
            if document is not None:
                yield document
            else:
                self.empty += 1

    def _rows(self, path, file_index, row):
        """The documents of a Parquet or Arrow file from its 0-based `row`;
        a null is a bad row, an empty text is counted in `empty`."""
        from keras_mhf.data.arrow_documents import TextColumn

        column = TextColumn(path, self.text_field)
        self._raw = column
        null = f"{self.text_field!r} is null, not a string"
        with column:
            for first, values in column.batches(row):
                for number, value in enumerate(values, first + 1):
                    if value is None:
                        self._bad(path, number, null, unit="row")
                        continue
                    text = value.strip()
                    if not text:
                        self.empty += 1
                        continue
                    yield Document(
                        text,
                        file_index,
                        number,
                        ReadPosition(
                            file_index,
                            number,
                            number + 1,
                            self.skipped,
                            self.empty,
                        ),
                    )

    def _lines(self, path, file_index, offset, line):
        for number, text, end in self._decoded_lines(path, offset, line):
            document = self._document(text, file_index, number, end, number)
            if document is not None:
                yield document

    def _blocks(self, path, file_index, offset, line):
        block, first, bad = [], None, False
        end, number = offset, line - 1
        for number, text, error, end in self._numbered_lines(
            path, offset, line
        ):
            if error is not None:
                self._bad(
                    path,
                    number,
                    f"not valid UTF-8 ({error})",
                    what="the document that holds it",
                )
                bad = True
            elif text == "":
                if not bad and (
                    document := self._document(
                        "\n".join(block), file_index, first, end, number
                    )
                ):
                    yield document
                block, first, bad = [], None, False
                continue
            if first is None:
                first = number
            if text is not None:
                block.append(text)
        if not bad and (
            document := self._document(
                "\n".join(block), file_index, first, end, number
            )
        ):
            yield document

    def _document(self, text, file_index, line, end, last_line):
        """The `Document` of `text`, stripped, that starts on `line` and
        ends before byte `end`, on `last_line`; `None` for whitespace."""
        text = text.strip()
        if not text:
            return None
        position = self._position(file_index, end, last_line)
        return Document(text, file_index, line, position)

    def _position(self, file_index, offset, number):
        return ReadPosition(
            file_index, offset, number + 1, self.skipped, self.empty
        )


def read_documents(
    path, limit=None, on_error="fail", text_field=DEFAULT_TEXT_FIELD
):
    """Yields the document strings of corpus files.

    Args:
        path: a file, directory or glob pattern, or a list of them (see
            `list_corpus_files`): `.txt`, `.jsonl`, `.parquet`, `datasets`
            save_to_disk folders, ... (see `DocumentReader`).
        limit: stop after this many documents (`None` or 0: all).
        on_error: `"fail"` (default) raises on a bad line with its
            `file:line`; `"skip"` skips it with a warning.
        text_field: the JSON field or Parquet/Arrow column of the text.

    Example:

    ```python
    documents = list(read_documents("corpus.jsonl", limit=100))
    rows = list(read_documents("train-00000.parquet", text_field="text"))
    ```
    """
    reader = DocumentReader(path, on_error=on_error, text_field=text_field)
    for count, document in enumerate(reader, 1):
        yield document.text
        if limit and count >= limit:
            return
