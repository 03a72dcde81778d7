"""Writes a `.safetensors` file one tensor at a time.

`safetensors.numpy.save_file` takes every tensor at once, so exporting a
model that way holds a second copy of all its weights. Here the header
(names, dtypes, shapes, offsets) is written first from the tensors'
specifications, then each tensor is produced, written and released in turn:
peak memory is the model plus its largest tensor.
"""

import json
import os
import struct

import numpy as np

# numpy dtype name -> safetensors dtype tag.
_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def _itemsize(dtype):
    if dtype == "bfloat16":
        return 2
    return np.dtype(dtype).itemsize


def write_safetensors(path, tensors, metadata=None):
    """Writes `tensors` to the safetensors file `path`.

    Args:
        path: file to create.
        tensors: list of `(name, shape, dtype, produce)`, where `produce()`
            returns the array (of that shape and numpy dtype name) when its
            turn comes. Tensors are stored in name order.
        metadata: optional `{str: str}` for the header's `__metadata__`.

    Example:

    ```python
    write_safetensors(
        "model.safetensors",
        [("w", (2, 3), "float32", lambda: np.zeros((2, 3), "float32"))],
        {"format": "pt"},
    )
    ```
    """
    tensors = sorted(tensors, key=lambda entry: entry[0])
    names = [entry[0] for entry in tensors]
    if len(set(names)) != len(names):
        raise ValueError("Duplicate tensor names in a safetensors file.")
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, shape, dtype, _ in tensors:
        if dtype not in _DTYPES:
            raise ValueError(f"Tensor {name!r}: unsupported dtype {dtype}.")
        shape = [int(s) for s in shape]
        size = int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape, dtype, produce in tensors:
            array = np.asarray(produce())
            if tuple(array.shape) != tuple(int(s) for s in shape) or (
                str(array.dtype) != dtype
            ):
                raise ValueError(
                    f"Tensor {name!r} was announced as {dtype} "
                    f"{tuple(shape)} but produced {array.dtype} "
                    f"{tuple(array.shape)}."
                )
            f.write(np.ascontiguousarray(array).tobytes())
            del array
        f.flush()
        os.fsync(f.fileno())
