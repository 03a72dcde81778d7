"""LSH heads (`num_lsh > 0`): the authors' ablation tables, bit for bit.

`reference_hash_map` below is a direct, token-by-token re-statement of the
authors' `initialize_hash_map` (GitHub HUIYINXUE/MHF, `modeling_qwen3.py`;
authors_code_notes.md Sec. 1.3, 1.5, 1.7), written for this test: it shares
no code with `keras_mhf.signatures.signature_lsh`, which batches stage 2 and recomputes
only near-ties one token at a time.
"""

import collections

import mmh3
import numpy as np
import pytest

from keras_mhf import SignatureTable

torch = pytest.importorskip("torch")


def _mmh3_bucket(text, seed, modulus):
    return mmh3.hash128(text, seed=seed, x64arch=True, signed=False) % modulus


def reference_hash_map(tokens, num_hashes, num_buckets, num_lsh, pad_id):
    """The authors' hash_map for `tokens`, one token at a time."""
    gen = torch.Generator()
    gen.manual_seed(3407)
    p1 = torch.randn((16000, num_lsh, 512), generator=gen)
    gen = torch.Generator()
    gen.manual_seed(3408)
    p2 = torch.randn((512 * num_lsh, num_lsh, num_buckets - 1), generator=gen)
    p2 = torch.nn.functional.normalize(p2, dim=-1)
    memory = {}  # prefix -> {token: last bucket}; one entry, as theirs
    table = []
    for i, tok in enumerate(tokens):
        signature = []
        if i == pad_id:
            signature += [0] * num_lsh
        else:
            if len(tok) < 3:
                grams = collections.Counter([tok])
            else:
                grams = collections.Counter(
                    [tok[a : a + 3] for a in range(len(tok) - 2)]
                )
            freq = torch.tensor([list(grams.values())], dtype=torch.float32)
            parts = []
            for j in range(num_lsh):
                rows = [_mmh3_bucket(g, j, 16000) for g in grams]
                out = freq @ p1[:, j, :][rows]
                out[out >= 0] = 1.0 * 512**-0.5
                out[out < 0] = -1.0 * 512**-0.5
                parts.append(out)
            x = torch.cat(parts, dim=-1)
            for j in range(num_lsh):
                signature.append(int((x @ p2[:, j, :]).argmax(dim=-1)) + 1)
        for j in range(num_lsh, num_hashes - 1):
            signature.append(
                0 if i == pad_id else _mmh3_bucket(tok, j, num_buckets - 1) + 1
            )
        if num_hashes != num_lsh:
            prefix = tuple(signature)
            seed = num_hashes - 1
            if i == pad_id:
                last = 0
            else:
                last = _mmh3_bucket(tok, seed, num_buckets - 1) + 1
                if prefix in memory:
                    r = 0
                    while last in memory[prefix].values():
                        r += 1
                        last = _mmh3_bucket(tok, seed + r, num_buckets - 1) + 1
            memory[prefix] = {tok: last}
            signature.append(last)
        table.append(signature)
    return np.array(table, "int64")


def synthetic_tokens():
    """Short, long, repeated-trigram, non-ASCII and look-alike strings."""
    words = ["▁the", "▁then", "▁theme", "the", "▁The", "abab", "baba"]
    words += ["a", "ab", "", "aaaa", "aaaaaaa", "▁données", "猫", "猫猫猫"]
    words += ["<0x0A>", "[INST]", "<s>", "▁internationalisation"]
    words += [f"▁w{i}rd" for i in range(40)] + [f"x{i:03d}y" for i in range(40)]
    return words


@pytest.fixture(scope="module")
def mistral_slice(mistral_pieces):
    # Control and byte pieces, then a stride through the BPE pieces.
    return mistral_pieces[:120] + mistral_pieces[120::110]


@pytest.mark.parametrize(
    "num_hashes, num_buckets, num_lsh",
    [(4, 512, 1), (3, 64, 2), (2, 16, 1), (2, 40, 2)],
)
def test_synthetic_tokens_equal_the_reference(num_hashes, num_buckets, num_lsh):
    tokens = ["<pad>"] + synthetic_tokens()
    table = SignatureTable.from_tokens(
        tokens,
        num_hashes,
        num_buckets,
        pad_token_id=0,
        rule="reference",
        num_lsh=num_lsh,
    )
    expected = reference_hash_map(tokens, num_hashes, num_buckets, num_lsh, 0)
    np.testing.assert_array_equal(table.signatures, expected)
    assert table[0] == (0,) * num_hashes
    assert table.signatures[1:, :num_lsh].min() >= 1


def test_mistral_pieces_equal_the_reference(mistral_slice):
    # H4 B16384 with one LSH head: the replicated ablation's table. The pad
    # is `</s>` (id 2), as in the authors' runs.
    table = SignatureTable.from_tokens(
        mistral_slice, 4, 16384, 2, "reference", num_lsh=1
    )
    expected = reference_hash_map(mistral_slice, 4, 16384, 1, 2)
    assert len(mistral_slice) > 300
    np.testing.assert_array_equal(table.signatures, expected)
    # The MurmurHash3 heads are the L=0 table's heads 1..3 (seed = head).
    plain = SignatureTable.from_tokens(mistral_slice, 4, 16384, 2, "reference")
    np.testing.assert_array_equal(
        table.signatures[:, 1:3], plain.signatures[:, 1:3]
    )


def test_mistral_pure_lsh_equals_the_reference(mistral_slice):
    pieces = mistral_slice[:200]
    table = SignatureTable.from_tokens(
        pieces, 2, 1024, 2, "reference", num_lsh=2
    )
    expected = reference_hash_map(pieces, 2, 1024, 2, 2)
    np.testing.assert_array_equal(table.signatures, expected)
    with pytest.raises(ValueError, match="rule='reference'"):
        SignatureTable.from_tokens(pieces, 2, 1024, 2, "unique", num_lsh=2)


def test_similar_spellings_often_share_lsh_ids():
    # One trigram more or less: the LSH head often agrees (by chance, 1 in
    # 4095), the MurmurHash3 head never does.
    words = ["international", "organisation", "comprehensive"]
    words += ["understanding", "responsibility", "characteristic"]
    words += ["environmental", "communication", "representation"]
    words += ["infrastructure"]
    tokens = []
    for w in words:
        tokens += [f"▁{w}", f"▁{w}s", f"▁{w[:-1]}"]
    table = SignatureTable.from_tokens(tokens, 2, 4096, num_lsh=1)
    lsh = table.signatures[:, 0].reshape(-1, 3)
    mmh = table.signatures[:, 1].reshape(-1, 3)
    shared = int(
        np.sum(lsh[:, :1] == lsh[:, 1:]) + np.sum(lsh[:, 1] == lsh[:, 2])
    )
    assert shared >= 4  # 7 of these 30 pairs
    assert not np.any(mmh[:, :1] == mmh[:, 1:])


def test_unique_rule_rehashes_the_last_head_under_lsh_prefixes():
    # Anagram-like strings with equal trigram sets share the LSH id.
    tokens = ["abab", "baba", "abab▁", "▁abab"] + synthetic_tokens()[7:47]
    for rule in ("unique", "reference"):
        table = SignatureTable.from_tokens(tokens, 2, 12, rule=rule, num_lsh=1)
        expected = (
            reference_hash_map(tokens, 2, 12, 1, None)
            if rule == "reference"
            else None
        )
        if expected is not None:
            np.testing.assert_array_equal(table.signatures, expected)
    unique = SignatureTable.from_tokens(tokens, 2, 12, rule="unique", num_lsh=1)
    reference = SignatureTable.from_tokens(
        tokens, 2, 12, rule="reference", num_lsh=1
    )
    # The authors' one-entry memory lets duplicates through; "unique" not.
    assert reference.statistics()["duplicate_tokens"] == 6
    assert unique.statistics()["duplicate_tokens"] == 0
    assert unique[0][0] == unique[1][0]


def test_deterministic_and_expansion_appends():
    tokens = ["<pad>"] + synthetic_tokens()
    first = SignatureTable.from_tokens(tokens, 3, 256, 0, num_lsh=1)
    again = SignatureTable.from_tokens(tokens, 3, 256, 0, num_lsh=1)
    assert first.fingerprint == again.fingerprint
    grown = SignatureTable.from_tokens(tokens[:30], 3, 256, 0, num_lsh=1)
    grown = grown.expand(tokens[30:])
    np.testing.assert_array_equal(grown.signatures, first.signatures)
    assert grown.num_lsh == 1 and "num_lsh=1" in repr(grown)


def test_zero_lsh_heads_leave_the_table_unchanged():
    tokens = ["<pad>"] + synthetic_tokens()
    plain = SignatureTable.from_tokens(tokens, 4, 512, 0)
    explicit = SignatureTable.from_tokens(tokens, 4, 512, 0, num_lsh=0)
    assert plain.fingerprint == explicit.fingerprint
    assert plain.num_lsh == 0 and "num_lsh" not in repr(plain)
    assert plain.statistics()["lsh_distinct"] is None


def test_statistics_count_lsh_sharing():
    tokens = ["<pad>", "abab", "baba", "▁cat", "▁dog"]
    table = SignatureTable.from_tokens(tokens, 2, 4096, 0, num_lsh=1)
    stats = table.statistics()
    assert stats["num_lsh"] == 1
    assert stats["lsh_distinct"] == 3 and stats["lsh_shared_tokens"] == 1
    assert stats["max_tokens_per_lsh_id"] == 2
    assert stats["duplicate_tokens"] == 0


@pytest.mark.parametrize(
    "num_lsh, rule, message",
    [
        (-1, "unique", "num_lsh"),
        (3, "unique", "num_lsh"),
        (1.0, "unique", "num_lsh"),
        (True, "unique", "num_lsh"),
        (1, "repeated", "repeated"),
        (2, "unique", "rule='reference'"),
    ],
)
def test_bad_num_lsh_is_refused(num_lsh, rule, message):
    with pytest.raises(ValueError, match=message):
        SignatureTable.from_tokens(
            ["a", "b", "c"], 2, 16, rule=rule, num_lsh=num_lsh
        )
    with pytest.raises(ValueError, match=message):
        SignatureTable(np.ones((3, 2), "int32"), 16, None, rule, None, num_lsh)
