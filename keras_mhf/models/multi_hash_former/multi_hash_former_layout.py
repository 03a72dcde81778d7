"""Model-parallel layouts for MultiHashFormer and Standard backbones.

KerasHub-style regex rules (as `LlamaBackbone.get_layout_map`): the bucket
tables are sharded over buckets on the model axis, the encoder's gate and
output kernels, the Qwen3 attention and MLP kernels and the cascade mixers are
split between the model and data axes; the int signature table, norms and
biases are replicated.

A rule only works when the mesh axis divides the weight's dimension (e.g. 2 KV
heads cannot be split 4 ways). `layout_map` returns a
`MultiHashFormerLayoutMap`, which fits itself to the model: a
`MultiHashFormerBackbone` or `StandardBackbone` built under a `ModelParallel`
distribution that holds one tells it the shapes of the weights it is about to
create (`fit`, from the backbone's own config), and every dimension that its
mesh axis does not divide is then replicated instead of failing inside JAX,
with a warning naming the weights, dimensions and mesh axes. `check_layout_map`
refuses, before any weight exists, a layout that cannot work, naming the
weight, the dimension and the mesh axis.
"""

import re
import warnings

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


class MultiHashFormerLayoutMap(keras.distribution.LayoutMap):
    """A `keras.distribution.LayoutMap` that fits its rules to the weights.

    It behaves like any `LayoutMap` (regex keys, exact keys first) until a
    backbone built under a `ModelParallel` distribution holding it calls
    `fit` with its config, before creating its weights. From then on the
    layout of each of those weights has every dimension that its mesh axis
    does not divide replicated (`None`), so the weight is created instead of
    failing with JAX's `IndivisibleError`; `fit` warns once, naming the
    weights, dimensions and axes it replicates. A layout whose rank differs
    from its weight's is refused there, naming the weight.

    Args:
        device_mesh: a `keras.distribution.DeviceMesh`.

    Example:

    ```python
    mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"))
    layout_map = MultiHashFormerBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    lm = MultiHashFormerCausalLM.from_tokenizer(tokenizer, "tiny_h3b64")
    ```
    """

    def __init__(self, device_mesh):
        super().__init__(device_mesh)
        self._fitted = {}

    def fit(self, config):
        """Fits the layouts to the weights of the backbone that `config`
        describes (a `get_config()`, or `architecture_config(...)`);
        replaces an earlier fit.

        Returns:
            `{weight path: (dimension, size, mesh axis, axis size)}` of the
            dimensions replicated because the axis does not divide them.

        Raises:
            ValueError: a layout's rank differs from its weight's.
        """
        sizes = _axis_sizes(self.device_mesh)
        fitted, replicated = {}, {}
        for path, shape in weight_shapes(config).items():
            layout = super().__getitem__(path)
            if layout is None:
                continue
            axes = tuple(layout.axes)
            if len(axes) != len(shape):
                raise ValueError(
                    f"The layout {axes} of weight '{path}' has {len(axes)} "
                    f"axes; the weight has shape {shape}."
                )
            dropped = [
                (i, dim, axis, sizes[axis])
                for i, (axis, dim) in enumerate(zip(axes, shape))
                if axis is not None and dim % sizes[axis]
            ]
            if dropped:
                replicated[path] = dropped
                axes = tuple(
                    None if axis is not None and dim % sizes[axis] else axis
                    for axis, dim in zip(axes, shape)
                )
                layout = keras.distribution.TensorLayout(axes, self.device_mesh)
            fitted[path] = layout
        self._fitted = fitted
        if replicated:
            warnings.warn(_replication_message(replicated), stacklevel=3)
        return replicated

    def __getitem__(self, key):
        if key in self._fitted:
            return self._fitted[key]
        for path, layout in self._fitted.items():
            if key.endswith("/" + path):  # a backbone inside a name scope
                return layout
        return super().__getitem__(key)


def _replication_message(replicated):
    groups = {}
    for path, dropped in replicated.items():
        for dim_index, dim, axis, size in dropped:
            key = (re.sub(r"_\d+(?=/|$)", "_*", path), dim_index, dim, axis)
            groups.setdefault(key, [size, 0])[1] += 1
    lines = [
        f"{pattern} dimension {dim_index} ({dim}) over mesh axis {axis!r} "
        f"of size {size} ({count} weight{'s' if count > 1 else ''})"
        for (pattern, dim_index, dim, axis), (size, count) in groups.items()
    ]
    return (
        "MultiHashFormer layout: replicating the dimensions that their mesh "
        "axis does not divide (these weights are not split along them): "
        + "; ".join(lines)
        + ". Choose a mesh whose axes divide them to shard them."
    )


def fit_layout_to_weights(**config):
    """Fits the active distribution's `MultiHashFormerLayoutMap`, if any, to
    the weights of the backbone described by `config` (its constructor
    arguments). Backbone constructors call it before creating any weight.

    Example:

    ```python
    fit_layout_to_weights(num_layers=2, num_query_heads=4, ...)
    ```
    """
    distribution = keras.distribution.distribution()
    layouts = getattr(distribution, "_layout_map", None)
    if isinstance(layouts, MultiHashFormerLayoutMap):
        layouts.fit(config)


def layout_map(
    device_mesh,
    model_parallel_dim_name="model",
    data_parallel_dim_name="batch",
    config=None,
):
    """A `MultiHashFormerLayoutMap` (see the module docstring).

    Args:
        device_mesh: a `keras.distribution.DeviceMesh`.
        model_parallel_dim_name: the mesh axis that shards weights.
        data_parallel_dim_name: the mesh axis that shards the batch.
        config: optional backbone config to fit the map to now (so that
            `check_layout_map` and the warning come before any model is
            built); without it the map fits itself to each backbone built
            under it.
    """
    for name in (model_parallel_dim_name, data_parallel_dim_name):
        if name not in device_mesh.axis_names:
            raise ValueError(
                f"{name!r} is not an axis of the device mesh "
                f"{device_mesh.axis_names}."
            )
    result = MultiHashFormerLayoutMap(device_mesh)
    for pattern, axes in _rules(
        model_parallel_dim_name, data_parallel_dim_name
    ):
        result[pattern] = axes
    if config is not None:
        result.fit(config)
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
                    f"{dim}, or `MultiHashFormerBackbone.get_layout_map`, "
                    "whose map replicates such dimensions."
                )
