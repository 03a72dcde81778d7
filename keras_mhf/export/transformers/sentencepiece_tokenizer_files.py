"""Hugging Face tokenizer files for a SentencePiece BPE tokenizer.

`tokenizer.model` alone is not enough: `transformers`' `AutoTokenizer`
then converts it with its own rules, which add no `<s>` and split some
texts differently from SentencePiece (runs of spaces, for the Mistral v0.3
model). So `tokenizer.json` is built here (with the `tokenizers` library,
no `transformers` needed) to reproduce SentencePiece exactly:

- the normalizer of the model's `normalizer_spec` (its precompiled NFKC map
  if any, extra-whitespace removal, the dummy `▁` prefix, spaces to `▁`);
- no pre-tokenizer: SentencePiece's BPE merges over the whole text;
- BPE merges ranked by the score of the merged piece (highest first), the
  order in which SentencePiece applies them; byte fallback as the model;
- `<s>` prepended (`add_bos_token`, as the Keras preprocessor does);
- control pieces (`<s>`, `</s>`, `[INST]`, ...) registered as special tokens
  but not matched inside text (`split_special_tokens`), as SentencePiece.

`tokenizer_config.json` names `PreTrainedTokenizerFast`, so `transformers`
(4.x and 5.x) uses `tokenizer.json` as it is.
"""

import json
import os
import warnings

# SentencePiece piece types (sentencepiece_model.proto).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
_BPE = 2


def _model_proto(proto):
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    return model


def tokenizer_json(proto):
    """The `tokenizers.Tokenizer` reproducing the SentencePiece BPE model
    `proto` (bytes), with `<s>` prepended.

    Example:

    ```python
    tokenizer = tokenizer_json(open("tokenizer.model", "rb").read())
    tokenizer.encode("The cell").ids  # [1, ...]
    ```
    """
    from tokenizers import AddedToken
    from tokenizers import Regex
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import normalizers
    from tokenizers import processors

    model = _model_proto(proto)
    trainer = model.trainer_spec
    if trainer.model_type != _BPE:
        raise ValueError(
            "Only SentencePiece BPE models can be exported to Hugging Face "
            f"tokenizer files; this one has model_type={trainer.model_type} "
            "(1 = unigram)."
        )
    pieces = [(p.piece, p.score, p.type) for p in model.pieces]
    vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    ranked = []
    for piece, score, kind in pieces:
        if kind not in (_NORMAL, _USER_DEFINED):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[piece], left, right))
    ranked.sort()
    merges = [(left, right) for _, _, left, right in ranked]
    unreachable = _unreachable_pieces(pieces, vocab, trainer.byte_fallback)
    if unreachable:
        warnings.warn(
            f"{len(unreachable)} piece(s) of this SentencePiece model, e.g. "
            f"{unreachable[:5]}, contain a character that is not itself a "
            "piece: SentencePiece can still form them, Hugging Face BPE "
            "cannot, so texts with them tokenize differently under "
            "transformers. Add those characters as pieces (before "
            "expanding the model's vocabulary) to export an exact tokenizer.",
            stacklevel=3,
        )
    unk = pieces[trainer.unk_id][0] if trainer.unk_id >= 0 else None
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )
    )
    spec = model.normalizer_spec
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [
            normalizers.Strip(left=True, right=True),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    steps = [decoders.Replace("▁", " ")]
    if trainer.byte_fallback:
        steps.insert(0, decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    if trainer.bos_id >= 0:
        bos = pieces[trainer.bos_id][0]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, trainer.bos_id)],
        )
    tokenizer.add_special_tokens(
        [
            AddedToken(piece, special=True, normalized=False)
            for piece, _, kind in pieces
            if kind in (_UNKNOWN, _CONTROL)
        ]
    )
    return tokenizer


def _unreachable_pieces(pieces, vocab, byte_fallback):
    """Pieces that Hugging Face BPE cannot form: SentencePiece starts from
    every character (known or not) and merges adjacent symbols whose
    concatenation is a piece; Hugging Face BPE starts from characters that
    are pieces (the rest become `<unk>` or bytes), so a piece with a
    character outside the vocabulary is out of its reach."""
    unreachable = []
    for piece, _, kind in pieces:
        if kind != _NORMAL or len(piece) == 1:
            continue
        if any(char not in vocab for char in piece):
            unreachable.append(piece)
    return unreachable


def _piece(model, index):
    return model.pieces[index].piece if index >= 0 else None


def write_tokenizer_files(proto, directory, model_max_length=None):
    """Writes `tokenizer.model`, `tokenizer.json`, `tokenizer_config.json`
    and `special_tokens_map.json` for the SentencePiece BPE model `proto`
    (bytes) into the existing `directory`.

    Example:

    ```python
    write_tokenizer_files(open("tokenizer.model", "rb").read(), "out")
    transformers.AutoTokenizer.from_pretrained("out")("The cell")
    ```
    """
    model = _model_proto(proto)
    trainer = model.trainer_spec
    tokenizer = tokenizer_json(proto)
    with open(os.path.join(directory, "tokenizer.model"), "wb") as f:
        f.write(proto)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    special = {
        "bos_token": _piece(model, trainer.bos_id),
        "eos_token": _piece(model, trainer.eos_id),
        "unk_token": _piece(model, trainer.unk_id),
        "pad_token": _piece(model, trainer.pad_id),
    }
    special = {k: v for k, v in special.items() if v is not None}
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=trainer.bos_id >= 0,
        add_eos_token=False,
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
        legacy=False,
        **special,
    )
    if model_max_length:
        config["model_max_length"] = int(model_max_length)
    for name, content in (
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", special),
    ):
        with open(os.path.join(directory, name), "w") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)
            f.write("\n")


def checkpoint_tokenizer(directory, tokenizer, tokenizer_cls):
    """The tokenizer of a Hugging Face checkpoint directory being imported.

    `tokenizer` (an instance, or a SentencePiece `.model` path) wins; else
    the directory's `tokenizer.model`, refused if the directory's
    `tokenizer.json` holds a different vocabulary (one of the two was
    replaced: the model would tokenize unlike its Hugging Face twin). With
    no `tokenizer.model`, `None` and a warning: the model is loaded without
    a tokenizer (it takes token ids).

    Example:

    ```python
    tokenizer = checkpoint_tokenizer("exported", None, MultiHashFormerTokenizer)
    ```
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer_cls(os.fspath(tokenizer))
    if tokenizer is not None:
        return tokenizer
    model_path = os.path.join(directory, "tokenizer.model")
    json_path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(model_path):
        unread = (
            " (its tokenizer.json is not read: keras_mhf tokenizers are "
            "SentencePiece models)"
            if os.path.exists(json_path)
            else ""
        )
        warnings.warn(
            f"{directory} has no tokenizer.model{unread}: the model is loaded "
            "without a tokenizer and takes token ids. Pass tokenizer= (a "
            "SentencePiece .model) to attach one.",
            stacklevel=3,
        )
        return None
    tokenizer = tokenizer_cls(model_path)
    if os.path.exists(json_path):
        _check_same_vocabulary(json_path, model_path, tokenizer.proto)
    return tokenizer


def _check_same_vocabulary(json_path, model_path, proto):
    """Raises if `tokenizer.json`'s vocabulary is not the SentencePiece
    model's (piece by piece, id by id)."""
    from tokenizers import Tokenizer

    try:
        vocabulary = Tokenizer.from_file(json_path).get_vocab()
    except Exception as error:  # the tokenizers library's own errors
        raise ValueError(
            f"{json_path} cannot be read ({error}); remove it or replace it "
            f"with the one built from {model_path}."
        ) from None
    pieces = [piece.piece for piece in _model_proto(proto).pieces]
    by_id = {index: piece for piece, index in vocabulary.items()}
    for index, piece in enumerate(pieces):
        if by_id.get(index) != piece:
            raise ValueError(
                f"{json_path} and {model_path} disagree: token {index} is "
                f"{by_id.get(index)!r} in one and {piece!r} in the other (one "
                "was replaced). keras_mhf reads tokenizer.model; Hugging Face "
                "tools read tokenizer.json. Put back the matching pair, or "
                "pass tokenizer= explicitly."
            )
    if len(by_id) > len(pieces):
        raise ValueError(
            f"{json_path} has {len(by_id)} tokens and {model_path} "
            f"{len(pieces)}: they disagree (one was replaced). Put back the "
            "matching pair, or pass tokenizer= explicitly."
        )
