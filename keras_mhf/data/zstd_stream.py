"""A `.zst` file as a stream of its decompressed bytes (`zstandard`).

`ZstdStream` decompresses frame after frame (files written by `zstd -T0`,
`pzstd` or concatenated are several frames) and, unlike `zstandard`'s own
`stream_reader`, raises `EOFError` when the file ends inside a frame, as
`gzip` does for a cut-short `.gz`: a truncated file is never read as a
shorter one. Wrap it in `io.BufferedReader` to read lines.

Example:

```python
import io

from keras_mhf.data.zstd_stream import ZstdStream

with open("corpus.jsonl.zst", "rb") as raw:
    for line in io.BufferedReader(ZstdStream(raw)):
        ...
```
"""

import io

# Compressed bytes read from the file at a time.
READ_BYTES = 1 << 17


class ZstdStream(io.RawIOBase):
    """The decompressed bytes of a zstandard file object (read-only, not
    seekable; `raw.tell()` is how much of the compressed file was read).

    Args:
        raw: a binary file object of the compressed data.

    Raises (from `read`/`readinto`):
        EOFError: the data ends inside a frame (the file is cut short).
        zstandard.ZstdError: the data is damaged.

    Example:

    ```python
    import io

    import zstandard

    data = zstandard.ZstdCompressor().compress(b"one\\ntwo\\n")
    stream = io.BufferedReader(ZstdStream(io.BytesIO(data)))
    assert stream.readlines() == [b"one\\n", b"two\\n"]
    ```
    """

    def __init__(self, raw):
        import zstandard

        super().__init__()
        self._raw = raw
        self._context = zstandard.ZstdDecompressor()
        self._frame = None  # the decompressor of the frame in progress
        self._pending = b""
        self._used = 0  # bytes of `_pending` already handed out

    def readable(self):
        return True

    def _fill(self):
        """Decompresses more; False at the clean end of the data."""
        while self._used >= len(self._pending):
            chunk = self._raw.read(READ_BYTES)
            if not chunk:
                if self._frame is not None:
                    raise EOFError(
                        "the zstandard data ends inside a frame (the file "
                        "is cut short)"
                    )
                return False
            out = []
            while chunk:
                if self._frame is None:
                    self._frame = self._context.decompressobj()
                out.append(self._frame.decompress(chunk))
                if self._frame.eof:
                    chunk, self._frame = self._frame.unused_data, None
                else:
                    chunk = b""
            self._pending, self._used = b"".join(out), 0
        return True

    def readinto(self, buffer):
        if not self._fill():
            return 0
        view = memoryview(buffer).cast("B")
        count = min(len(view), len(self._pending) - self._used)
        view[:count] = self._pending[self._used : self._used + count]
        self._used += count
        return count

    def close(self):
        self._pending = b""
        super().close()
