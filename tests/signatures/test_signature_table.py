import time

import mmh3
import numpy as np
import pytest

from keras_mhf import SignatureTable


def bucket(token, seed, num_buckets):
    return (
        mmh3.hash128(token, seed=seed, x64arch=True, signed=False)
        % (num_buckets - 1)
        + 1
    )


def test_formula_on_fresh_tokens():
    tokens = ["<pad>", "▁the", "<0x0A>", "[INST]", "猫"]
    table = SignatureTable.from_tokens(
        tokens, num_hashes=3, num_buckets=1000, pad_token_id=0
    )
    assert table.signatures.dtype == np.int32
    assert table[0] == (0, 0, 0)
    for v, token in enumerate(tokens[1:], start=1):
        assert table[v] == tuple(bucket(token, s, 1000) for s in range(3))


def test_hand_traced_rules_differ():
    # B=4 (real buckets 1..3), H=2. Buckets by seed, from mmh3:
    #   a: seed0 -> 3, seed1 -> 3
    #   c: seed0 -> 3, seed1 -> 1
    #   d: seed0 -> 3, seed1 -> 3, seed2 -> 3, seed3 -> 1, seed4 -> 2
    assert [bucket("a", s, 4) for s in (0, 1)] == [3, 3]
    assert [bucket("c", s, 4) for s in (0, 1)] == [3, 1]
    assert [bucket("d", s, 4) for s in range(5)] == [3, 3, 3, 1, 2]
    tokens = ["a", "c", "d"]
    # "reference": d is compared only with c (the latest token under prefix
    # (3,)), so it keeps (3, 3) and duplicates a.
    ref = SignatureTable.from_tokens(tokens, 2, 4, rule="reference")
    assert ref.signatures.tolist() == [[3, 3], [3, 1], [3, 3]]
    assert ref.statistics()["duplicate_tokens"] == 1
    # "unique": d's (3, 3) and (3, 1) are taken; seeds 2 and 3 give taken
    # buckets, seed 4 gives the free bucket 2.
    uni = SignatureTable.from_tokens(tokens, 2, 4, rule="unique")
    assert uni.signatures.tolist() == [[3, 3], [3, 1], [3, 2]]
    assert uni.statistics()["duplicate_tokens"] == 0


def test_reference_pad_overwrites_single_hash_state():
    # H=1: the prefix is () for every token, and the authors' code also
    # stores the pad token under it.
    tokens = [f"w{i}" for i in range(50)]
    table = SignatureTable.from_tokens(
        tokens, 1, 5, pad_token_id=3, rule="reference"
    )
    assert table[3] == (0,)
    # Token 4 is compared with the pad's stored bucket 0, so never re-hashed.
    assert table[4] == (bucket("w4", 0, 5),)


@pytest.mark.parametrize("rule", ["unique", "reference"])
def test_mistral_vectors(mistral_pieces, rule):
    h4 = SignatureTable.from_tokens(
        mistral_pieces, 4, 16384, pad_token_id=2, rule=rule
    )
    assert mistral_pieces[1040] == "▁the"
    assert h4[1040] == (13955, 885, 4162, 1526)
    assert h4[1] == (1846, 11923, 6888, 4729)
    assert h4[2] == (0, 0, 0, 0)
    h3 = SignatureTable.from_tokens(
        mistral_pieces, 3, 4096, pad_token_id=2, rule=rule
    )
    assert mistral_pieces[28845] == "▁alto"
    assert h3[28845] == (1356, 630, 3594)
    # One re-hash: seed 2 gave a taken bucket, seed 3 gives 3594.
    assert bucket("▁alto", 2, 4096) != 3594 and bucket("▁alto", 3, 4096) == 3594


def test_released_configs_identical_under_both_rules(mistral_pieces):
    for h, b in [(3, 10624), (4, 16384)]:
        ref = SignatureTable.from_tokens(mistral_pieces, h, b, 2, "reference")
        uni = SignatureTable.from_tokens(mistral_pieces, h, b, 2, "unique")
        assert ref.fingerprint == uni.fingerprint
        assert uni.statistics()["duplicate_tokens"] == 0


def test_single_hash_reference_is_many_to_one(mistral_pieces):
    # The authors' H1 ablations (paper Table 3) collapse the vocabulary.
    distinct = [
        SignatureTable.from_tokens(
            mistral_pieces, 1, b, 2, "reference"
        ).statistics()["distinct_signatures"]
        for b in (4096, 8192, 16384)
    ]
    assert distinct == [4092, 8044, 14133]
    with pytest.raises(ValueError, match="capacity"):
        SignatureTable.from_tokens(mistral_pieces, 1, 4096, 2, "unique")


def test_expansion_keeps_old_rows():
    old = [f"old{i}" for i in range(300)]
    new = [f"new{i}" for i in range(200)]
    for rule in ("unique", "reference"):
        base = SignatureTable.from_tokens(old, 2, 40, pad_token_id=0, rule=rule)
        grown = base.expand(new)
        full = SignatureTable.from_tokens(
            old + new, 2, 40, pad_token_id=0, rule=rule
        )
        np.testing.assert_array_equal(grown.signatures[:300], base.signatures)
        np.testing.assert_array_equal(grown.signatures, full.signatures)
        assert len(grown) == 500 and len(base) == 300
    with pytest.raises(ValueError, match="already in the vocabulary"):
        base.expand(["old3"])


def test_fingerprint_is_stable():
    tokens = ["x", "y", "z"]
    a = SignatureTable.from_tokens(tokens, 2, 64)
    b = SignatureTable.from_tokens(tokens, 2, 64)
    c = SignatureTable.from_tokens(tokens, 2, 65)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert len(a.fingerprint) == 64


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokens=[]), "empty"),
        (dict(tokens=["a", "b", "a"]), "duplicate"),
        (dict(num_hashes=0), "num_hashes"),
        (dict(num_buckets=1), "num_buckets"),
        (dict(pad_token_id=3), "pad_token_id"),
        (dict(rule="mine"), "rule"),
        (
            dict(
                tokens=[f"t{i}" for i in range(20)], num_hashes=2, num_buckets=4
            ),
            "capacity",
        ),
    ],
)
def test_bad_input_is_refused(kwargs, message):
    args = dict(
        tokens=["a", "b", "c"], num_hashes=2, num_buckets=16, pad_token_id=None
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        SignatureTable.from_tokens(
            args["tokens"],
            args["num_hashes"],
            args["num_buckets"],
            args["pad_token_id"],
            args.get("rule", "unique"),
        )


def test_full_prefix_fails_fast():
    # Capacity (B-1)^H = 9 holds 4 tokens, but only the last head is re-hashed:
    # four tokens sharing the first bucket cannot all be unique under B-1 = 3
    # last-head buckets, and the build must say so at once, not loop.
    tokens = [t for t in (f"t{i}" for i in range(100)) if bucket(t, 0, 4) == 1][
        :4
    ]
    start = time.time()
    with pytest.raises(ValueError, match="prefix"):
        SignatureTable.from_tokens(tokens, 2, 4)
    assert time.time() - start < 5


def test_statistics():
    table = SignatureTable.from_tokens(
        [f"t{i}" for i in range(100)], 2, 32, pad_token_id=0
    )
    stats = table.statistics()
    assert stats["capacity"] == 31**2
    assert stats["distinct_signatures"] == 99
    assert stats["duplicate_tokens"] == 0
    assert 0 < stats["load"] < 1
    assert len(stats["bucket_usage"]) == 2


def test_256k_vocabulary_is_fast():
    tokens = [f"piece{i}" for i in range(256_000)]
    start = time.time()
    table = SignatureTable.from_tokens(tokens, 4, 16384, pad_token_id=0)
    elapsed = time.time() - start
    assert table.signatures.shape == (256_000, 4)
    assert elapsed < 5, f"building took {elapsed:.2f}s"


def test_repeated_rule_is_the_single_hash_table_in_every_head():
    tokens = [f"w{i}" for i in range(60)]
    single = SignatureTable.from_tokens(
        tokens, 1, 16, pad_token_id=2, rule="reference"
    )
    repeated = SignatureTable.from_tokens(
        tokens, 4, 16, pad_token_id=2, rule="repeated"
    )
    np.testing.assert_array_equal(
        repeated.signatures, np.tile(single.signatures, (1, 4))
    )
    grown = SignatureTable.from_tokens(
        tokens[:40], 4, 16, pad_token_id=2, rule="repeated"
    )
    np.testing.assert_array_equal(
        grown.expand(tokens[40:]).signatures, repeated.signatures
    )


@pytest.mark.parametrize("bad", ["\ud800", "ok\udfffok"])
def test_lone_surrogates_are_refused_not_crashed(bad):
    """mmh3 segfaults on strings without a UTF-8 encoding: refuse them."""
    with pytest.raises(ValueError, match="not valid Unicode text"):
        SignatureTable.from_tokens(["<pad>", "a", bad], 2, 16, pad_token_id=0)
    table = SignatureTable.from_tokens(["<pad>", "a"], 2, 16, pad_token_id=0)
    with pytest.raises(ValueError, match="not valid Unicode text"):
        table.expand([bad])


def test_bucket_ids_must_fit_int32():
    with pytest.raises(ValueError, match="int32"):
        SignatureTable.from_tokens(["a", "b"], 2, 2**31 + 7)


def test_a_bare_string_is_not_a_token_list():
    table = SignatureTable.from_tokens(["<pad>", "a"], 2, 16, pad_token_id=0)
    with pytest.raises(ValueError, match="list of token strings"):
        table.expand("ΩЖ")
