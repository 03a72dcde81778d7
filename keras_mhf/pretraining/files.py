"""Durable file writes of a pre-training run: sha256, fsync and atomic
replacement, so that a crash leaves either the old or the new content of a
file, never a partial one."""

import hashlib
import os


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
    rename, so `path` holds either its old or its new content.

    Example:

    ```python
    write_atomically("runs/mhf/summary.json", b"{}")
    ```
    """
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
