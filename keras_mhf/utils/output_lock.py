"""One writer per output directory: an exclusive advisory lock that dies
with its process.

Pre-training runs (`keras_mhf.pretraining.pretrain`) and corpus preparation
(`keras_mhf.data.prepare_data`) hold `DIR/.keras_mhf.lock` while they write
into `DIR`. The lock is an `fcntl.flock` lock: the kernel releases it when
the process ends, however it ends (a SIGKILLed run never blocks the next
one), and a second process that asks for it is refused at once with an error
that names the holder (pid, host, start time, command line), which the lock
file records.

Example:

```python
from keras_mhf.utils.output_lock import output_lock

with output_lock("runs/mhf", "a pre-training run"):
    ...  # nothing else can lock runs/mhf until this block ends
```
"""

import contextlib
import datetime
import json
import os
import socket
import sys
import warnings

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None

LOCK_FILE = ".keras_mhf.lock"

# Lock descriptors this process holds. A forked child (e.g. a tokenizer
# worker) closes its copies, so that the lock goes with the process that
# took it, not with children that outlive it.
_HELD = set()


def _close_in_child():
    for descriptor in list(_HELD):
        try:
            os.close(descriptor)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class OutputLockedError(RuntimeError):
    """Another process holds the lock of an output directory.

    Attributes:
        holder: what the lock file says about the holder (a dict; empty when
            it could not be read).

    Example:

    ```python
    try:
        pretrain("prepared/openstax", "runs/mhf")
    except OutputLockedError as error:
        print(error.holder.get("pid"))
    ```
    """

    def __init__(self, message, holder):
        super().__init__(message)
        self.holder = holder


def _describe(holder):
    if not holder:
        return "another process (its lock file could not be read)"
    command = " ".join(holder.get("command", []))
    if len(command) > 200:
        command = command[:197] + "..."
    return (
        f"process {holder.get('pid')} on {holder.get('host')} (started "
        f"{holder.get('started')}: {holder.get('purpose')}; command: "
        f"{command})"
    )


def _read_holder(descriptor):
    try:
        os.lseek(descriptor, 0, os.SEEK_SET)
        text = os.read(descriptor, 1 << 16).decode("utf-8")
        holder = json.loads(text)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _acquire(path, target):
    """An open descriptor of `path` holding its exclusive lock (of
    `target`: the directory, or the one file it guards). A lock file
    removed by its previous holder between our open and our lock is opened
    again (so that two processes never lock different files)."""
    for _ in range(100):
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            holder = _read_holder(descriptor)
            os.close(descriptor)
            raise OutputLockedError(
                f"{target} is being written by {_describe(holder)}. "
                "Only one process may write to it at a time: wait for it "
                "to finish (or stop it), or use another output.",
                holder,
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return descriptor
        os.close(descriptor)
    raise OSError(f"Could not lock {path}: it keeps being replaced.")


@contextlib.contextmanager
def output_lock(directory, purpose, lock_name=LOCK_FILE):
    """Holds the exclusive lock of `directory` (created if needed) for the
    block.

    The lock file is removed when the block ends, and so is the directory
    if this call created it and nothing else was written to it, so a run
    refused for its settings leaves no trace. (After a SIGKILL the file
    stays, unlocked: the next run takes it over.)

    Args:
        directory: the output directory.
        purpose: what the holder does, recorded for the error a second
            process gets (e.g. `"a pre-training run"`).
        lock_name: the lock file's name in `directory`; another name locks
            one output inside a shared directory (an evaluation's results
            file).

    Raises:
        OutputLockedError: another process holds the lock; nothing was
            written.

    Example:

    ```python
    with output_lock("prepared/openstax", "prepare_data"):
        ...
    ```
    """
    directory = os.fspath(directory)
    created = not os.path.isdir(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, lock_name)
    if fcntl is None:
        warnings.warn(
            f"This platform has no fcntl: {directory} is not locked against "
            "a second process writing to it.",
            stacklevel=3,
        )
        yield {}
        return
    try:
        # A lock of its own name guards one file, `.NAME.lock` -> NAME.
        target = directory
        if lock_name != LOCK_FILE:
            name = lock_name.removeprefix(".").removesuffix(".lock")
            target = os.path.join(directory, name)
        descriptor = _acquire(path, target)
    except BaseException:
        if created:
            _remove_if_empty(directory)
        raise
    try:
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            "purpose": purpose,
            "command": list(sys.argv),
        }
        os.ftruncate(descriptor, 0)
        os.lseek(descriptor, 0, os.SEEK_SET)
        os.write(descriptor, json.dumps(record).encode("utf-8"))
        _HELD.add(descriptor)
        yield record
    finally:
        _HELD.discard(descriptor)
        try:
            os.remove(path)  # still locked: no one else holds this file
        except OSError:
            pass
        os.close(descriptor)  # releases the lock
        if created:
            _remove_if_empty(directory)


def _remove_if_empty(directory):
    try:
        os.rmdir(directory)
    except OSError:
        pass
