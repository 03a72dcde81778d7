"""Vocabulary growth of the Standard baseline (paper Sec. 4.4): new rows of
the embedding matrix, mean-initialised from the old tokenizer's pieces (the
authors' rule). MultiHashFormer needs no new rows:
`MultiHashFormerCausalLM.expand_vocabulary`."""

import keras
import numpy as np

from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm_preprocessor import (
    MultiHashFormerCausalLMPreprocessor,
)
from keras_mhf.utils.keras_utils import copy_weights_by_path


def expand_standard_vocabulary(model, new_tokenizer):
    """The Standard baseline for a larger vocabulary, mean-initialised.

    Args:
        model: a `StandardCausalLM` (from `standard_causal_lm`)
            with its old tokenizer attached.
        new_tokenizer: the expanded tokenizer (old pieces first).

    Returns:
        A new `StandardCausalLM`; every weight but the embedding is copied, the
        old rows are kept, and each new row is the mean of the old rows of
        the new piece's tokenization under the old tokenizer.
    """
    import sentencepiece as spm

    old_tokenizer = model.preprocessor.tokenizer
    old_vocabulary = old_tokenizer.get_vocabulary()
    vocabulary = new_tokenizer.get_vocabulary()
    if vocabulary[: len(old_vocabulary)] != old_vocabulary:
        raise ValueError(
            "The new tokenizer must start with the old vocabulary."
        )
    old_sp = spm.SentencePieceProcessor(model_proto=old_tokenizer.proto)
    backbone = model.backbone
    config = backbone.get_config()
    config["vocabulary_size"] = len(vocabulary)
    new_backbone = type(backbone).from_config(config)
    # Every weight but the embedding is copied by path, as MultiHashFormer's
    # expansion copies everything but its table.
    copy_weights_by_path(
        backbone, new_backbone, skip=[new_backbone.token_embedding.embeddings]
    )
    old_rows = np.asarray(
        keras.ops.convert_to_numpy(backbone.token_embedding.embeddings)
    )
    rows = np.zeros((len(vocabulary), old_rows.shape[1]), old_rows.dtype)
    rows[: len(old_rows)] = old_rows
    for i in range(len(old_vocabulary), len(vocabulary)):
        text = vocabulary[i].replace("▁", " ")
        ids = (
            old_sp.encode(text.lstrip())
            if text.startswith(" ")
            else old_sp.encode(text)
        )
        if (
            not text.startswith(" ")
            and ids
            and old_sp.id_to_piece(ids[0]) == "▁"
        ):
            ids = ids[1:]  # the dummy prefix SentencePiece adds
        rows[i] = old_rows[ids].mean(0) if ids else old_rows.mean(0)
    new_backbone.token_embedding.embeddings.assign(rows)
    preprocessor = MultiHashFormerCausalLMPreprocessor(
        new_tokenizer, sequence_length=model.preprocessor.sequence_length
    )
    expanded = type(model)(backbone=new_backbone, preprocessor=preprocessor)
    expanded.compile(loss=model.loss)
    return expanded
