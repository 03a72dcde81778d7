"""The class-level docstring examples of the public API run as written, from
any directory, with only `keras`, `keras_mhf` and `numpy as np` imported
(each example builds its own tiny table, tokenizer or model)."""

import inspect
import re

import keras
import numpy as np
import pytest

import keras_mhf

PUBLIC = [
    keras_mhf.SignatureTable,
    keras_mhf.layers.SignatureLookup,
    keras_mhf.layers.HashEncoder,
    keras_mhf.layers.CascadeHashDecoder,
    keras_mhf.losses.SignatureCrossEntropy,
    keras_mhf.models.MultiHashFormerTokenizer,
    keras_mhf.models.MultiHashFormerCausalLMPreprocessor,
    keras_mhf.models.MultiHashFormerBackbone,
    keras_mhf.models.MultiHashFormerCausalLM,
    keras_mhf.models.Qwen3DecoderBlock,
    keras_mhf.models.StandardBackbone,
    keras_mhf.models.StandardCausalLM,
    keras_mhf.models.standard_causal_lm,
]


def examples(obj):
    """The ```python blocks of `obj`'s own docstring, dedented."""
    doc = inspect.getdoc(obj) or ""
    return [
        inspect.cleandoc(block)
        for block in re.findall(r"```python\n(.*?)```", doc, re.S)
    ]


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: o.__name__)
def test_example_runs_as_written(obj, tmp_path, monkeypatch):
    blocks = examples(obj)
    assert blocks, f"{obj.__name__} has no example"
    monkeypatch.chdir(tmp_path)  # any directory; files land in tmp_path
    for code in blocks:
        exec(
            compile(code, f"<{obj.__name__} example>", "exec"),
            {"keras": keras, "keras_mhf": keras_mhf, "np": np},
        )
