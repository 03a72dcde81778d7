"""When does candidate decoding's certificate hold? A confident model, grown
to a large vocabulary, on contexts it knows and on contexts it does not.

    KERAS_BACKEND=jax python -m benchmarks.candidate_certificate \
        --weights /tmp/cycle.weights.h5   # trains them first if missing

Trains `tiny_h4b16384` on synthetic tokens (V = 32,768) until greedy
decoding reproduces a 64-token cycle (tokens 3..66), then builds the same
architecture at V = 1,048,576 (the first 32,768 signatures are the same;
every weight is copied, zero new parameters). For both sizes it generates
greedily from a prompt on the cycle and from one off it (tokens
1000..1015) with `decoding="full"` and `decoding="candidates"` (K set to the
automatic choice) and prints the tokens and the fallback rate; then, on the
cycle at V = 1M, the certificate by hand: the best candidate's score against
the bound `sum_i t_i` (`t_i`: head i's (K+1)-th best log-probability).
"""

import argparse
import os
import time

import numpy as np

from benchmarks import common

CYCLE = np.arange(3, 3 + 64)


def parse_args(argv=None):
    p = common.argument_parser(
        "candidate_certificate",
        __doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--weights", default="/tmp/candidate_certificate.weights.h5")
    p.add_argument("--vocab", type=int, default=1 << 20)
    p.add_argument("--epochs", type=int, default=3)
    return p.parse_args(argv)


def trained_model(path, epochs):
    from keras_mhf.pretraining import fit_blocks
    from keras_mhf.pretraining import make_optimizer

    lm = common.synthetic_mhf(32768, "tiny_h4b16384")
    if os.path.exists(path):
        lm.load_weights(path)
        return lm
    stream = np.tile(CYCLE, 200)
    blocks = np.stack(
        [stream[i : i + 65] for i in range(0, 64 * 150, 7)]
    ).astype("int32")
    lm.compile(
        optimizer=make_optimizer(3e-3, epochs * len(blocks) // 16, 10),
        loss="auto",
    )
    lm.preprocessor = None
    started = time.time()
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(blocks))
        history = fit_blocks(lm, blocks[order], 16, verbose=0)
        print(
            f"epoch {epoch}: loss {history.history['loss'][-1]:.3f} "
            f"({time.time() - started:.0f} s)",
            flush=True,
        )
    lm.save_weights(path)
    return lm


def grown(small, vocabulary_size):
    import keras

    from keras_mhf.models import MultiHashFormerCausalLM

    tokens = common.synthetic_tokens(32768)
    big = MultiHashFormerCausalLM.from_tokens(
        tokens + common.synthetic_expansion(tokens, vocabulary_size),
        "tiny_h4b16384",
        pad_token_id=2,
    )
    weights = {v.path: v for v in small.backbone.weights}
    for v in big.backbone.weights:
        if v.path != "signature_lookup/signatures":
            v.assign(keras.ops.convert_to_numpy(weights[v.path]))
    old = small.backbone.signature_lookup.signatures
    new = big.backbone.signature_lookup.signatures
    assert np.array_equal(
        keras.ops.convert_to_numpy(new)[:32768], keras.ops.convert_to_numpy(old)
    )
    return big


def prompt(start):
    return common.generation_prompt(2, 16, 32, np.arange(start, start + 16))


def main(argv=None):
    args = parse_args(argv)
    import keras

    from keras_mhf.models.multi_hash_former import (
        multi_hash_former_inference as inference,
    )

    small = trained_model(args.weights, args.epochs)
    big = grown(small, args.vocab)
    for name, lm in (("V=32,768", small), (f"V={args.vocab:,}", big)):
        lm.compile(sampler="greedy")
        lm.preprocessor = None
        from keras_mhf.models.multi_hash_former.multi_hash_former_decoding import (  # noqa: E501
            resolved_candidate_buckets,
        )

        lm.candidate_buckets = resolved_candidate_buckets(lm)
        print(
            f"{name}: K = {lm.candidate_buckets}, largest bucket per head "
            f"{lm.bucket_index.max_bucket_load}"
        )
        for start, label in ((3, "on the cycle"), (1000, "off the cycle")):
            for decoding in ("full", "candidates"):
                lm.decoding = decoding
                lm.decoding_statistics.reset()
                out = lm.generate(prompt(start), stop_token_ids=None)
                tokens = np.asarray(out["token_ids"])[0, 16:24].tolist()
                print(
                    f"  prompt {label}, {decoding}: {tokens}, fallback rate "
                    f"{lm.decoding_statistics.fallback_rate:.3f}"
                )
    x = {
        "token_ids": CYCLE[None, :48].astype("int32"),
        "padding_mask": np.ones((1, 48), "int32"),
    }
    log_probs, signatures = inference.heads(big, big.backbone(x))
    log_probs = keras.ops.convert_to_numpy(log_probs)[0]
    signatures = keras.ops.convert_to_numpy(signatures)
    k = big.candidate_buckets
    heads = np.arange(signatures.shape[1])
    print(
        "per-head top bucket probability on the cycle: "
        f"{np.round(np.exp(log_probs.max(-1)).mean(0), 3).tolist()}"
    )
    for t in (20, 30, 40):
        top = np.argsort(-log_probs[t], -1)[:, :k]
        bound = np.sort(log_probs[t], -1)[:, ::-1][:, k].sum()
        scores = log_probs[t][heads[None, :], signatures].sum(-1)
        candidates = np.zeros(len(signatures), bool)
        for i in heads:
            candidates |= np.isin(signatures[:, i], top[i])
        print(
            f"  position {t}: next token {CYCLE[t + 1]}, argmax "
            f"{scores.argmax()}, best candidate score "
            f"{scores[candidates].max():.2f} > bound {bound:.2f} "
            f"({candidates.sum()} candidates)"
        )


if __name__ == "__main__":
    main()
