"""Multi-hash token signatures (paper Sec. 3.1, "Multi-Hash Indexing").

Numpy only: this module never touches a Keras backend, so tables can be built,
inspected and compared anywhere.
"""

import hashlib

import mmh3
import numpy as np

# Imports torch only when LSH heads are built (`num_lsh > 0`).
from keras_mhf.signatures import signature_lsh

RULES = ("unique", "reference", "repeated")
# Bucket ids are stored and gathered as int32.
MAX_BUCKETS = 2**31 - 1


class SignatureTable:
    """Maps every token string of a vocabulary to `H` bucket ids.

    Token `t` (its string exactly as the tokenizer's vocabulary holds it) gets,
    for head `i`, `bucket_i = murmur3_x64_128(t, seed=i) % (B - 1) + 1`, so real
    buckets are `1..B-1` and bucket 0 is reserved for the pad token, whose
    signature is all zeros (paper Sec. 3.1). Tokens are processed in id order;
    when a token's full signature is already taken, the last head is re-hashed
    with seed `H - 1 + r`, `r = 1, 2, ...`, until it is free.

    Three collision rules:

    - `"unique"` (default): "taken" means any earlier token has that full
      signature. Signatures are guaranteed unique, and a configuration that
      cannot be unique is refused with an error.
    - `"reference"`: the authors' code remembers only the most recent token per
      `(H-1)`-prefix and compares against it alone, so duplicates can slip
      through. Use it to reproduce their tables bit for bit (e.g. their
      single-hash ablations).
    - `"repeated"`: the single-hash table of the authors' rule (`H = 1`),
      repeated in every one of the `H` heads: the paper's single-ID ablation
      (Table 3) at the parameter budget of an `H`-head model.

    LSH heads (the authors' ablation, paper Sec. 6): with `num_lsh = L > 0`,
    heads `0..L-1` are the authors' locality-sensitive ids of the token's
    character trigrams (`keras_mhf.signatures.signature_lsh`, which needs PyTorch for
    their random projections), heads `L..H-2` are MurmurHash3 with seed = head
    index, and the last head (seed `H-1`) is re-hashed on collisions as above.
    With `L == H` (pure LSH) there is no collision handling at all, as in the
    authors' code, so only `rule="reference"` accepts it.

    Build tables with `SignatureTable.from_tokens`; the constructor wraps an
    existing `[V, H]` array (for instance one read from a checkpoint).

    Args:
        signatures: int array `[V, H]`, row `v` is token `v`'s signature.
        num_buckets: int, `B`, buckets per head including the reserved 0.
        pad_token_id: int or `None`, the token whose signature is all zeros.
        rule: `"unique"`, `"reference"` or `"repeated"`, the rule used to
            build (and later expand) the table.
        tokens: optional list of the `V` token strings the table was built
            from.
        num_lsh: int, `L`, the number of leading LSH heads (0 to `H`).
            Defaults to 0.

    Example:

    ```python
    table = keras_mhf.SignatureTable.from_tokens(
        ["<pad>", "▁the", "▁cat", "▁sat"], num_hashes=2, num_buckets=16,
        pad_token_id=0,
    )
    table.signatures  # int32 [4, 2]; row 0 is (0, 0)
    table = table.expand(["▁dog"])  # old rows never change
    lsh = keras_mhf.SignatureTable.from_tokens(  # head 0 is LSH (needs torch)
        ["<pad>", "▁the", "▁then"], 2, 16, pad_token_id=0, num_lsh=1
    )
    ```
    """

    def __init__(
        self,
        signatures,
        num_buckets,
        pad_token_id=None,
        rule="unique",
        tokens=None,
        num_lsh=0,
    ):
        signatures = np.asarray(signatures)
        if (
            signatures.ndim != 2
            or signatures.shape[0] < 1
            or signatures.shape[1] < 1
        ):
            raise ValueError(
                "`signatures` must be a non-empty int array of shape "
                f"[vocabulary_size, num_hashes]; got shape {signatures.shape}."
            )
        if not np.issubdtype(signatures.dtype, np.integer):
            raise ValueError(
                "`signatures` must hold integers; got dtype "
                f"{signatures.dtype}."
            )
        _check_hyperparameters(
            signatures.shape[0],
            signatures.shape[1],
            num_buckets,
            pad_token_id,
            rule,
            num_lsh,
        )
        check_bucket_ids("`signatures`", signatures, num_buckets)
        if tokens is not None and len(tokens) != signatures.shape[0]:
            raise ValueError(
                f"Got {len(tokens)} tokens for a table of "
                f"{signatures.shape[0]} rows."
            )
        self.signatures = signatures.astype("int32")
        self.num_buckets = int(num_buckets)
        self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        self.rule = rule
        self.tokens = None if tokens is None else list(tokens)
        self.num_lsh = int(num_lsh)

    # --- Construction -------------------------------------------------------

    @classmethod
    def from_tokens(
        cls,
        tokens,
        num_hashes,
        num_buckets,
        pad_token_id=None,
        rule="unique",
        num_lsh=0,
    ):
        """Builds the table for `tokens` (a list of strings in id order).

        Args:
            tokens: list of token strings; token id = position in the list.
            num_hashes: int, `H >= 1`.
            num_buckets: int, `B >= 2` (bucket 0 included).
            pad_token_id: int or `None`; this token gets signature `(0,...,0)`.
            rule: `"unique"`, `"reference"` or `"repeated"`.
            num_lsh: int `0 <= L <= H`, leading heads that are the authors'
                LSH ids of character trigrams (their ablation; needs
                PyTorch, imported only when `L > 0`). Defaults to 0.

        Returns:
            A `SignatureTable`.

        Raises:
            ValueError: empty or duplicate vocabulary, bad hyper-parameters,
                (rule `"unique"`) a capacity that cannot hold the vocabulary,
                or a `num_lsh` the rule cannot serve.
            ImportError: `num_lsh > 0` without PyTorch.
        """
        tokens = _check_tokens(tokens)
        _check_hyperparameters(
            len(tokens), num_hashes, num_buckets, pad_token_id, rule, num_lsh
        )
        table = cls.__new__(cls)
        table.signatures = np.zeros((0, num_hashes), "int32")
        table.num_buckets = int(num_buckets)
        table.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        table.rule = rule
        table.tokens = []
        table.num_lsh = int(num_lsh)
        return table._append(tokens)

    def expand(self, new_tokens):
        """Returns a new table with `new_tokens` appended (paper Sec. 4.4).

        New tokens get ids `V, V+1, ...` and are hashed with the same rule and
        order, so every old row is unchanged.
        """
        new_tokens = _check_tokens(new_tokens)
        if self.tokens is not None:
            clash = sorted(set(new_tokens) & set(self.tokens))
            if clash:
                raise ValueError(
                    f"{len(clash)} new token(s) are already in the vocabulary "
                    f"(e.g. {clash[:5]}); pass only tokens that are new."
                )
        else:
            raise ValueError(
                "This table was created without its token strings, so new "
                "tokens cannot be checked against old ones. Build it with "
                "`SignatureTable.from_tokens` (or pass `tokens=`) to expand it."
            )
        _check_capacity(
            len(self.tokens) + len(new_tokens),
            self.num_hashes,
            self.num_buckets,
            self.pad_token_id,
            self.rule,
        )
        expanded = SignatureTable(
            self.signatures,
            self.num_buckets,
            self.pad_token_id,
            self.rule,
            self.tokens,
            self.num_lsh,
        )
        return expanded._append(new_tokens)

    def _append(self, new_tokens):
        if self.rule == "repeated":
            return self._append_repeated(new_tokens)
        num_hashes = self.num_hashes
        num_buckets = self.num_buckets
        num_lsh = self.num_lsh
        real = num_buckets - 1
        last = num_hashes - 1
        old_size = self.signatures.shape[0]
        _check_capacity(
            old_size + len(new_tokens),
            num_hashes,
            num_buckets,
            self.pad_token_id,
            self.rule,
        )
        lsh_rows = None
        if num_lsh:
            pad = self.pad_token_id
            if pad is not None:
                pad = pad - old_size if pad >= old_size else None
            lsh = signature_lsh.lsh_ids(new_tokens, num_lsh, num_buckets, pad)
            if num_lsh == num_hashes:
                # Pure LSH: the authors' code has no collision handling.
                return self._concatenate(lsh, new_tokens)
            lsh_rows = [tuple(int(b) for b in row) for row in lsh]
        # Rebuild the collision state from the existing rows (id order), exactly
        # as it stood after processing them.
        state = {}
        for v in range(old_size):
            row = tuple(int(b) for b in self.signatures[v])
            self._remember(state, row[:last], row[last], v == self.pad_token_id)
        out = np.zeros((len(new_tokens), num_hashes), "int64")
        # Keyword arguments on purpose: mmh3 5.3 reads positional
        # `x64arch`/`signed` differently, which silently gives the signed
        # variant.
        hash128 = mmh3.hash128
        for k, token in enumerate(new_tokens):
            token_id = old_size + k
            if token_id == self.pad_token_id:
                self._remember(state, (0,) * last, 0, True)
                continue
            # MurmurHash3 heads use seed = head index (after any LSH heads).
            prefix = tuple(
                hash128(token, seed=seed, x64arch=True, signed=False) % real + 1
                for seed in range(num_lsh, last)
            )
            if lsh_rows is not None:
                prefix = lsh_rows[k] + prefix
            bucket = (
                hash128(token, seed=last, x64arch=True, signed=False) % real + 1
            )
            taken = state.get(prefix)
            if taken is not None:
                if self.rule == "unique" and len(taken) >= real:
                    raise ValueError(
                        f"Cannot give token {token!r} (id {token_id}) a unique "
                        f"signature: all {real} last-head buckets under its "
                        f"prefix {prefix} are taken. Increase num_buckets or "
                        "num_hashes, or use rule='reference'."
                    )
                retry = 0
                while bucket in taken:
                    retry += 1
                    if retry > 1000 * real:
                        raise ValueError(
                            f"Re-hashing token {token!r} (id {token_id}) found "
                            f"no free last-head bucket in {retry - 1} tries. "
                            "Increase num_buckets or num_hashes."
                        )
                    bucket = (
                        hash128(
                            token, seed=last + retry, x64arch=True, signed=False
                        )
                        % real
                        + 1
                    )
            self._remember(state, prefix, bucket, False)
            out[k, :last] = prefix
            out[k, last] = bucket
        return self._concatenate(out, new_tokens)

    def _concatenate(self, rows, new_tokens):
        self.signatures = np.concatenate(
            [self.signatures, rows.astype("int32")], 0
        )
        self.tokens = list(self.tokens) + list(new_tokens)
        return self

    def _append_repeated(self, new_tokens):
        single = SignatureTable.__new__(SignatureTable)
        single.signatures = self.signatures[:, :1]
        single.num_buckets = self.num_buckets
        single.pad_token_id = self.pad_token_id
        single.rule = "reference"
        single.tokens = self.tokens
        single.num_lsh = 0
        single._append(new_tokens)
        self.signatures = np.tile(single.signatures, (1, self.num_hashes))
        self.tokens = single.tokens
        return self

    def _remember(self, state, prefix, bucket, is_pad):
        if self.rule == "unique":
            if not is_pad:
                state.setdefault(prefix, set()).add(bucket)
        else:
            # The authors' code replaces the entry for the prefix, so only the
            # most recent token under a prefix is ever compared against (the
            # pad token too: it is stored under the all-zero prefix).
            state[prefix] = (bucket,)

    # --- Properties ---------------------------------------------------------

    @property
    def vocabulary_size(self):
        return int(self.signatures.shape[0])

    @property
    def num_hashes(self):
        return int(self.signatures.shape[1])

    @property
    def capacity(self):
        """Number of distinct signatures real tokens can take: `(B-1)^H`."""
        return (self.num_buckets - 1) ** self.num_hashes

    @property
    def fingerprint(self):
        """sha256 of the table (shape, B and the int32 rows), stable across
        runs."""
        digest = hashlib.sha256()
        digest.update(
            f"{self.vocabulary_size}x{self.num_hashes}/B{self.num_buckets}".encode()
        )
        digest.update(np.ascontiguousarray(self.signatures, "<i4").tobytes())
        return digest.hexdigest()

    def statistics(self):
        """Capacity and collision statistics as a dict.

        Keys: `vocabulary_size`, `num_hashes`, `num_buckets`, `capacity`,
        `load` (real tokens / capacity), `distinct_signatures` (real tokens),
        `duplicate_tokens` (real tokens sharing a full signature with an
        earlier one), `prefix_collisions` (real tokens whose `(H-1)`-prefix
        was already used), `max_tokens_per_prefix`, `bucket_usage` (per
        head, the fraction of the `B-1` real buckets in use), `num_lsh`, and
        for the LSH heads (`None` without them): `lsh_distinct` (distinct
        LSH-part tuples among real tokens), `lsh_shared_tokens` (real tokens
        whose LSH part equals an earlier token's) and
        `max_tokens_per_lsh_id` (the most tokens sharing one LSH tuple).

        Example:

        ```python
        table = SignatureTable.from_tokens(["a", "b", "c"], 2, 16)
        table.statistics()["duplicate_tokens"]  # 0
        ```
        """
        rows = self.signatures
        real = np.ones(len(rows), bool)
        if self.pad_token_id is not None and self.pad_token_id < len(rows):
            real[self.pad_token_id] = False
        rows = rows[real]
        distinct = len(np.unique(rows, axis=0)) if len(rows) else 0
        if self.num_hashes > 1 and len(rows):
            _, counts = np.unique(rows[:, :-1], axis=0, return_counts=True)
        else:
            counts = np.array([len(rows)])
        usage = [
            float(len(np.unique(rows[:, i])) / (self.num_buckets - 1))
            for i in range(self.num_hashes)
        ]
        lsh_distinct = lsh_shared = lsh_max = None
        if self.num_lsh and len(rows):
            _, lsh_counts = np.unique(
                rows[:, : self.num_lsh], axis=0, return_counts=True
            )
            lsh_distinct = int(len(lsh_counts))
            lsh_shared = int(len(rows) - len(lsh_counts))
            lsh_max = int(lsh_counts.max())
        return {
            "vocabulary_size": self.vocabulary_size,
            "num_hashes": self.num_hashes,
            "num_buckets": self.num_buckets,
            "rule": self.rule,
            "capacity": self.capacity,
            "load": len(rows) / self.capacity,
            "distinct_signatures": int(distinct),
            "duplicate_tokens": int(len(rows) - distinct),
            "prefix_collisions": int(len(rows) - len(counts)),
            "max_tokens_per_prefix": int(counts.max()) if len(rows) else 0,
            "bucket_usage": usage,
            "num_lsh": self.num_lsh,
            "lsh_distinct": lsh_distinct,
            "lsh_shared_tokens": lsh_shared,
            "max_tokens_per_lsh_id": lsh_max,
        }

    def __len__(self):
        return self.vocabulary_size

    def __getitem__(self, token_id):
        return tuple(int(b) for b in self.signatures[token_id])

    def __repr__(self):
        return (
            f"SignatureTable(vocabulary_size={self.vocabulary_size}, "
            f"num_hashes={self.num_hashes}, num_buckets={self.num_buckets}, "
            f"rule={self.rule!r}, "
            + (f"num_lsh={self.num_lsh}, " if self.num_lsh else "")
            + f"fingerprint={self.fingerprint[:12]})"
        )


def _check_tokens(tokens):
    if isinstance(tokens, (str, bytes)):
        raise ValueError("Pass a list of token strings, not a single string.")
    tokens = list(tokens)
    if not tokens:
        raise ValueError(
            "The vocabulary is empty: pass at least one token string."
        )
    for index, t in enumerate(tokens):
        if not isinstance(t, str):
            raise ValueError(
                f"Token {t!r} is a {type(t).__name__}; every token must be a "
                "str (decode bytes as UTF-8 first)."
            )
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as error:
            # MurmurHash3 hashes the UTF-8 bytes; a lone surrogate has none
            # (and crashes mmh3 itself).
            raise ValueError(
                f"Token {index} ({t!r}) is not valid Unicode text: "
                f"{error.reason} at position {error.start}. Each token must "
                "encode to UTF-8; "
                "a lone surrogate usually means bytes were decoded with "
                "'surrogateescape' or a UTF-16 pair was split."
            ) from None
    if len(set(tokens)) != len(tokens):
        seen, dupes = set(), []
        for t in tokens:
            if t in seen:
                dupes.append(t)
            seen.add(t)
        raise ValueError(
            f"The vocabulary holds {len(dupes)} duplicate token string(s), "
            f"e.g. {dupes[:5]}. Each token id needs a distinct string."
        )
    return tokens


def _check_hyperparameters(
    vocabulary_size, num_hashes, num_buckets, pad_token_id, rule, num_lsh=0
):
    if not isinstance(num_hashes, (int, np.integer)) or num_hashes < 1:
        raise ValueError(
            f"`num_hashes` must be an int >= 1; got {num_hashes!r}."
        )
    if not isinstance(num_buckets, (int, np.integer)) or num_buckets < 2:
        raise ValueError(
            f"`num_buckets` must be an int >= 2 (bucket 0 is reserved for the "
            f"pad token); got {num_buckets!r}."
        )
    check_num_buckets("SignatureTable", num_buckets)
    if rule not in RULES:
        raise ValueError(f"`rule` must be one of {RULES}; got {rule!r}.")
    check_num_lsh(num_lsh, num_hashes, rule)
    if pad_token_id is not None and not (0 <= pad_token_id < vocabulary_size):
        raise ValueError(
            f"`pad_token_id`={pad_token_id} is out of range for a vocabulary "
            f"of {vocabulary_size} tokens; use an id in "
            f"[0, {vocabulary_size - 1}] or None."
        )
    _check_capacity(
        vocabulary_size, num_hashes, num_buckets, pad_token_id, rule
    )


def check_num_lsh(num_lsh, num_hashes, rule):
    """Raises a clear `ValueError` unless `num_lsh` LSH heads fit `num_hashes`
    heads under `rule` (`0 <= num_lsh <= num_hashes`; pure LSH only with the
    authors' `"reference"` rule; none with `"repeated"`).

    Example:

    ```python
    check_num_lsh(1, 4, "unique")  # fine: one LSH head, three MurmurHash3
    check_num_lsh(4, 4, "unique")  # ValueError: pure LSH needs "reference"
    ```
    """
    if (
        isinstance(num_lsh, bool)
        or not isinstance(num_lsh, (int, np.integer))
        or not 0 <= num_lsh <= num_hashes
    ):
        raise ValueError(
            f"`num_lsh` must be an int from 0 to num_hashes={num_hashes} (the "
            f"number of leading LSH heads); got {num_lsh!r}."
        )
    if num_lsh and rule == "repeated":
        raise ValueError(
            "rule='repeated' (the single-ID ablation) has no LSH heads; use "
            "num_lsh=0 with it."
        )
    if num_lsh == num_hashes and num_lsh and rule == "unique":
        raise ValueError(
            f"num_lsh={num_lsh} = num_hashes makes every head an LSH id, and "
            "LSH ids have no collision handling (tokens spelled alike share "
            "them), so signatures cannot be guaranteed unique. Use "
            "rule='reference' (the authors' pure-LSH tables), or leave at "
            "least one MurmurHash3 head (num_lsh < num_hashes)."
        )


def _check_capacity(
    vocabulary_size, num_hashes, num_buckets, pad_token_id, rule
):
    if rule != "unique":
        return
    real_tokens = vocabulary_size - (1 if pad_token_id is not None else 0)
    capacity = (num_buckets - 1) ** num_hashes
    if real_tokens > capacity:
        raise ValueError(
            f"{real_tokens} tokens cannot have unique signatures with "
            f"num_hashes={num_hashes}, num_buckets={num_buckets}: the capacity "
            f"is (B-1)^H = {capacity}. Increase num_buckets or num_hashes, or "
            "use rule='reference' (the authors' rule, which allows "
            "duplicates)."
        )


def check_num_buckets(owner, num_buckets):
    """Raises a clear `ValueError` unless `num_buckets` bucket ids fit int32
    (`num_buckets <= MAX_BUCKETS`); `owner` names the caller in the message.

    Example:

    ```python
    check_num_buckets("MultiHashFormerBackbone", 16384)  # fine
    ```
    """
    if num_buckets > MAX_BUCKETS:
        raise ValueError(
            f"{owner}: `num_buckets`={num_buckets} does not fit the int32 "
            f"bucket ids the model stores; use at most {MAX_BUCKETS} "
            "(2**31 - 1) buckets per head (more hashes give more capacity: "
            "(B-1)^H)."
        )


def check_bucket_ids(owner, signatures, num_buckets):
    """Raises a clear `ValueError` unless every bucket id of `signatures`
    (an int array, e.g. a `[V, H]` table) lies in `[0, num_buckets - 1]`;
    `owner` names the table in the message.

    Example:

    ```python
    check_bucket_ids("The signature table", np.array([[1, 3]]), 8)  # fine
    ```
    """
    signatures = np.asarray(signatures)
    if not signatures.size:
        return
    low, high = signatures.min(), signatures.max()
    if low < 0 or high >= num_buckets:
        raise ValueError(
            f"{owner} holds bucket ids outside [0, {num_buckets - 1}] (min "
            f"{low}, max {high}): it does not belong to "
            f"num_buckets={num_buckets}."
        )
