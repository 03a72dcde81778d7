"""The text column of a Parquet or Arrow file, read in record batches
(pyarrow).

`TextColumn` opens a `.parquet` file (e.g. FineWeb-Edu, FineWeb2,
smollm-corpus: a `text` column among `id`, `url`, `score`, ...) or a `.arrow`
file (Arrow IPC stream, as `datasets`' `save_to_disk` writes, or IPC file),
checks that it has the column and that the column holds strings, and hands
out its values batch by batch from any row: Parquet reads only that column,
and starts at the row group that holds the row. Memory holds one record
batch at a time, whatever the size of the file. A file that is damaged or
cut short raises `ValueError` naming it, never reads as a shorter file.

`keras_mhf.data.DocumentReader` is the entry point that reads corpora; this
is the part of it that speaks Arrow.

Example:

```python
from keras_mhf.data.arrow_documents import TextColumn

with TextColumn("train-00000-of-00099.parquet", "text") as column:
    for first_row, values in column.batches(start_row=0):
        print(first_row, len(values), column.tell(), "of", column.size)
```
"""

import os

# Rows per record batch: about 1 MB of FineWeb-Edu text per 256 rows.
BATCH_ROWS = 1024
# The end-of-stream marker that closes an Arrow IPC stream.
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_FILE_MAGIC = b"ARROW1"
# Columns named in an error, at most.
_SHOWN_COLUMNS = 20


def _is_text(data_type):
    import pyarrow as pa

    if pa.types.is_dictionary(data_type):
        data_type = data_type.value_type
    return (
        pa.types.is_string(data_type)
        or pa.types.is_large_string(data_type)
        or pa.types.is_string_view(data_type)
    )


class TextColumn:
    """One text column of a `.parquet` or `.arrow` file.

    Args:
        path: the file.
        field: the column that holds the documents' text.
        batch_rows: rows per batch handed out.

    Attributes:
        path, field: as given.
        size: the file's size in bytes.
        rows: the file's row count (Parquet; for Arrow, `None` until the
            file has been read to its end).

    Raises:
        ValueError: the file is damaged or cut short, has no column
            `field` (the message lists its columns), or `field` does not
            hold strings.

    Example:

    ```python
    with TextColumn("data-00000-of-00002.arrow", "text") as column:
        texts = [t for _, values in column.batches() for t in values]
    ```
    """

    def __init__(self, path, field, batch_rows=BATCH_ROWS):
        import pyarrow as pa

        self.path, self.field, self.batch_rows = (
            os.fspath(path),
            field,
            batch_rows,
        )
        self.size = os.path.getsize(self.path)
        self.rows = None
        self._rows_done = self._batches_done = 0
        self._file = pa.OSFile(self.path)
        try:
            self._open()
        except BaseException:
            self._file.close()
            raise

    def _damaged(self, error):
        kind = "Parquet" if self.path.endswith(".parquet") else "Arrow"
        return ValueError(
            f"{self.path}: the {kind} file is damaged or cut short ({error}); "
            "download or write it again."
        )

    def _open(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._parquet = self._ipc_file = None
        try:
            if self.path.endswith(".parquet"):
                self._parquet = pq.ParquetFile(self._file)
                schema = self._parquet.schema_arrow
                self.rows = self._parquet.metadata.num_rows
            elif self._file.read(len(_FILE_MAGIC)) == _FILE_MAGIC:
                self._file.seek(0)
                self._ipc_file = pa.ipc.open_file(self._file)
                schema = self._ipc_file.schema
            else:
                self._file.seek(0)
                schema = pa.ipc.open_stream(self._file).schema
        except (pa.ArrowException, OSError) as error:
            raise self._damaged(error) from error
        self._check(schema)

    def _check(self, schema):
        names = schema.names
        if self.field not in names:
            shown = ", ".join(map(repr, names[:_SHOWN_COLUMNS]))
            more = ", ..." if len(names) > _SHOWN_COLUMNS else ""
            raise ValueError(
                f"{self.path} has no column {self.field!r} (its columns: "
                f"{shown or 'none'}{more}); pass the one that holds the "
                "text with --text-field (text_field=...)."
            )
        self._index = names.index(self.field)
        data_type = schema.field(self._index).type
        if not _is_text(data_type):
            raise ValueError(
                f"{self.path}: the column {self.field!r} holds {data_type}, "
                "not text (strings); pass the column that holds the text "
                "with --text-field (text_field=...)."
            )

    def tell(self):
        """Bytes of the file read so far: the file's size in proportion
        to the rows read (Parquet) or to the record batches read (Arrow IPC
        file), or the position in the file (Arrow stream)."""
        if self._parquet is not None:
            return self.size * self._rows_done // max(self.rows, 1)
        if self._ipc_file is not None:
            batches = max(self._ipc_file.num_record_batches, 1)
            return self.size * self._batches_done // batches
        return self._file.tell() if not self._file.closed else self.size

    @property
    def closed(self):
        return self._file.closed

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def batches(self, start_row=0):
        """Yields `(first row, list of values)` from row `start_row`
        (0-based) to the end; a value is a `str`, or `None` for a null."""
        import pyarrow as pa

        if self._parquet is not None:
            source = self._parquet_batches(start_row)
        elif self._ipc_file is not None:
            source = (
                self._ipc_file.get_batch(i)
                for i in range(self._ipc_file.num_record_batches)
            )
        else:
            source = self._stream_batches()
        row, index = 0, self._index
        if self._parquet is not None:  # only the text column is read
            row, index = self._first_row, 0
        while True:
            try:
                batch = next(source, None)
                if batch is None:
                    break
                values = batch.column(index)
            except (pa.ArrowException, OSError) as error:
                raise self._damaged(error) from error
            end = row + len(values)
            self._rows_done = end
            self._batches_done += 1
            if end > start_row:
                skip = max(start_row - row, 0)
                if skip:
                    values = values.slice(skip)
                yield row + skip, values.to_pylist()
            row = end
        if self._parquet is None:
            self.rows = row

    def _parquet_batches(self, start_row):
        """The record batches of the text column from the row group that
        holds `start_row` (`_first_row`: that group's first row)."""
        metadata = self._parquet.metadata
        first, group = 0, 0
        while group < metadata.num_row_groups:
            rows = metadata.row_group(group).num_rows
            if first + rows > start_row:
                break
            first += rows
            group += 1
        self._first_row = first
        if group >= metadata.num_row_groups:
            return iter(())
        return self._parquet.iter_batches(
            batch_size=self.batch_rows,
            row_groups=list(range(group, metadata.num_row_groups)),
            columns=[self.field],
            use_threads=False,
        )

    def _stream_batches(self):
        """The record batches of an Arrow IPC stream; one that ends
        without its end-of-stream marker was cut short."""
        import pyarrow as pa

        self._file.seek(0)
        yield from pa.ipc.open_stream(self._file)
        end = self._file.tell()
        self._file.seek(max(end - len(_END_OF_STREAM), 0))
        if self._file.read(len(_END_OF_STREAM)) != _END_OF_STREAM:
            raise OSError(
                f"the stream ends at byte {end} without its end-of-stream "
                "marker"
            )
