"""Running out of disk space, said clearly: `DiskFullError`, the up-front
free-space check of a write, and recognising a full disk in an `OSError`.

Example:

```python
from keras_mhf.utils.disk_space import check_free_space

check_free_space("runs/mhf/checkpoints", 3_000_000, "checkpoint step_000006")
```
"""

import errno
import os
import shutil

# errno values that mean "the disk (or the quota) is full".
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_FULL_MESSAGES = ("No space left on device", "Disk quota exceeded")
# Extra room asked for beyond a write's estimate (file-system overhead).
MARGIN_BYTES = 1 << 20


class DiskFullError(RuntimeError):
    """A write did not fit (or would not fit) on its file system. The
    message is one line: what was being written, where, what was kept, and
    what to do; temporary files of the write were removed.

    Example:

    ```python
    try:
        pretrain("prepared/openstax", "runs/mhf")
    except DiskFullError as error:
        print(error)  # "no space left on device while writing ..."
    ```
    """


def disk_full_reason(error):
    """Why a write did not fit, in words, when `error` (an `OSError`, or
    another library's error carrying the system's message, e.g. Orbax's
    `ValueError` from TensorStore) says the disk or quota is full or a file
    passed the file-size limit; else `None`.

    >>> import errno
    >>> disk_full_reason(OSError(errno.ENOSPC, "No space left on device"))
    'no space left on device'
    >>> disk_full_reason(ValueError("OUT_OF_RANGE: ... File too large"))
    'a file reached the file-size limit (ulimit -f)'
    >>> disk_full_reason(OSError(errno.ENOENT, "No such file")) is None
    True
    """
    code = getattr(error, "errno", None)
    text = str(error)
    if code in DISK_FULL_ERRNOS or any(m in text for m in _FULL_MESSAGES):
        return "no space left on device"
    if code == errno.EFBIG or "File too large" in text:
        return "a file reached the file-size limit (ulimit -f)"
    return None


def is_disk_full(error):
    """Whether an exception is an `OSError` for a full disk or quota, or a
    file past the file-size limit (`disk_full_reason`).

    >>> import errno
    >>> is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    True
    >>> is_disk_full(OSError(errno.ENOENT, "No such file"))
    False
    """
    return isinstance(error, OSError) and disk_full_reason(error) is not None


def directory_bytes(path):
    """Bytes of the files under `path` (0 when it does not exist).

    Example:

    ```python
    directory_bytes("runs/mhf/checkpoints/step_000004")  # e.g. 2_731_008
    ```
    """
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def check_free_space(directory, needed_bytes, what, advice=""):
    """Raises `DiskFullError` when the file system of `directory` has less
    free space than `needed_bytes` plus a margin (`MARGIN_BYTES`).

    Args:
        directory: an existing directory on the file system to write.
        needed_bytes: the estimated size of the write.
        what: what is about to be written, for the message.
        advice: the rest of the message (what was kept, what to do), or a
            callable giving it, called only when the space is short.

    Example:

    ```python
    check_free_space(".", 1024, "a summary")  # passes on a non-full disk
    ```
    """
    free = shutil.disk_usage(directory).free
    if free < needed_bytes + MARGIN_BYTES:
        if callable(advice):
            advice = advice()
        raise DiskFullError(
            f"not enough free space to write {what} in {directory}: it needs "
            f"about {_megabytes(needed_bytes + MARGIN_BYTES)}, "
            f"{_megabytes(free)} are free; nothing was written. " + advice
        )


def _megabytes(count):
    return f"{count / 1e6:.1f} MB"
