"""Exports a MultiHashFormer model as a Hugging Face checkpoint in the
authors' format (GitHub HUIYINXUE/MHF, `Qwen3HashFormer`).

The directory holds:

- `config.json`: the Qwen3 fields plus `num_hashes`, `num_buckets`,
  `num_lsh` (0), `bottle_neck_dim`, `use_conditional_prob` (true, so the
  authors' `forward` returns `[b, s, V]` token scores that `generate()` and
  lm-eval use), `lsh_only_embed`, `fused_decoding`, `pad_token_id` (the
  token with the all-zero signature); and two keras_mhf fields the authors'
  code ignores: `signature_rule` and `scoring_temperature`;
- `model.safetensors`: `model.hash_map` (int64 `[V, H]`), the stacked
  bucket tables `model.embed_tokens.weight` `[H * B, d]` (tied to the
  head: no `lm_head.weight` is stored, as `save_pretrained` does),
  `model.combiner.*`, the Qwen3 blocks `model.layers.N.*`, `model.norm`,
  and `hash_head.cascade_mixer.K.*`, torch `[out, in]` layout;
- `modeling_multi_hash_former.py`, named in `config.json`'s `auto_map`
  (`model_type` "multi_hash_former"): the config and model classes with
  which stock `transformers` loads the folder
  (`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`),
  its `logits` the vocabulary log-probs;
- `generation_config.json`, and, from a causal LM with a tokenizer,
  `tokenizer.model`, `tokenizer.json`, `tokenizer_config.json` and
  `special_tokens_map.json` (see `sentencepiece_tokenizer_files`).

The authors' model returns the raw scores `s(w) = sum_i log p_i(h_i(w))`;
their `log_softmax` over the vocabulary is keras_mhf's token log-probs at
`scoring_temperature=1` (the paper's rule). A calibrated temperature is
recorded in `config.json` and restored by `from_preset`; the authors' code
does not apply it. `MultiHashFormerCausalLM.from_preset(path)` reads the
directory back.
"""

import os
import shutil

from keras_mhf.export.transformers import hf_exporter
from keras_mhf.export.transformers import weight_names

# The module, copied into every export, that stock transformers loads it
# with (`auto_map`; see modeling_multi_hash_former.py).
REMOTE_CODE = "modeling_multi_hash_former"


def _check(backbone):
    if backbone.gate_dim != backbone.mixer_dim:
        raise ValueError(
            "The authors' checkpoint format has one bottle_neck_dim for the "
            f"encoder gate and the cascade mixers; this model has "
            f"gate_dim={backbone.gate_dim} and mixer_dim="
            f"{backbone.mixer_dim}, which it cannot express."
        )


def config(backbone, tokenizer=None, max_position_embeddings=32768):
    """`config.json` of the export (a dict)."""
    _check(backbone)
    dtype = hf_exporter.float_dtype(backbone.hash_encoder.embeddings[0])
    content = hf_exporter.qwen3_config(backbone, max_position_embeddings, dtype)
    bos, eos = hf_exporter.special_token_ids(tokenizer)
    content.update(
        {
            "pad_token_id": backbone.pad_token_id,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "num_hashes": int(backbone.num_hashes),
            "num_buckets": int(backbone.num_buckets),
            "num_lsh": int(getattr(backbone, "num_lsh", 0)),
            "bottle_neck_dim": int(backbone.gate_dim),
            "use_conditional_prob": True,
            "lsh_only_embed": False,
            "fused_decoding": False,
            "signature_rule": backbone.signature_rule,
            # Stock transformers loads the folder with our modeling code
            # (trust_remote_code); without it, it refuses rather than
            # building a stock Qwen3 from the bucket tables.
            "architectures": ["MultiHashFormerForCausalLM"],
            "model_type": "multi_hash_former",
            "auto_map": {
                "AutoConfig": f"{REMOTE_CODE}.MultiHashFormerConfig",
                "AutoModelForCausalLM": (
                    f"{REMOTE_CODE}.MultiHashFormerForCausalLM"
                ),
            },
            "apply_scoring_temperature": False,
        }
    )
    return content


def weight_entries(backbone):
    """The safetensors entries of the authors' format, each produced when
    written."""
    signatures = backbone.signature_lookup

    def hash_map():
        return signatures.get_signatures().astype("int64")

    entries = [
        (
            weight_names.HASH_MAP,
            (int(backbone.vocabulary_size), int(backbone.num_hashes)),
            "int64",
            hash_map,
        ),
        hf_exporter.stacked_entry(
            weight_names.EMBED_TOKENS, backbone.hash_encoder.embeddings
        ),
    ]
    named = (
        weight_names.dense_weights(
            weight_names.encoder_denses(backbone.hash_encoder)
        )
        + weight_names.trunk_weights(backbone)
        + weight_names.dense_weights(
            weight_names.mixer_denses(backbone.hash_decoder)
        )
    )
    entries += [hf_exporter.variable_entry(*entry) for entry in named]
    return entries


def _write(directory, backbone, tokenizer, extra_config, max_positions):
    content = config(backbone, tokenizer, max_positions)
    content.update(extra_config)
    hf_exporter.write_checkpoint(
        directory,
        content,
        weight_entries(backbone),
        backbone.pad_token_id,
        tokenizer,
    )
    shutil.copyfile(
        os.path.join(os.path.dirname(__file__), f"{REMOTE_CODE}.py"),
        os.path.join(directory, f"{REMOTE_CODE}.py"),
    )


def export_backbone(
    backbone, path, overwrite=False, max_position_embeddings=32768
):
    """Writes `config.json`, `generation_config.json` and
    `model.safetensors` of a `MultiHashFormerBackbone` (the cascade decoder
    is part of the backbone, so this is the whole model) to `path`.

    Example:

    ```python
    export_backbone(lm.backbone, "exported_backbone")
    ```
    """
    return hf_exporter.export(
        backbone,
        path,
        overwrite,
        lambda d: _write(d, backbone, None, {}, max_position_embeddings),
    )


def export_causal_lm(
    causal_lm, path, overwrite=False, max_position_embeddings=32768
):
    """Writes the whole export (module docstring) of a
    `MultiHashFormerCausalLM` to `path`, with its tokenizer's files when it
    has a preprocessor.

    Example:

    ```python
    export_causal_lm(lm, "exported")
    MultiHashFormerCausalLM.from_preset("exported")
    ```
    """
    causal_lm.check_tokenizer()
    tokenizer = getattr(causal_lm.preprocessor, "tokenizer", None)
    extra = {"scoring_temperature": float(causal_lm.scoring_temperature)}
    return hf_exporter.export(
        causal_lm,
        path,
        overwrite,
        lambda d: _write(
            d,
            causal_lm.backbone,
            tokenizer,
            extra,
            max_position_embeddings,
        ),
    )
