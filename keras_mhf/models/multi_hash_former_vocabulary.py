"""The vocabulary side of a `MultiHashFormerCausalLM`: the signature table of a
new model (paper Sec. 3.1), the check that a tokenizer belongs to a model, and
vocabulary expansion without new parameters (Sec. 4.4).

The task's `from_tokens`, `from_tokenizer`, `check_tokenizer` and
`expand_vocabulary` are thin wrappers over these functions.
"""

import hashlib

import numpy as np

from keras_mhf.models.multi_hash_former_architectures import parse_architecture
from keras_mhf.signature_table import SignatureTable
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
            "`keras_mhf.models.standard_causal_lm` for it, or add a hash "
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


def tokenizer_fingerprint(tokenizer):
    """sha256 of a tokenizer's model (its SentencePiece proto), or of its
    vocabulary strings when it has no proto; `None` without a vocabulary."""
    proto = getattr(tokenizer, "proto", None)
    if isinstance(proto, bytes):
        return hashlib.sha256(proto).hexdigest()
    try:
        vocabulary = tokenizer.get_vocabulary()
    except (AttributeError, ValueError, TypeError):
        return None
    if vocabulary is None:
        return None
    return hashlib.sha256(
        "\n".join(vocabulary).encode("utf-8", "surrogatepass")
    ).hexdigest()


def check_tokenizer(backbone, tokenizer):
    """Raises a clear `ValueError` if `tokenizer`'s vocabulary does not hash
    to `backbone`'s stored signature table (same size, same rows)."""
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
    config.update(vocabulary_size=len(new_table), signatures=new_table)
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
    # The table (and its inverted index) is new; every other weight is copied.
    copy_weights_by_path(
        lm, expanded, skip=new_backbone.signature_lookup.weights
    )
    return expanded


def _task_arguments(lm):
    """The task's own constructor arguments (beyond backbone/preprocessor)."""
    config = lm.get_config()
    for key in ("backbone", "preprocessor", "name", "trainable", "dtype"):
        config.pop(key, None)
    return config
