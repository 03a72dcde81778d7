"""Durable file reads and writes (no Keras): sha256 of a file, fsync, and
atomic replacement, so that a crash leaves either the old or the new content
of a file, never a partial one. Used by the data preparation, the
pre-training run and the exporters.

Example:

```python
import os
import tempfile

from keras_mhf.utils.files import file_sha256, read_json, write_json

path = os.path.join(tempfile.mkdtemp(), "state.json")
write_json(path, {"step": 3})
read_json(path)  # {"step": 3}
file_sha256(path)[:8]
```
"""

import hashlib
import json
import os


def absolute_path(path):
    """A path a user gave (`str` or `os.PathLike`, `~` allowed) as an
    absolute `str`, resolved once against the current directory at the
    API's entry, so that a relative path means the same wherever it is used
    later (Orbax, for one, refuses relative paths). `None`, `""` and values
    that are not paths (e.g. `"auto"` settings) are the caller's to keep.

    Example:

    >>> absolute_path("/runs/../runs/mhf")
    '/runs/mhf'
    """
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def absolute_paths(value):
    """`absolute_path` of a path or of each path of a list or tuple (e.g. a
    corpus given as several files or glob patterns); `None` and empty
    values are returned unchanged.

    Example:

    >>> absolute_paths(["/a/./b.txt", "/c/*.jsonl"])
    ['/a/b.txt', '/c/*.jsonl']
    """
    if isinstance(value, (list, tuple)):
        return [absolute_paths(v) for v in value]
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return absolute_path(value)
    return value


def resolved_path(path):
    """A path with `~`, `..` and every symbolic link resolved (its existing
    part; the rest is kept as written), to compare two paths."""
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def path_overlap(output, source):
    """How writing `output` would reach `source`, after resolving both
    (`resolved_path`): `"is"`, `"lies inside"`, `"contains"`, or `None`
    when they are apart.

    Example:

    >>> path_overlap("/runs/mhf/preset/hf", "/runs/mhf/preset")
    'lies inside'
    >>> path_overlap("/runs/hf", "/runs/mhf/preset") is None
    True
    """
    output, source = resolved_path(output), resolved_path(source)
    if output == source:
        return "is"
    common = os.path.commonpath([output, source])
    if common == source:
        return "lies inside"
    if common == output:
        return "contains"
    return None


def output_overlap_problem(output, source, output_name, source_name):
    """The one-line refusal of an `output` that is, contains or lies inside
    the input `source` a command reads (writing it, and `--overwrite`
    above all, would change or delete that input), or `None` when they are
    apart. `output_name` and `source_name` name them as the user gave them
    (e.g. `"--output"`, `"--preset"`).

    Example:

    >>> output_overlap_problem("/p", "/p", "--output", "--preset")[:34]
    '--output /p is --preset /p: writin'
    """
    how = path_overlap(output, source)
    if how is None:
        return None
    return (
        f"{output_name} {os.fspath(output)} {how} {source_name} "
        f"{os.fspath(source)}: writing it would change or destroy the input "
        f"it is made from, so nothing was written; choose an "
        f"{output_name} that neither is, holds nor lies inside "
        f"{os.fspath(source)}."
    )


def file_sha256(path):
    """The sha256 hex digest of a file, read in 1 MiB blocks.

    Example:

    ```python
    file_sha256("runs/mhf/checkpoints/step_000300/model.weights.h5")
    ```
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_file(path):
    """Flushes a written file's content to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_directory(path):
    """Flushes a directory entry (a rename) to disk where the platform
    allows opening directories."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def write_atomically(path, data):
    """Writes bytes to `path` through a flushed temporary file and a
    rename, so `path` holds either its old or its new content; a write
    that fails (a full disk) removes its temporary file.

    Example:

    ```python
    write_atomically("runs/mhf/summary.json", b"{}")
    ```
    """
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        # A full disk (or an interrupt) leaves the old content and no
        # temporary file behind.
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise


def write_json(path, data, indent=1):
    """Writes `data` as UTF-8 JSON to `path` with `write_atomically`.

    Example:

    ```python
    write_json("runs/mhf/summary.json", {"status": "finished"}, indent=2)
    ```
    """
    write_atomically(path, json.dumps(data, indent=indent).encode("utf-8"))


def read_json(path):
    """The JSON value stored in the UTF-8 file `path`.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not valid JSON (`json.JSONDecodeError`).
    """
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check_format(record, name, version, not_this_format, other_version):
    """Checks a JSON record (`read_json`'s value) that names its format and
    version: raises `not_this_format()` unless it is a dict whose `"format"`
    is `name`, and `other_version(found)` unless its `"format_version"` is
    `version` (or one of a tuple of versions); each callable returns the
    exception to raise.

    Example:

    ```python
    check_format(
        read_json(path),
        "keras_mhf.prepared_corpus",
        1,
        lambda: ValueError(f"{path} is not a prepared-corpus index."),
        lambda found: ValueError(f"{path} has format version {found!r}."),
    )
    ```
    """
    if not isinstance(record, dict) or record.get("format") != name:
        raise not_this_format()
    found = record.get("format_version")
    if found not in (version if isinstance(version, tuple) else (version,)):
        raise other_version(found)
