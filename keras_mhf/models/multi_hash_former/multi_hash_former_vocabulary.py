"""The vocabulary side of a `MultiHashFormerCausalLM`: the signature table of a
new model (paper Sec. 3.1), the check that a tokenizer belongs to a model, and
vocabulary expansion without new parameters (Sec. 4.4).

The task's `from_tokens`, `from_tokenizer`, `check_tokenizer` and
`expand_vocabulary` are thin wrappers over these functions.
"""

import functools
import hashlib
import json

import numpy as np

from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    parse_architecture,
)
from keras_mhf.signatures.signature_table import SignatureTable
from keras_mhf.utils.keras_utils import argument_names
from keras_mhf.utils.keras_utils import copy_weights_by_path


def build_backbone(
    backbone_cls,
    tokens,
    architecture,
    pad_token_id=None,
    signature_rule="unique",
    dtype=None,
    **backbone_kwargs,
):
    """A new, randomly initialised backbone whose signature table is built
    from `tokens` (token id = position) with the architecture's `H` and `B`.

    Args:
        backbone_cls: `MultiHashFormerBackbone` (or a subclass).
        tokens: list of token strings.
        architecture: a name like `"tiny_h3b512"` or, with LSH heads,
            `"mini_h4b16384_lsh1"` (see
            `keras_mhf.models.architecture_names()`).
        pad_token_id: the token with the all-zero signature.
        signature_rule: `"unique"`, `"reference"` or `"repeated"`.
        dtype: dtype policy.
        **backbone_kwargs: overrides of any backbone argument (e.g.
            `num_lsh=1`).
    """
    trunk, hashes = parse_architecture(architecture)
    if hashes is None:
        raise ValueError(
            f"Architecture {architecture!r} names a Standard trunk; use "
            "`keras_mhf.models.standard.standard_causal_lm` for it, or add a hash "
            "configuration such as '_h4b16k'."
        )
    config = {**trunk, **hashes, **backbone_kwargs}
    table = SignatureTable.from_tokens(
        tokens,
        config["num_hashes"],
        config["num_buckets"],
        pad_token_id=pad_token_id,
        rule=signature_rule,
        num_lsh=config.get("num_lsh", 0),
    )
    return backbone_cls(
        vocabulary_size=len(table),
        pad_token_id=pad_token_id,
        signature_rule=signature_rule,
        signatures=table,
        dtype=dtype,
        **config,
    )


def causal_lm_from_tokens(
    task_cls,
    tokens,
    architecture,
    pad_token_id=None,
    signature_rule="unique",
    dtype=None,
    **kwargs,
):
    """See `MultiHashFormerCausalLM.from_tokens`: `kwargs` holds backbone
    overrides and the task's own arguments (`scoring_temperature`, ...)."""
    task_names = set(argument_names(task_cls)) - {"backbone", "preprocessor"}
    task_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in task_names}
    backbone = build_backbone(
        task_cls.backbone_cls,
        tokens,
        architecture,
        pad_token_id=pad_token_id,
        signature_rule=signature_rule,
        dtype=dtype,
        **kwargs,
    )
    return task_cls(backbone=backbone, preprocessor=None, **task_kwargs)


def causal_lm_from_tokenizer(
    task_cls, tokenizer, architecture, sequence_length, **kwargs
):
    """See `MultiHashFormerCausalLM.from_tokenizer`."""
    # The model records how its tokenizer tokenizes (check_tokenizer).
    fingerprint = tokenization_fingerprint(tokenizer)
    kwargs.setdefault("tokenization_fingerprint", fingerprint)
    model = causal_lm_from_tokens(
        task_cls,
        tokenizer.get_vocabulary(),
        architecture,
        pad_token_id=tokenizer.signature_pad_token_id,
        **kwargs,
    )
    model.preprocessor = task_cls.preprocessor_cls(
        tokenizer, sequence_length=sequence_length
    )
    # The table was just hashed from this tokenizer's vocabulary.
    model.verified_tokenizer = fingerprint
    return model


def check_task_tokenizer(lm, force=False):
    """See `MultiHashFormerCausalLM.check_tokenizer`."""
    tokenizer = getattr(lm.preprocessor, "tokenizer", None)
    if tokenizer is None:
        return
    fingerprint = tokenization_fingerprint(tokenizer)
    if fingerprint is None or (
        fingerprint == lm.verified_tokenizer and not force
    ):
        return
    check_tokenizer(lm.backbone, tokenizer)
    lm.verified_tokenizer = fingerprint


# What a SentencePiece model's encoder and decoder read, besides its pieces.
# Fixed lists (not "every field"), so that a sentencepiece release that adds
# trainer options gives the same fingerprint for the same model file.
_SENTENCEPIECE_TRAINER_FIELDS = (
    "model_type",
    "byte_fallback",
    "treat_whitespace_as_suffix",
    "allow_whitespace_only_pieces",
    "split_by_whitespace",
    "split_by_number",
    "split_by_unicode_script",
    "split_digits",
    "unk_id",
    "bos_id",
    "eos_id",
    "pad_id",
    "unk_surface",
)
_SENTENCEPIECE_NORMALIZER_FIELDS = (
    "name",
    "precompiled_charsmap",
    "add_dummy_prefix",
    "remove_extra_whitespaces",
    "escape_whitespaces",
    "normalization_rule_tsv",
)


def tokenization_fingerprint(tokenizer):
    """sha256 of everything that decides how a tokenizer maps text to ids.

    For a SentencePiece tokenizer (a `.proto`, or the model's bytes): every
    piece's string, score (the merge order of BPE, the unigram
    log-probability) and type (normal, control, byte, unused, ...), the
    normalizer and denormalizer specs, and the encoder's options (model type,
    byte fallback, whitespace handling, special ids). Not the trainer's other
    options (input files, sizes, seeds, threads), which only steer training,
    and not the file's bytes: re-saving a model gives the same fingerprint.
    For other tokenizers: the vocabulary strings and, if the tokenizer has
    them, its BPE merges. `None` for a tokenizer without a vocabulary.

    A model records the fingerprint of the tokenizer it was built for
    (`MultiHashFormerBackbone(tokenization_fingerprint=...)`); the task's
    `check_tokenizer` refuses a tokenizer whose fingerprint differs.

    Args:
        tokenizer: a `MultiHashFormerTokenizer` (or any KerasHub tokenizer),
            or the bytes of a SentencePiece model.

    Returns:
        A 64-character hex string, or `None`.

    Example:

    ```python
    tokenizer = keras_mhf.models.MultiHashFormerTokenizer("tokenizer.model")
    tokenization_fingerprint(tokenizer)[:16]
    ```
    """
    proto = tokenizer
    if not isinstance(proto, (bytes, bytearray)):
        proto = getattr(tokenizer, "proto", None)
    if isinstance(proto, (bytes, bytearray)):
        return _sentencepiece_fingerprint(bytes(proto))
    try:
        vocabulary = tokenizer.get_vocabulary()
    except (AttributeError, ValueError, TypeError):
        return None
    if vocabulary is None:
        return None
    content = {"format": "vocabulary-v1", "pieces": list(vocabulary)}
    merges = getattr(tokenizer, "merges", None)
    if merges is not None:
        content["merges"] = list(merges)
    return _sha256_of(content)


def _sha256_of(content):
    text = json.dumps(
        content, sort_keys=True, ensure_ascii=False, separators=(",", ":")
    )
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@functools.lru_cache(maxsize=16)
def _sentencepiece_fingerprint(proto):
    # Cached: the task checks its tokenizer on every fit/generate/score call
    # (bytes cache their hash, so a hit costs nothing).
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    try:
        model.ParseFromString(proto)
    except Exception as error:  # protobuf's DecodeError
        raise ValueError(
            f"The tokenizer's SentencePiece model cannot be parsed: {error}"
        ) from error

    def fields(spec, names):
        values = {}
        for name in names:
            value = getattr(spec, name)
            values[name] = value.hex() if isinstance(value, bytes) else value
        return values

    denormalizer = None
    if model.HasField("denormalizer_spec"):
        denormalizer = fields(
            model.denormalizer_spec, _SENTENCEPIECE_NORMALIZER_FIELDS
        )
    return _sha256_of(
        {
            "format": "sentencepiece-v1",
            "trainer": fields(
                model.trainer_spec, _SENTENCEPIECE_TRAINER_FIELDS
            ),
            "normalizer": fields(
                model.normalizer_spec, _SENTENCEPIECE_NORMALIZER_FIELDS
            ),
            "denormalizer": denormalizer,
            "pieces": [[p.piece, p.score, p.type] for p in model.pieces],
        }
    )


def check_tokenizer(backbone, tokenizer):
    """Raises a clear `ValueError` if `tokenizer`'s vocabulary does not hash
    to `backbone`'s stored signature table (same size, same rows), or if the
    backbone records a `tokenization_fingerprint` and the tokenizer's
    differs (same pieces, but other scores, types or normalizer)."""
    vocabulary = tokenizer.get_vocabulary()
    if len(vocabulary) != backbone.vocabulary_size:
        raise ValueError(
            f"The tokenizer has {len(vocabulary)} tokens but the model's "
            f"signature table has {backbone.vocabulary_size} rows: they do not "
            "belong together. Attach the tokenizer the model was trained "
            "with, or call `expand_vocabulary` with the new tokens."
        )
    stored = backbone.signature_lookup.get_signatures()
    try:
        expected = SignatureTable.from_tokens(
            vocabulary,
            backbone.num_hashes,
            backbone.num_buckets,
            backbone.pad_token_id,
            backbone.signature_rule,
            num_lsh=getattr(backbone, "num_lsh", 0),
        ).signatures
    except ValueError as error:
        raise ValueError(
            f"The tokenizer's vocabulary cannot be hashed with the model's "
            f"settings: {error}"
        ) from error
    if not np.array_equal(stored, expected):
        rows = np.nonzero(np.any(stored != expected, axis=1))[0]
        raise ValueError(
            f"The tokenizer does not match the model's signature table: "
            f"{len(rows)} of {len(stored)} token(s) hash differently (e.g. "
            f"id {rows[0]} {vocabulary[rows[0]]!r}: model "
            f"{tuple(stored[rows[0]].tolist())}, tokenizer "
            f"{tuple(expected[rows[0]].tolist())}). The model would read "
            "the wrong embeddings; attach the tokenizer it was trained with."
        )
    recorded = getattr(backbone, "tokenization_fingerprint", None)
    found = tokenization_fingerprint(tokenizer)
    if recorded is not None and found is not None and found != recorded:
        raise ValueError(
            "The tokenizer has the model's pieces (they hash to its "
            "signature table) but tokenizes differently from the tokenizer "
            "the model was built for: its tokenization fingerprint is "
            f"{found[:16]}..., the model records {recorded[:16]}... . Its "
            "piece scores (the merge order), piece types or normalizer "
            "differ, so the same text would become other ids than the model "
            "was trained on. Attach the model's own tokenizer (e.g. the one "
            "in its preset)."
        )


def expand_vocabulary(lm, new_tokens=None, tokenizer=None):
    """See `MultiHashFormerCausalLM.expand_vocabulary`."""
    backbone = lm.backbone
    old_tokenizer = getattr(lm.preprocessor, "tokenizer", None)
    if old_tokenizer is not None:
        old_vocabulary = old_tokenizer.get_vocabulary()
    elif tokenizer is not None:
        old_vocabulary = tokenizer.get_vocabulary()[: backbone.vocabulary_size]
    else:
        raise ValueError(
            "expand_vocabulary needs the old token strings: attach the "
            "model's tokenizer (preprocessor) or pass the expanded `tokenizer`."
        )
    if isinstance(new_tokens, (str, bytes)):
        raise ValueError(
            f"`new_tokens` must be a list of token strings; got the single "
            f"string {new_tokens!r}. Pass [{new_tokens!r}] to add it as one "
            "token."
        )
    if tokenizer is not None:
        vocabulary = tokenizer.get_vocabulary()
        if vocabulary[: len(old_vocabulary)] != old_vocabulary:
            raise ValueError(
                "The new tokenizer does not start with the model's vocabulary: "
                "old ids must keep their pieces. Append new pieces after the "
                "old ones."
            )
        if (
            new_tokens is not None
            and list(new_tokens) != vocabulary[len(old_vocabulary) :]
        ):
            raise ValueError(
                "`new_tokens` differs from the tokenizer's new pieces."
            )
        new_tokens = vocabulary[len(old_vocabulary) :]
    if not new_tokens:
        raise ValueError("No new tokens to add.")
    old_table = backbone.get_signature_table(tokens=old_vocabulary)
    new_table = old_table.expand(list(new_tokens))
    config = backbone.get_config()
    config.update(
        vocabulary_size=len(new_table),
        signatures=new_table,
        # The new tokenizer's (without one, no tokenizer is known yet).
        tokenization_fingerprint=(
            None if tokenizer is None else tokenization_fingerprint(tokenizer)
        ),
    )
    new_backbone = type(backbone).from_config(config)
    # With only `new_tokens`, no tokenizer can produce the new ids: the
    # returned model has no preprocessor until one is attached.
    preprocessor = None
    if tokenizer is not None:
        old = lm.preprocessor
        preprocessor = type(lm).preprocessor_cls(
            tokenizer,
            sequence_length=old.sequence_length if old else 1024,
            add_start_token=old.add_start_token if old else True,
            add_end_token=old.add_end_token if old else True,
        )
    expanded = type(lm)(new_backbone, preprocessor, **_task_arguments(lm))
    # The table (and the index derived from it) is new; every other weight
    # is copied.
    copy_weights_by_path(
        lm,
        expanded,
        skip=new_backbone.signature_lookup.weights
        + expanded.bucket_index.weights,
    )
    return expanded


def _task_arguments(lm):
    """The task's own constructor arguments (beyond backbone/preprocessor)."""
    config = lm.get_config()
    for key in ("backbone", "preprocessor", "name", "trainable", "dtype"):
        config.pop(key, None)
    return config
