"""Inference calls on one model from several threads (a server's).

Keras' JAX `predict_on_batch` donates the model's state buffers to its
compiled function, so a second thread running the same model's compiled
function at that moment reads deleted buffers ("Buffer has been deleted or
donated"). `inference(model)` runs one public inference call (`generate`,
`score`, the evaluation's compiled scorers) of a model at a time, on every
backend (re-entrant: a call may make another inside it), and on PyTorch
without autograd, so that outputs carry no autograd state.

Example:

```python
from keras_mhf.utils.concurrent_inference import inference

with inference(lm):
    out = scorer.predict_on_batch(inputs)
```
"""

import contextlib
import functools
import threading
import weakref

import keras

_LOCKS = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model):
    """The re-entrant lock of `model`'s inference calls (made once)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def _no_grad():
    if keras.config.backend() == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


@contextlib.contextmanager
def inference(model):
    """Holds `model`'s inference lock (and, on PyTorch, `no_grad`)."""
    with model_lock(model), _no_grad():
        yield


def serialized(method):
    """Decorates a model method to run under `inference(self)`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with inference(self):
            return method(self, *args, **kwargs)

    return wrapper
