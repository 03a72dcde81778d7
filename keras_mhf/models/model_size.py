"""The size of a model's weights as stored, and placeholder vocabularies
for building a model of a given vocabulary size without a tokenizer (what
`keras-mhf inspect --bytes` and the benchmarks measure)."""

import numpy as np


def synthetic_tokens(vocabulary_size):
    """`<unk>`, `<s>`, `</s>` and `tok0, tok1, ...` up to `vocabulary_size`."""
    return ["<unk>", "<s>", "</s>"] + [
        f"tok{i}" for i in range(vocabulary_size - 3)
    ]


def weight_bytes(model):
    """Bytes of a model's weights, as stored (int8 / packed int4 values and
    their float scales after `quantize`).

    Returns:
        dict with `vocabulary` (MHF: the H bucket tables and their scales;
        Standard: the tied embedding and its scales), `other` (every other
        float or quantized weight: trunk, gate, mixers, norms), `index`
        (MHF's int signature table and candidate-decoding index, not
        trainable) and `total`.
    """

    def size(variables):
        return int(
            sum(
                int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                for v in variables
            )
        )

    backbone = model.backbone
    if hasattr(backbone, "hash_encoder"):
        encoder = backbone.hash_encoder
        vocabulary = list(encoder.embeddings) + list(
            getattr(encoder, "embeddings_scale", [])
        )
        index = list(backbone.signature_lookup.weights)
    else:
        vocabulary, index = list(backbone.token_embedding.weights), []
    seen = {id(v) for v in vocabulary + index}
    other = [v for v in model.weights if id(v) not in seen]
    result = {
        "vocabulary": size(vocabulary),
        "other": size(other),
        "index": size(index),
    }
    result["total"] = sum(result.values())
    return result
