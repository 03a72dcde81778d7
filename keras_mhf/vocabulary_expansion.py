"""Vocabulary expansion (paper Sec. 4.4): new languages' tokens for a trained
model, with zero new parameters for MultiHashFormer.

- `expand_sentencepiece`: learns new pieces per language with SentencePiece
  and appends them after the old ids of a BPE SentencePiece model. Only pieces
  made of the language's script are added, ranked below every old merge, so
  the old tokenizer's output on English (any text without those scripts) is
  unchanged.
- `expand_standard_vocabulary`: the Standard baseline grows its embedding
  matrix; each new row is the mean of the old embeddings of the piece's
  tokenization under the old tokenizer (the authors' mean initialisation).
- `freeze_for_continual_pretraining`: trains the encoder/embeddings, the
  decoder, the first two and last two blocks and the final norm, and freezes
  the other blocks, as the paper's continual pre-training.
"""

import io
import unicodedata

import keras
import numpy as np

SCRIPTS = {
    "ar": ("ARABIC",),
    "zh": ("CJK", "IDEOGRAPHIC"),
    "hi": ("DEVANAGARI",),
}


def _in_script(piece, prefixes):
    chars = [c for c in piece if c != "▁"]
    return (
        bool(chars)
        and any(unicodedata.name(c, "").startswith(prefixes) for c in chars)
        and all(
            unicodedata.name(c, "").startswith(prefixes)
            or not unicodedata.category(c).startswith("L")
            for c in chars
        )
    )


def expand_sentencepiece(
    proto, corpora, pieces_per_language=1000, scripts=None
):
    """Appends new pieces learned per language to a BPE SentencePiece model.

    Args:
        proto: the old model's bytes.
        corpora: `{language: list of texts}`; languages need an entry in
            `scripts` (built in: `ar`, `zh`, `hi`).
        pieces_per_language: at most this many new pieces per language.
        scripts: optional `{language: tuple of Unicode name prefixes}`.

    Returns:
        `(new_proto_bytes, new_pieces)`; new ids start at the old size.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    scripts = {**SCRIPTS, **(scripts or {})}
    model = model_pb2.ModelProto()
    model.ParseFromString(proto)
    if model.trainer_spec.model_type != model_pb2.TrainerSpec.BPE:
        raise ValueError(
            "Only BPE SentencePiece models can be expanded this way."
        )
    existing = {p.piece for p in model.pieces}
    normal = model_pb2.ModelProto.SentencePiece.NORMAL
    score = min(p.score for p in model.pieces if p.type == normal)
    new_pieces = []
    for language, texts in corpora.items():
        if language not in scripts:
            raise ValueError(
                f"No script known for language {language!r}; pass "
                "scripts={language: ('UNICODE NAME PREFIX',)}."
            )
        aux = io.BytesIO()
        distinct_characters = len(set("".join(texts)))
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=aux,
            vocab_size=pieces_per_language + distinct_characters + 10,
            model_type="bpe",
            character_coverage=0.9995,
            hard_vocab_limit=False,
            max_sentence_length=1 << 16,
            minloglevel=2,
        )
        aux_model = model_pb2.ModelProto()
        aux_model.ParseFromString(aux.getvalue())
        candidates = [
            p.piece
            for p in sorted(aux_model.pieces, key=lambda p: -p.score)
            if p.type == normal
            and p.piece not in existing
            and _in_script(p.piece, scripts[language])
        ]
        # Characters first (merges need their parts), then merges by rank.
        chars = [p for p in candidates if len(p.replace("▁", "")) == 1]
        merges = [p for p in candidates if p not in set(chars)]
        chosen = (chars + merges)[:pieces_per_language]
        for piece in chosen:
            score -= 1.0
            entry = model.pieces.add()
            entry.piece, entry.score, entry.type = piece, score, normal
            existing.add(piece)
            new_pieces.append(piece)
    return model.SerializeToString(), new_pieces


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

    from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm_preprocessor import (
        MultiHashFormerCausalLMPreprocessor,
    )

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
    for old, new in zip(backbone.weights, new_backbone.weights):
        if new is not new_backbone.token_embedding.embeddings:
            new.assign(old)
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


def freeze_for_continual_pretraining(model, trainable_blocks=2):
    """Freezes all decoder blocks but the first and last `trainable_blocks`
    (paper Sec. 4.4); the embedding/hash encoder, the decoder or tied head and
    the final norm stay trainable. Returns the frozen block indices."""
    blocks = model.backbone.transformer_layers
    keep = set(range(trainable_blocks)) | set(
        range(len(blocks) - trainable_blocks, len(blocks))
    )
    frozen = [i for i in range(len(blocks)) if i not in keep]
    for i in frozen:
        blocks[i].trainable = False
    return frozen
