"""Writes the keras_mhf 0.1 artifacts in this folder, with 0.1's own code.

Runnable ONLY against a checkout of keras_mhf 0.1 (commit 5f323dd, main as
of 2026-12-01, before the LSH heads, the tokenization fingerprint and the
family-folder redesign); with the current package it refuses to run, since
what it writes must be what 0.1 saved. From the repository root:

    git worktree add /tmp/legacy01 5f323dd
    cd /tmp/legacy01 && KERAS_BACKEND=jax PYTHONPATH=/tmp/legacy01 python \\
        <repo>/tests/testdata/legacy_v0_1/make_legacy_v0_1.py \\
        --data <repo>/tests/testdata/openstax_edu_en \\
        --output <repo>/tests/testdata/legacy_v0_1
    git worktree remove /tmp/legacy01

(the current directory is put first on `sys.path`, so the checkout's
package wins over an installed one).

Everything through 0.1's public API, under KERAS_BACKEND=jax, random seed 0,
as the original artifacts were made (keras 3.15.1, keras-hub 0.32.0), except
for their size: a 512-piece SentencePiece model (byte-fallback BPE, Mistral's
identity normalizer) trained on the lines of the first 16 documents of
openstax_edu_en/train_00.jsonl replaces the 32,768-piece Mistral tokenizer;
an MHF `tiny_h4b64` (64 buckets instead of 1024), sequence length 32,
trained 1 epoch on the same 16 documents (batch 8, plain SGD 0.05 instead of
AdamW, so the `.keras` file holds no per-weight optimizer state),
`scoring_temperature` set to 2.5, saved as a preset and as a `.keras` file;
a Standard `tiny` model (untrained) saved as a preset; and what the current
code must reproduce: `mhf_expected.npz` (`token_ids`, `padding_mask`: the
preprocessor's output for documents 0-1; `log_probs`: `score()` over the
first 64 vocabulary ids; `log_probs_rows`: each next token's log-prob) and
`standard_expected.npz` (`log_probs_rows` of the Standard model's raw
logits for the same inputs). Rerunning gives the same weights and `.npz`
files (only the save dates differ).
"""

import argparse
import inspect
import json
import os
import shutil
import sys

sys.path.insert(0, os.getcwd())  # the 0.1 checkout wins over an install

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_mhf  # noqa: E402

DOCUMENTS = 16
VOCABULARY_SIZE = 512
ARCHITECTURE = "tiny_h4b64"


def require_0_1():
    """Refuses to run on any package but 0.1's (flat model modules, no
    `num_lsh`, no `tokenization_fingerprint`)."""
    try:
        from keras_mhf.models import multi_hash_former_backbone
    except ImportError:
        multi_hash_former_backbone = None
    if multi_hash_former_backbone is not None:
        parameters = inspect.signature(
            multi_hash_former_backbone.MultiHashFormerBackbone.__init__
        ).parameters
    if multi_hash_former_backbone is None or (
        {"num_lsh", "tokenization_fingerprint"} & set(parameters)
    ):
        sys.exit(
            f"{keras_mhf.__file__} is not keras_mhf 0.1 (commit 5f323dd): "
            "run this script from a checkout of that commit."
        )
    if keras.config.backend() != "jax":
        sys.exit("Run with KERAS_BACKEND=jax.")


def small_tokenizer(texts):
    """A 512-piece byte-fallback BPE model of the documents' lines, with
    Mistral's normalizer (identity: no 240 KB NFKC table in the model file)
    and special ids (`<unk>`, `<s>`, `</s>` = 0-2); one thread, so the same
    lines give the same bytes."""
    import io

    import sentencepiece as spm

    lines = [line for text in texts for line in text.split("\n") if line]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=VOCABULARY_SIZE,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def next_token_rows(scores, token_ids):
    """Each position's entry for the next token (0 at the last position)."""
    targets = np.concatenate(
        [token_ids[:, 1:], np.zeros_like(token_ids[:, :1])], axis=1
    )
    return np.take_along_axis(scores, targets[..., None], -1)[..., 0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="openstax_edu_en/")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    require_0_1()

    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import MultiHashFormerTokenizer
    from keras_mhf.models import standard_causal_lm

    with open(os.path.join(args.data, "train_00.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][:DOCUMENTS]
    out = args.output
    os.makedirs(out, exist_ok=True)
    for name in (
        f"mhf_{ARCHITECTURE}_preset",
        "standard_tiny_preset",
        f"mhf_{ARCHITECTURE}.keras",
    ):
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    tokenizer = MultiHashFormerTokenizer(small_tokenizer(texts))

    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, architecture=ARCHITECTURE, sequence_length=32
    )
    # Plain SGD: no per-weight optimizer state, so the .keras file (which
    # holds the optimizer) stays as small as the preset.
    lm.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05))
    lm.fit(texts, batch_size=8, epochs=1)
    lm.scoring_temperature = 2.5
    lm.save_to_preset(os.path.join(out, f"mhf_{ARCHITECTURE}_preset"))
    lm.save(os.path.join(out, f"mhf_{ARCHITECTURE}.keras"))

    x, _, _ = lm.preprocessor(texts[:2])
    token_ids = np.asarray(ops.convert_to_numpy(x["token_ids"]), "int32")
    padding_mask = np.asarray(ops.convert_to_numpy(x["padding_mask"]), bool)
    log_probs = np.asarray(
        ops.convert_to_numpy(lm.score(token_ids, padding_mask)), "float32"
    )
    np.savez(
        os.path.join(out, "mhf_expected.npz"),
        token_ids=token_ids,
        padding_mask=padding_mask,
        log_probs=log_probs[..., :64],
        log_probs_rows=next_token_rows(log_probs, token_ids),
    )

    keras.utils.set_random_seed(0)
    standard = standard_causal_lm(tokenizer, architecture="tiny")
    standard.save_to_preset(os.path.join(out, "standard_tiny_preset"))
    # The Standard model's `score` returns KerasHub's raw logits.
    logits = np.asarray(
        ops.convert_to_numpy(standard.score(token_ids, padding_mask)),
        "float32",
    )
    np.savez(
        os.path.join(out, "standard_expected.npz"),
        log_probs_rows=next_token_rows(logits, token_ids),
    )
    print(f"keras_mhf {keras_mhf.__version__} from {keras_mhf.__file__}")


if __name__ == "__main__":
    main()
