"""Named architectures: the paper's trunks (Table 1) and tiny CPU trunks, each
combined with a hash configuration, e.g. `"1b_h4b16k"`, `"tiny_h3b512"`.

A name is `<trunk>` (Standard baseline) or `<trunk>_h<H>b<B>`; `B` may be an
integer or one of the paper's shorthands (`4k`=4096, `8k`=8192,
`10k`=10624, the Standard embedding count at 1B, `16k`=16384). A suffix
`_lsh<L>` makes the first `L` heads the authors' LSH ids (their ablation,
paper Sec. 6), e.g. `"1b_h4b16k_lsh1"`; it changes no parameter count.
"""

import re

TRUNKS = {
    # Paper Table 1 (Sec. 4.1).
    "100m": dict(
        num_layers=12,
        hidden_dim=768,
        num_query_heads=12,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_dim=2560,
    ),
    "1b": dict(
        num_layers=20,
        hidden_dim=2048,
        num_query_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_dim=6144,
    ),
    "3b": dict(
        num_layers=36,
        hidden_dim=2048,
        num_query_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_dim=11008,
    ),
    # CPU-sized trunks for tests, recipes and the quickstart.
    "tiny": dict(
        num_layers=2,
        hidden_dim=32,
        num_query_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_dim=64,
    ),
    "mini": dict(
        num_layers=4,
        hidden_dim=128,
        num_query_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_dim=384,
    ),
    "small": dict(
        num_layers=4,
        hidden_dim=512,
        num_query_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_dim=1536,
    ),
}

BUCKET_SHORTHANDS = {"4k": 4096, "8k": 8192, "10k": 10624, "16k": 16384}

HASH_DEFAULTS = dict(gate_dim=64, mixer_dim=64)

_NAME = re.compile(
    r"^(?P<trunk>[a-z0-9]+?)(?:_h(?P<h>\d+)b(?P<b>\d+k?)(?:_lsh(?P<l>\d+))?)?$"
)


def parse_architecture(name):
    """Returns `(trunk_kwargs, hash_kwargs or None)` for an architecture
    name."""
    match = _NAME.match(str(name).lower())
    if not match or match.group("trunk") not in TRUNKS:
        raise ValueError(
            f"Unknown architecture {name!r}. Use '<trunk>' or "
            f"'<trunk>_h<H>b<B>[_lsh<L>]' with trunk one of {sorted(TRUNKS)} "
            "(e.g. '1b_h4b16k', 'tiny_h3b512', '1b_h4b16k_lsh1')."
        )
    trunk = dict(TRUNKS[match.group("trunk")])
    if match.group("h") is None:
        return trunk, None
    buckets = match.group("b")
    if buckets in BUCKET_SHORTHANDS:
        num_buckets = BUCKET_SHORTHANDS[buckets]
    elif buckets.endswith("k"):
        raise ValueError(
            f"Unknown bucket shorthand {buckets!r} in {name!r}; use one of "
            f"{sorted(BUCKET_SHORTHANDS)} or an integer."
        )
    else:
        num_buckets = int(buckets)
    hashes = dict(num_hashes=int(match.group("h")), num_buckets=num_buckets)
    hashes.update(HASH_DEFAULTS)
    if match.group("l") is not None:
        hashes["num_lsh"] = int(match.group("l"))
        if hashes["num_lsh"] > hashes["num_hashes"]:
            raise ValueError(
                f"{name!r} asks for {hashes['num_lsh']} LSH heads of "
                f"{hashes['num_hashes']}; use _lsh<L> with L <= H."
            )
    return trunk, hashes


def architecture_config(architecture, extra_layers=0, **overrides):
    """The backbone arguments of a named architecture (trunk, plus `H`, `B`,
    gate and mixer dims for MHF names), e.g. to fit a model-parallel layout
    before the model exists (`MultiHashFormerBackbone.get_layout_map`)."""
    trunk, hashes = parse_architecture(architecture)
    trunk["num_layers"] += int(extra_layers)
    return {**trunk, **(hashes or {}), **overrides}


def architecture_names():
    """The named architectures listed in the README (any `h<H>b<B>` works)."""
    names = []
    for trunk in ("100m", "1b", "3b"):
        names += [trunk, f"{trunk}_h3b10k", f"{trunk}_h4b16k"]
    for trunk in ("tiny", "mini", "small"):
        names += [trunk, f"{trunk}_h3b512", f"{trunk}_h4b1024"]
    return names


def count_parameters(
    architecture, vocabulary_size=32768, extra_layers=0, **overrides
):
    """Analytic parameter counts, without allocating any weight.

    Args:
        architecture: a name such as `"1b"` (Standard) or `"1b_h4b16k"`.
        vocabulary_size: `V` (only the Standard embedding depends on it).
        extra_layers: decoder blocks added to the trunk (Standard+kL).
        **overrides: any trunk or hash argument (e.g. `num_buckets=2048`).

    Returns:
        dict with `embedding` (Standard: the tied `V x d` matrix; MHF: the H
        bucket tables plus the gated combiner), `decoder` (MHF: the cascade
        mixers; Standard: 0, the head is tied), `trunk` (blocks + final
        norm), `total`, `signature_table_entries` (MHF's non-trainable int
        table, `V x H`) and `decoding_index_entries` (its inverted index for
        candidate decoding, `H x (V + B + 1)` ints, derived from the table
        and not saved); the int entries are not counted in `total`.
    """
    trunk, hashes = parse_architecture(architecture)
    trunk["num_layers"] += int(extra_layers)
    for key in list(overrides):
        if key in trunk:
            trunk[key] = overrides.pop(key)
    if hashes is not None:
        # LSH heads change the table, not the parameters.
        overrides.pop("num_lsh", None)
        hashes.update(
            {k: overrides.pop(k) for k in list(overrides) if k in hashes}
        )
    if overrides:
        raise ValueError(f"Unknown arguments: {sorted(overrides)}")
    d = trunk["hidden_dim"]
    body = trunk_parameter_count(**trunk)
    if hashes is None:
        embedding, decoder, table, index = vocabulary_size * d, 0, 0, 0
    else:
        h, b = hashes["num_hashes"], hashes["num_buckets"]
        g, m = hashes["gate_dim"], hashes["mixer_dim"]
        # Sec. 3.1: H tables, W1/b1, w2/b2, Ws/bs.
        embedding = h * b * d + (d * g + g) + (g + 1) + (d * d + d)
        # Sec. 3.3: H-1 mixers, W_dn [2d, m] + b_dn, W_up [m, d] + b_up.
        decoder = (h - 1) * (2 * d * m + m + m * d + d)
        table = vocabulary_size * h
        index = h * (vocabulary_size + b + 1)
    return {
        "embedding": embedding,
        "decoder": decoder,
        "trunk": body,
        "total": embedding + decoder + body,
        "signature_table_entries": table,
        "decoding_index_entries": index,
    }


def trunk_parameter_count(
    num_layers,
    hidden_dim,
    num_query_heads,
    num_key_value_heads,
    head_dim,
    intermediate_dim,
):
    """Parameters of the Qwen3 decoder stack plus the final norm (no
    embeddings): attention kernels, q/k norms, SwiGLU kernels, two norms per
    block, the final norm."""
    attention = (
        hidden_dim * head_dim * (2 * num_query_heads + 2 * num_key_value_heads)
    )
    qk_norms = 2 * head_dim
    mlp = 3 * hidden_dim * intermediate_dim
    norms = 2 * hidden_dim
    return num_layers * (attention + qk_norms + mlp + norms) + hidden_dim
