"""The accelerator the Keras backend computes on, and its memory.

Backend-specific module: JAX's first local device, PyTorch's first CUDA
device; TensorFlow (and any CPU) reports no accelerator memory, so what
sizes itself from it (the fused head's blocks,
`keras_mhf.losses.fused_signature_loss.automatic_block_size`) keeps its
CPU choice there.

Example:

```python
from keras_mhf.utils.device_memory import accelerator_memory_bytes

accelerator_memory_bytes()  # None on a CPU, e.g. 150_754_820_096 on an H200
```
"""

import functools

import keras


def device_info():
    """`(name, platform, memory limit in bytes or None)` of the first
    device of the Keras backend (`("cpu", "cpu", None)` without an
    accelerator)."""
    backend = keras.config.backend()
    if backend == "jax":
        import jax

        device = jax.local_devices()[0]
        if device.platform != "cpu":
            stats = device.memory_stats() or {}
            return device.device_kind, device.platform, stats.get("bytes_limit")
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return props.name, "gpu", props.total_memory
    return "cpu", "cpu", None


@functools.cache
def accelerator_memory_bytes():
    """Memory of the backend's first accelerator in bytes, or `None` on a
    CPU (or where the backend does not say: TensorFlow)."""
    return device_info()[2]
