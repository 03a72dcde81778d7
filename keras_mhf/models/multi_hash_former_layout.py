"""Model-parallel layouts for MultiHashFormer and Standard backbones.

KerasHub-style regex rules (as `LlamaBackbone.get_layout_map`): the bucket
tables are sharded over buckets on the model axis, the encoder's gate and
output kernels, the Qwen3 attention and MLP kernels and the cascade mixers are
split between the model and data axes; the int signature table, norms and
biases are replicated.

A rule only works when the mesh axis divides the weight's dimension (e.g. 2 KV
heads cannot be split 4 ways). Given the backbone's config, `layout_map`
fits every weight: a dimension that an axis does not divide is replicated
instead; and `check_layout_map` refuses, before any weight exists, a layout
that cannot work, naming the weight, the dimension and the mesh axis.
"""

import re

import keras


def _rules(model, data):
    """`(regex, axes)` for the sharded weights."""
    return [
        # Sec. 3.1 / 3.3: the tied bucket tables, sharded over buckets.
        (r".*hash_encoder/embeddings_\d+", (model, data)),
        (r".*hash_encoder/gate_dense/kernel", (data, model)),
        (r".*hash_encoder/score_dense/kernel", (model, None)),
        (r".*hash_encoder/output_dense/kernel", (data, model)),
        (r".*mixer_\d+_down_dense/kernel", (data, model)),
        (r".*mixer_\d+_up_dense/kernel", (model, data)),
        # Sec. 3.2: the Qwen3 blocks, as KerasHub shards Llama's.
        (
            r".*transformer_layer.*self_attention.*(query|key|value).kernel",
            (model, data, None),
        ),
        (r".*transformer_layer.*attention_output.kernel", (model, None, data)),
        (
            r".*transformer_layer.*feedforward_intermediate_dense.kernel",
            (data, model),
        ),
        (r".*transformer_layer.*feedforward_gate_dense.kernel", (data, model)),
        (
            r".*transformer_layer.*feedforward_output_dense.kernel",
            (model, data),
        ),
    ]


def weight_shapes(config):
    """`{weight path: shape}` of the weights the layout rules can shard,
    computed from a backbone config (`MultiHashFormerBackbone` or
    `StandardBackbone`'s `get_config()`, or `architecture_config(...)`)
    without building anything. (No rule shards the Standard embedding.)"""
    d = config["hidden_dim"]
    q, kv = config["num_query_heads"], config["num_key_value_heads"]
    hd, ff = config["head_dim"], config["intermediate_dim"]
    shapes = {}
    if "num_hashes" in config:
        h, b = config["num_hashes"], config["num_buckets"]
        g, m = config["gate_dim"], config["mixer_dim"]
        for i in range(h):
            shapes[f"hash_encoder/embeddings_{i}"] = (b, d)
        shapes["hash_encoder/gate_dense/kernel"] = (d, g)
        shapes["hash_encoder/score_dense/kernel"] = (g, 1)
        shapes["hash_encoder/output_dense/kernel"] = (d, d)
        for i in range(h - 1):
            shapes[f"hash_decoder/mixer_{i}_down_dense/kernel"] = (2 * d, m)
            shapes[f"hash_decoder/mixer_{i}_up_dense/kernel"] = (m, d)
    for n in range(config["num_layers"]):
        attention = f"transformer_layer_{n}/self_attention"
        shapes[f"{attention}/query/kernel"] = (d, q, hd)
        shapes[f"{attention}/key/kernel"] = (d, kv, hd)
        shapes[f"{attention}/value/kernel"] = (d, kv, hd)
        shapes[f"{attention}/attention_output/kernel"] = (q, hd, d)
        block = f"transformer_layer_{n}"
        shapes[f"{block}/feedforward_intermediate_dense/kernel"] = (d, ff)
        shapes[f"{block}/feedforward_gate_dense/kernel"] = (d, ff)
        shapes[f"{block}/feedforward_output_dense/kernel"] = (ff, d)
    return shapes


def _axis_sizes(device_mesh):
    return dict(zip(device_mesh.axis_names, device_mesh.shape))


def _axes_of(layout_map, path):
    layout = layout_map[path]
    return None if layout is None else tuple(layout.axes)


def layout_map(
    device_mesh,
    model_parallel_dim_name="model",
    data_parallel_dim_name="batch",
    config=None,
):
    """A `keras.distribution.LayoutMap` (see the module docstring).

    Args:
        device_mesh: a `keras.distribution.DeviceMesh`.
        model_parallel_dim_name: the mesh axis that shards weights.
        data_parallel_dim_name: the mesh axis that shards the batch.
        config: optional backbone config. With it, the map holds one exact
            entry per weight, with every dimension that its mesh axis does
            not divide replicated; without it, the regex rules as they are.
    """
    for name in (model_parallel_dim_name, data_parallel_dim_name):
        if name not in device_mesh.axis_names:
            raise ValueError(
                f"{name!r} is not an axis of the device mesh "
                f"{device_mesh.axis_names}."
            )
    rules = _rules(model_parallel_dim_name, data_parallel_dim_name)
    result = keras.distribution.LayoutMap(device_mesh)
    if config is None:
        for pattern, axes in rules:
            result[pattern] = axes
        return result
    sizes = _axis_sizes(device_mesh)
    for path, shape in weight_shapes(config).items():
        axes = next((a for p, a in rules if re.fullmatch(p, path)), None)
        if axes is None:
            continue
        result[path] = tuple(
            None if axis is not None and dim % sizes[axis] else axis
            for axis, dim in zip(axes, shape)
        )
    return result


def check_layout_map(layout_map, config):
    """Refuses a layout that cannot shard the model described by `config`.

    Raises:
        ValueError: naming the first weight whose dimension the assigned
            mesh axis does not divide (or whose layout has the wrong rank).
    """
    sizes = _axis_sizes(layout_map.device_mesh)
    for path, shape in weight_shapes(config).items():
        axes = _axes_of(layout_map, path)
        if axes is None:
            continue
        if len(axes) != len(shape):
            raise ValueError(
                f"The layout {axes} of weight '{path}' has {len(axes)} axes; "
                f"the weight has shape {shape}."
            )
        for dim_index, (axis, dim) in enumerate(zip(axes, shape)):
            if axis is not None and dim % sizes[axis]:
                raise ValueError(
                    f"Weight '{path}' of shape {shape}: dimension {dim_index} "
                    f"({dim}) cannot be split over mesh axis {axis!r} of size "
                    f"{sizes[axis]}. Use a mesh whose {axis!r} axis divides "
                    f"{dim}, or build the layout with `config=` so that such "
                    "dimensions are replicated."
                )
