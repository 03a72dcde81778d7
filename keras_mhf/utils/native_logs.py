"""Start-up lines of TensorFlow's native code that mean nothing to a user.

Importing TensorFlow (which KerasHub imports on every backend) writes, from
C++ and before any log setting applies (`TF_CPP_MIN_LOG_LEVEL` does not
reach them), lines such as (cut here at `...`)::

    WARNING: All log messages before absl::InitializeLog() is called are ...
    I0000 ... port.cc:153] oneDNN custom operations are on. ...
    I0000 ... cudart_stub.cc:31] Could not find cuda drivers on your ...
    E0000 ... cuda_platform.cc:52] failed call to cuInit: ... (303)

The last reads like an error but only says that a machine without an NVIDIA
driver has no GPU. `filtered_startup` drops exactly these lines (the cuInit
one only when no NVIDIA driver is installed, where it cannot be a real
failure) and passes every other line through unchanged, in order.

It is opt-in: the package's `__init__` runs its imports inside it, and it
does nothing unless `KERAS_MHF_QUIET_STARTUP=1` is set before `keras_mhf` is
imported, which only our entry points do, first thing (the quickstart,
`keras-mhf pretrain`, `keras-mhf evaluate`):

    os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")

`KERAS_MHF_QUIET_STARTUP=0` shows everything. This module imports nothing but
the standard library (it runs before the package's other imports).
"""

import contextlib
import os
import re
import sys
import tempfile

ENVIRONMENT_VARIABLE = "KERAS_MHF_QUIET_STARTUP"

_ALWAYS = [
    re.compile(
        r"^WARNING: All log messages before absl::InitializeLog\(\) is "
        r"called are written to STDERR$"
    ),
    re.compile(r"^I\d{4} [^\]]*\] oneDNN custom operations are on\."),
    re.compile(
        r"^I\d{4} [^\]]*\] Could not find cuda drivers on your machine, "
        r"GPU will not be used\.$"
    ),
]
_CUINIT = re.compile(r"^E\d{4} [^\]]*\] failed call to cuInit: ")


def has_nvidia_driver():
    """Whether an NVIDIA kernel driver is loaded (Linux) or a device node
    exists: only then can a failed `cuInit` be a real error."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists(
        "/dev/nvidiactl"
    )


def is_noise(line, nvidia_driver=None):
    """Whether `line` (without its newline) is one of the start-up lines
    this module drops.

    Example:

    >>> is_noise("WARNING: All log messages before absl::InitializeLog() "
    ...          "is called are written to STDERR")
    True
    >>> is_noise("E0000 00:00:1.0 1 some.cc:1] a real error")
    False
    """
    if any(pattern.match(line) for pattern in _ALWAYS):
        return True
    if _CUINIT.match(line):
        if nvidia_driver is None:
            nvidia_driver = has_nvidia_driver()
        return not nvidia_driver
    return False


@contextlib.contextmanager
def filtered_startup():
    """Runs the block with file descriptor 2 (stderr) captured, then writes
    back every captured line that `is_noise` does not drop. If TensorFlow
    was imported in the block, its devices are listed inside it too (that
    is when TensorFlow probes CUDA). A no-op unless
    `KERAS_MHF_QUIET_STARTUP=1`.
    """
    if os.environ.get(ENVIRONMENT_VARIABLE) != "1":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    captured = tempfile.TemporaryFile()
    os.dup2(captured.fileno(), 2)
    failed = True
    try:
        yield
        tensorflow = sys.modules.get("tensorflow")
        if tensorflow is not None and hasattr(tensorflow, "config"):
            tensorflow.config.list_physical_devices()
        failed = False
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        captured.seek(0)
        text = captured.read().decode("utf-8", "replace")
        captured.close()
        nvidia_driver = has_nvidia_driver()
        kept = [
            line
            for line in text.splitlines(keepends=True)
            if failed or not is_noise(line.rstrip("\n"), nvidia_driver)
        ]
        sys.stderr.write("".join(kept))
        sys.stderr.flush()
