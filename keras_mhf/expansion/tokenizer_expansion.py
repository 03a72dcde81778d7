"""Vocabulary expansion (paper Sec. 4.4): new languages' tokens for a trained
model, with zero new parameters for MultiHashFormer.

- `expand_sentencepiece`: learns new pieces per language with SentencePiece
  and appends them after the old ids of a BPE SentencePiece model. Only pieces
  made of the language's script are added, ranked below every old merge, so
  the old tokenizer's output on English (any text without those scripts) is
  unchanged.
- `expand_standard_vocabulary` (from
  `keras_mhf.models.standard.standard_vocabulary`): the Standard baseline
  grows its embedding matrix; each new row is the mean of the old embeddings
  of the piece's tokenization under the old tokenizer (the authors' mean
  initialisation). MultiHashFormer grows with no new parameter:
  `MultiHashFormerCausalLM.expand_vocabulary`.
- `freeze_for_continual_pretraining`: trains the encoder/embeddings, the
  decoder, the first two and last two blocks and the final norm, and freezes
  the other blocks, as the paper's continual pre-training.
"""

import io
import unicodedata

from keras_mhf.models.standard.standard_vocabulary import (  # noqa: F401
    expand_standard_vocabulary,
)

SCRIPTS = {
    "ar": ("ARABIC",),
    "zh": ("CJK", "IDEOGRAPHIC"),
    "hi": ("DEVANAGARI",),
}


def in_script(piece, language, scripts=None):
    """Whether `piece` is made of `language`'s script (`SCRIPTS`, or
    `scripts`: `{language: Unicode name prefixes}`) and non-letters."""
    prefixes = {**SCRIPTS, **(scripts or {})}[language]
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
            and in_script(p.piece, language, scripts)
        ]
        # Characters first (merges need their parts), then merges by rank.
        chars = [p for p in candidates if len(p.replace("▁", "")) == 1]
        merges = [p for p in candidates if p not in set(chars)]
        chosen = (chars + merges)[:pieces_per_language]
        new_pieces += _add_pieces(model, chosen)
        existing.update(chosen)
    return model.SerializeToString(), new_pieces


def append_pieces(proto, pieces):
    """Appends pieces to a SentencePiece model, each scored below every
    existing piece (so old tokenizations are kept where they compete).

    Args:
        proto: the old model's bytes.
        pieces: token strings, in the order their new ids should take
            (SentencePiece spelling: `▁` for a leading space).

    Returns:
        `(new_proto_bytes, new_pieces)`; new ids start at the old size.

    Example:

    ```python
    new_proto, added = append_pieces(proto, ["▁Zürich", "▁Ωmega"])
    ```
    """
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    model = model_pb2.ModelProto()
    model.ParseFromString(proto)
    existing = {p.piece for p in model.pieces}
    pieces = list(pieces)
    if not pieces:
        raise ValueError("No pieces to append: the list is empty.")
    for piece in pieces:
        if not isinstance(piece, str) or not piece:
            raise ValueError(
                f"A piece must be a non-empty string; got {piece!r}."
            )
    repeated = sorted({p for p in pieces if p in existing})
    if repeated:
        raise ValueError(
            f"{len(repeated)} of the pieces are already in the tokenizer "
            f"(e.g. {repeated[:3]}); list only new pieces."
        )
    if len(set(pieces)) != len(pieces):
        raise ValueError("The pieces to append repeat; list each once.")
    _add_pieces(model, pieces)
    return model.SerializeToString(), pieces


def _add_pieces(model, pieces):
    """Adds `pieces` to a `ModelProto` as normal pieces, each scored 1 below
    the lowest normal piece so far; returns them."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    normal = model_pb2.ModelProto.SentencePiece.NORMAL
    score = min(p.score for p in model.pieces if p.type == normal)
    for piece in pieces:
        score -= 1.0
        entry = model.pieces.add()
        entry.piece, entry.score, entry.type = piece, score, normal
    return list(pieces)


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
