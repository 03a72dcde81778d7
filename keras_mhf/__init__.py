"""MultiHashFormer for Keras 3: hash-based generative language models."""

import importlib as _importlib
import os as _os
import sys as _sys

from keras_mhf.utils import native_logs as _native_logs

__version__ = "0.1.0"

# The names below, from the modules that import Keras (and so TensorFlow,
# which KerasHub imports on every backend).
_PUBLIC = {
    "layers": "keras_mhf.layers",
    "losses": "keras_mhf.losses",
    "models": "keras_mhf.models",
    "SignatureTable": "keras_mhf.signatures",
}


def _load():
    """Imports the package's Keras modules (registering its serializable
    classes) and returns the public names; a no-op after the first call.
    TensorFlow's start-up lines that mean nothing on a CPU machine are
    dropped when an entry point set KERAS_MHF_QUIET_STARTUP=1 (see
    keras_mhf/utils/native_logs.py)."""
    with _native_logs.filtered_startup():
        modules = {
            m: _importlib.import_module(m) for m in set(_PUBLIC.values())
        }
    names = {
        name: getattr(modules[m], name) if name[0].isupper() else modules[m]
        for name, m in _PUBLIC.items()
    }
    globals().update(names)
    return names


if _sys.argv and _os.path.basename(_sys.argv[0]) == "keras-mhf":
    # The command line: TensorFlow's start-up lines mean nothing there, and
    # `keras-mhf --help` or a bad argument must not wait for TensorFlow. A
    # command loads the package (`keras_mhf.cli.main`) once its arguments
    # parse; until then the public names load on first use.
    _os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")
    # The command's backend is JAX unless KERAS_BACKEND says otherwise
    # (not Keras' own default from ~/.keras/keras.json, TensorFlow), as
    # docs/command_line.md says; `pretrain` prints it on its first line.
    _os.environ.setdefault("KERAS_BACKEND", "jax")
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # no INFO lines

    def __getattr__(name):
        if name in _PUBLIC:
            return _load()[name]
        raise AttributeError(f"module 'keras_mhf' has no attribute {name!r}")

else:
    _load()
