"""Exact decoding by bucket-candidate search: the same tokens as the full
vocabulary scan, with greedy and top-k samplers, on random and trained
models."""

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops

from keras_mhf import SignatureTable
from keras_mhf.layers import SignatureLookup
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models.multi_hash_former import (
    multi_hash_former_decoding as decoding,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_bucket_index import (
    BucketIndex,
)
from tests.conftest import small_proto_bytes

PROMPTS = [
    "The cell",
    "Water boils",
    "Light travels",
    "An atom has",
    "Plants turn sunlight",
    "A market price",
    "Energy is",
    "The mitochondria",
]


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


def make_lm(trained, corpus=None):
    keras.utils.set_random_seed(0)
    tokenizer = MultiHashFormerTokenizer(small_proto_bytes())
    # B = 256 for 120 tokens and K = 2 buckets per head: the candidates are
    # a small part of the vocabulary, so certification can fail.
    lm = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b256", sequence_length=16, candidate_buckets=2
    )
    if trained:
        lm.compile(optimizer=keras.optimizers.AdamW(2e-2))
        lm.fit(corpus, batch_size=8, epochs=12, verbose=0)
    return lm


def generate_both(lm, sampler_factory):
    outputs = {}
    for mode in ("full", "candidates"):
        lm.decoding = mode
        lm.compile(sampler=sampler_factory())
        lm.decoding_statistics.reset()
        outputs[mode] = lm.generate(PROMPTS, max_length=14)
        outputs[mode + "_stats"] = (
            lm.decoding_statistics.steps,
            lm.decoding_statistics.fallbacks,
        )
    return outputs


@pytest.fixture(scope="module")
def trained_lm(corpus):
    """One trained model for the module (each test restores what it
    changes)."""
    return make_lm(True, corpus)


@pytest.mark.parametrize("trained", [False, True], ids=["random", "trained"])
def test_candidates_return_exactly_the_full_scan_tokens(
    trained, corpus, request
):
    lm = request.getfixturevalue("trained_lm") if trained else make_lm(False)
    for name, factory in (
        ("greedy", lambda: keras_hub.samplers.GreedySampler()),
        ("top_k", lambda: keras_hub.samplers.TopKSampler(k=3, seed=11)),
    ):
        out = generate_both(lm, factory)
        assert out["full"] == out["candidates"], name
        steps, fallbacks = out["candidates_stats"]
        assert steps > 0 and 0 <= fallbacks <= steps
        assert out["full_stats"][1] == 0
    if not trained:
        # A random model's heads are flat: the bound rarely certifies.
        assert out["candidates_stats"][1] > 0


def test_candidate_search_kernel_against_the_full_scan():
    """Directly on a 3000-token vocabulary: whenever a step is certified,
    its top-k equals the full scan's (values and ids); peaked heads make
    most steps certifiable."""
    tokens = ["<pad>"] + [f"tok{i}" for i in range(2999)]
    table = SignatureTable.from_tokens(tokens, 3, 64, pad_token_id=0)
    lookup = SignatureLookup(3000, 3, 64, 0, signatures=table)
    lookup.build()
    index = BucketIndex(3000, 3, 64)
    index.refresh(lookup)
    signatures = lookup.signatures
    rng = np.random.default_rng(0)
    certified_count = 0
    for trial in range(20):
        logits = rng.normal(size=(4, 3, 64)).astype("float32")
        target = rng.integers(1, 3000, size=4)
        # Peaked heads that agree on a target token, as trained ones do.
        sharp = 8.0 if trial % 2 else 0.0
        for row, token in enumerate(target):
            for head in range(3):
                logits[row, head, table.signatures[token, head]] += sharp
        log_probs = ops.log_softmax(ops.convert_to_tensor(logits), axis=-1)
        for k in (1, 3):
            full_values, full_ids = decoding.full_top_k(
                signatures, log_probs, k
            )
            values, ids, certified = decoding.candidate_top_k(
                signatures, index, log_probs, k, 4
            )
            if bool(to_numpy(certified)):
                certified_count += 1
                np.testing.assert_array_equal(to_numpy(ids), to_numpy(full_ids))
                np.testing.assert_array_equal(
                    to_numpy(values), to_numpy(full_values)
                )
    assert certified_count >= 10


def test_ties_go_to_the_lowest_token_id():
    scores = ops.convert_to_tensor(np.array([[1.0, 3.0, 3.0, 2.0]], "float32"))
    ids = ops.convert_to_tensor(np.array([[7, 9, 4, 1]], "int32"))
    values, chosen = decoding._top_k_lowest_id(scores, ids, 3)
    np.testing.assert_array_equal(to_numpy(chosen), [[4, 9, 1]])
    np.testing.assert_array_equal(to_numpy(values), [[3.0, 3.0, 2.0]])


def test_greedy_candidates_match_the_uncached_argmax(trained_lm):
    lm = trained_lm
    lm.decoding = "candidates"
    lm.compile(sampler="greedy")
    preprocessor = lm.preprocessor
    prompt = preprocessor.generate_preprocess(["The cell"], sequence_length=12)
    lm.preprocessor = None
    try:
        out = lm.generate(prompt, stop_token_ids=None)
        ids = to_numpy(out["token_ids"])[0]
        # One uncached, causal forward pass over the whole output: position
        # p - 1's log-probs depend only on the tokens up to p - 1.
        log_probs = to_numpy(lm.score(ids[None, :]))[0]
    finally:
        lm.preprocessor = preprocessor
    start = int(to_numpy(prompt["padding_mask"])[0].sum())
    for position in range(start, 12):
        assert ids[position] == int(np.argmax(log_probs[position - 1]))


def test_decoding_settings(tiny_lm, tmp_path):
    assert tiny_lm.decoding == "candidates"
    assert tiny_lm.get_config()["decoding"] == "candidates"
    with pytest.raises(ValueError, match="decoding must be one of"):
        MultiHashFormerCausalLM(tiny_lm.backbone, decoding="beam")
    with pytest.raises(ValueError, match="candidate_buckets"):
        MultiHashFormerCausalLM(tiny_lm.backbone, candidate_buckets=0)
    lm = MultiHashFormerCausalLM(
        tiny_lm.backbone,
        tiny_lm.preprocessor,
        decoding="full",
        candidate_buckets=5,
    )
    lm.save_to_preset(str(tmp_path / "preset"))
    restored = MultiHashFormerCausalLM.from_preset(str(tmp_path / "preset"))
    assert restored.decoding == "full" and restored.candidate_buckets == 5
    # The inverted index is rebuilt from the loaded table.
    lookup = restored.backbone.signature_lookup
    table = lookup.get_signatures()
    decoding.resolved_candidate_buckets(restored)  # refreshes the index
    for head in range(lookup.num_hashes):
        order = to_numpy(restored.bucket_index.bucket_tokens[head])
        np.testing.assert_array_equal(
            order, np.argsort(table[:, head], kind="stable")
        )


def test_failed_certificates_back_off_to_the_scan():
    """After a failed certificate the next 1, 2, 4, ... (at most 32) steps
    scan without searching; a certified search resets the backoff."""

    def run(outcomes):
        wait, streak, searched = 0, 0, []
        for step, certified in enumerate(outcomes):
            scanned = 1 if wait > 0 or not certified else 0
            if wait == 0:
                searched.append(step)
            wait, streak = to_numpy(
                decoding._next_backoff(
                    ops.convert_to_tensor(wait, "int32"),
                    ops.convert_to_tensor(streak, "int32"),
                    ops.convert_to_tensor(scanned, "int32"),
                )
            ).tolist()
        return searched

    assert run([False] * 110) == [0, 2, 5, 10, 19, 36, 69, 102]
    assert run([True] * 4) == [0, 1, 2, 3]
    # Fail twice (searches at 0 and 2), then certified from step 5 on.
    assert run([False] * 5 + [True] * 3) == [0, 2, 5, 6, 7]
