"""Exports the Standard baseline (`StandardCausalLM` / `StandardBackbone`)
as a stock Hugging Face `Qwen3ForCausalLM` checkpoint: `config.json`,
`model.safetensors` (`model.embed_tokens.weight` `[V, d]`, tied to the LM
head, the Qwen3 blocks and `model.norm`, torch layout),
`generation_config.json` and, with a tokenizer, the tokenizer files. It
loads with `transformers.AutoModelForCausalLM.from_pretrained(path)`, so
both sides of a comparison run under the same PyTorch tooling (e.g.
lm-eval's `hf` model), and `StandardCausalLM.from_preset(path)` reads it
back.
"""

from keras_mhf.export.transformers import hf_exporter
from keras_mhf.export.transformers import weight_names


def config(backbone, tokenizer=None, max_position_embeddings=32768):
    """`config.json` of the export (a dict)."""
    embeddings = backbone.get_layer("token_embedding").embeddings
    content = hf_exporter.qwen3_config(
        backbone,
        max_position_embeddings,
        hf_exporter.float_dtype(embeddings),
    )
    bos, eos = hf_exporter.special_token_ids(tokenizer)
    content.update({"bos_token_id": bos, "eos_token_id": eos})
    content["pad_token_id"] = eos
    return content


def weight_entries(backbone):
    embedding = backbone.get_layer("token_embedding")
    named = [
        (weight_names.EMBED_TOKENS, embedding.embeddings, "copy")
    ] + weight_names.trunk_weights(backbone)
    return [hf_exporter.variable_entry(*entry) for entry in named]


def _write(directory, backbone, tokenizer, max_positions):
    content = config(backbone, tokenizer, max_positions)
    hf_exporter.write_checkpoint(
        directory,
        content,
        weight_entries(backbone),
        content["pad_token_id"],
        tokenizer,
    )


def export_backbone(
    backbone, path, overwrite=False, max_position_embeddings=32768
):
    """Writes the Qwen3 checkpoint of a `StandardBackbone` (no tokenizer).

    Example:

    ```python
    export_backbone(standard.backbone, "exported_standard_backbone")
    ```
    """
    return hf_exporter.export(
        backbone,
        path,
        overwrite,
        lambda d: _write(d, backbone, None, max_position_embeddings),
    )


def export_causal_lm(
    causal_lm, path, overwrite=False, max_position_embeddings=32768
):
    """Writes the Qwen3 checkpoint of a `StandardCausalLM`, with its
    tokenizer's files when it has a preprocessor.

    Example:

    ```python
    export_causal_lm(standard, "exported_standard")
    transformers.AutoModelForCausalLM.from_pretrained("exported_standard")
    ```
    """
    tokenizer = getattr(causal_lm.preprocessor, "tokenizer", None)
    return hf_exporter.export(
        causal_lm,
        path,
        overwrite,
        lambda d: _write(
            d, causal_lm.backbone, tokenizer, max_position_embeddings
        ),
    )
