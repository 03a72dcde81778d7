"""Scoring for evaluation, computed the way lm-eval computes it:
log-likelihoods from log-softmax over the real vocabulary (MHF: paper Sec.
3.4, inference), per token and per request.

Every function takes a KerasHub causal LM whose `score()` returns `[b, s, V]`
scores (`MultiHashFormerCausalLM` or the Standard `Qwen3CausalLM`) and, for
text, its tokenizer.
"""

import contextlib

import numpy as np
from keras import ops

from keras_mhf.evaluation.calibration import expected_calibration_error
from keras_mhf.models.next_token_scorer import NextTokenScorer
from keras_mhf.utils.progress import Progress


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def next_token_scores(
    model, token_ids, padding_mask=None, batch_size=8, confidence=False
):
    """Scores every next token of a batch: `(log_probs, is_argmax)`, both
    `[n, s-1]`, where `log_probs[i, t] = log p(token_ids[i, t+1] |
    token_ids[i, :t+1])` normalised over the whole vocabulary (float32) and
    `is_argmax[i, t]` tells whether that token is the model's top choice;
    with `confidence=True` also the top-1 probability `[n, s-1]`.

    The one place where evaluation scores a model: a `NextTokenScorer`,
    compiled once per padded shape. MHF models score with their
    `scoring_temperature`.
    """
    scorer = NextTokenScorer.for_model(model, batch_size=batch_size)
    log_probs, is_argmax, best = scorer(token_ids, padding_mask)
    if confidence:
        return log_probs, is_argmax, np.exp(best.astype("float64"))
    return log_probs, is_argmax


def reference_next_token_scores(model, token_ids, padding_mask=None):
    """`next_token_scores` through the eager `model.score()` and numpy: an
    independent path that checks the compiled scorer's numbers (and that
    `python -m benchmarks.benchmark_evaluation` times against it)."""
    token_ids = np.asarray(token_ids, "int32")
    if padding_mask is None:
        padding_mask = np.ones_like(token_ids)
    scores = model.score(token_ids, np.asarray(padding_mask, "int32"))
    log_probs = _log_softmax(
        np.asarray(ops.convert_to_numpy(scores), "float32")
    )
    log_probs = log_probs[:, :-1]
    targets = token_ids[:, 1:, None]
    picked = np.take_along_axis(log_probs, targets, -1)[..., 0]
    return picked, log_probs.argmax(-1) == targets[..., 0]


def token_log_likelihoods(model, token_ids, padding_mask=None, batch_size=8):
    """Log-probability of each next token: `[n, s-1]` for `[n, s]` ids.

    Entry `[i, t]` is `log p(token_ids[i, t+1] | token_ids[i, :t+1])`,
    normalised over the whole vocabulary (float32).
    """
    return next_token_scores(model, token_ids, padding_mask, batch_size)[0]


def block_scores(model, blocks, batch_size=8):
    """Per-token NLL, top-1 hits and top-1 confidence of packed `[n, L+1]`
    blocks: `(nll [n, L] float64, correct [n, L] bool, confidence [n, L])`."""
    log_probs, is_argmax, confidence = next_token_scores(
        model,
        np.asarray(blocks, "int32"),
        batch_size=batch_size,
        confidence=True,
    )
    return -log_probs.astype("float64"), is_argmax, confidence


def _metrics(nll, correct, confidence):
    loss = float(nll.mean())
    return {
        "perplexity": float(np.exp(loss)),
        "loss": loss,
        "accuracy": float(correct.mean()),
        "ece": expected_calibration_error(confidence.ravel(), correct.ravel()),
        "tokens": int(nll.size),
    }


def two_rules(model):
    """Whether `model` scores with a rule other than the paper's (a
    MultiHashFormer whose `scoring_temperature` is not 1.0): evaluation then
    reports the paper's rule beside it."""
    temperature = getattr(model, "scoring_temperature", None)
    return temperature is not None and temperature != 1.0


@contextlib.contextmanager
def paper_rule(model):
    """Scores a MultiHashFormer with the paper's rule (`scoring_temperature`
    1.0) inside the block; other models are unchanged."""
    temperature = getattr(model, "scoring_temperature", None)
    if temperature is None or temperature == 1.0:
        yield
        return
    model.scoring_temperature = 1.0
    try:
        yield
    finally:
        model.scoring_temperature = temperature


def perplexity(model, blocks, batch_size=8, progress=None, label="perplexity"):
    """Perplexity over the real vocabulary of packed `[n, L+1]` blocks.

    Args:
        model: the causal LM.
        blocks: int `[n, L+1]` token blocks.
        batch_size: blocks per forward pass.
        progress: report progress (`keras_mhf.utils.progress.Progress`;
            `None`: the `show_progress` setting).
        label: the progress line's label.

    Returns:
        dict with `perplexity`, `loss` (mean NLL per predicted token, nats),
        `accuracy` (next-token top-1), `ece` (expected calibration error of
        the top-1 prediction) and `tokens`, under the model's scoring rule.
        For a MultiHashFormer whose `scoring_temperature` is not 1.0, also
        `scoring_temperature` and `paper_rule`: the same metrics under the
        paper's rule.
    """
    return perplexity_details(model, blocks, batch_size, progress, label)[0]


def perplexity_details(
    model, blocks, batch_size, progress=None, label="perplexity"
):
    """`(perplexity metrics, per-token nll [n, L], per-token hits)`."""
    temperature = getattr(model, "scoring_temperature", None)
    both = two_rules(model)
    progress = Progress(
        label, len(blocks) * (2 if both else 1), "blocks", progress
    )
    nll, correct, confidence = _chunked_block_scores(
        model, blocks, batch_size, progress
    )
    metrics = _metrics(nll, correct, confidence)
    if both:
        with paper_rule(model):
            metrics["paper_rule"] = _metrics(
                *_chunked_block_scores(
                    model, blocks, batch_size, progress, len(blocks)
                )
            )
        metrics["scoring_temperature"] = temperature
    progress.close()
    return metrics, nll, correct


def _chunked_block_scores(model, blocks, batch_size, progress, done=0):
    """`block_scores` a few batches at a time, reporting `progress` (the
    batches, and so the numbers, are those of one call)."""
    blocks = np.asarray(blocks, "int32")
    chunk = 8 * batch_size
    parts = []
    for start in range(0, len(blocks), chunk):
        parts.append(
            block_scores(model, blocks[start : start + chunk], batch_size)
        )
        progress.update(done + min(start + chunk, len(blocks)))
    if not parts:
        return block_scores(model, blocks, batch_size)
    return tuple(np.concatenate(p) for p in zip(*parts))


# --- Text requests --------------------------------------------------------------


def encode_text(tokenizer, text):
    return [
        int(t)
        for t in np.asarray(ops.convert_to_numpy(tokenizer(text))).reshape(-1)
    ]


def pad_batch(seqs):
    """Right-pads token lists: `(ids [n, max_len], mask [n, max_len])`."""
    length = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), length), "int32")
    mask = np.zeros((len(seqs), length), "int32")
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def _decode(tokenizer, ids):
    text = tokenizer.detokenize(np.asarray(ids, "int32"))
    if not isinstance(text, str):
        text = np.asarray(ops.convert_to_numpy(text)).item()
    return text.decode("utf-8") if isinstance(text, bytes) else text


def encode_pair(tokenizer, context, continuation):
    """Token ids of `<s> context` and of the continuation, split like
    lm-eval's `_encode_pair`: a trailing space of the context moves to the
    continuation, the pair is encoded whole, and the continuation is what
    follows the encoded context. Every sequence starts with `<s>`, as the
    models saw it in training."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    bos = [tokenizer.start_token_id]
    whole = encode_text(tokenizer, context + continuation)
    context_ids = encode_text(tokenizer, context)
    return bos + context_ids, whole[len(context_ids) :]


def loglikelihoods(
    model,
    tokenizer,
    requests,
    batch_size=8,
    reference=False,
    progress=None,
    label="loglikelihood",
    unit="requests",
    on_batch=None,
    encoded=None,
):
    """lm-eval style log-likelihood requests.

    Args:
        requests: list of `(context, continuation)` strings.
        batch_size: requests per batch (sorted longest first).
        reference: score with `reference_next_token_scores` (the eager
            path; for checks and `benchmarks.benchmark_evaluation`).
        progress: report progress (`keras_mhf.utils.progress.Progress`;
            `None`: the `show_progress` setting).
        label, unit: the progress line's label and unit.
        on_batch: called after each batch with the request indices it
            scored and their results (to stream results as they come).
        encoded: the requests' `encode_pair` ids, when the caller has them
            (to score the same requests under several rules, encoding them
            once).

    Returns:
        list of `(log_likelihood, is_greedy)`: the summed log-probability of
        the continuation's tokens given the context, and whether each of them
        is the argmax under teacher forcing.
    """
    progress = Progress(label, len(requests), unit, progress)
    if encoded is None:
        encoded = [encode_pair(tokenizer, c, x) for c, x in requests]
    results = [None] * len(encoded)
    order = sorted(
        range(len(encoded)),
        key=lambda i: -len(encoded[i][0]) - len(encoded[i][1]),
    )
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        ids, mask = pad_batch([encoded[i][0] + encoded[i][1] for i in batch])
        if reference:
            log_probs, is_argmax = reference_next_token_scores(model, ids, mask)
        else:
            log_probs, is_argmax = next_token_scores(
                model, ids, mask, batch_size
            )
        for row, i in enumerate(batch):
            context, continuation = encoded[i]
            positions = np.arange(
                len(context) - 1, len(context) + len(continuation) - 1
            )
            results[i] = (
                float(log_probs[row, positions].sum()),
                bool(np.all(is_argmax[row, positions])),
            )
        if on_batch is not None:
            on_batch(batch, [results[i] for i in batch])
        progress.update(min(start + batch_size, len(order)))
    progress.close()
    return results


def encode_documents(tokenizer, texts, max_length=256):
    """Each text on its own as `<s>` + its tokens, truncated to `max_length`,
    with the characters those tokens cover (texts of one token or none are
    skipped): `(sequences, characters)`. Encode once, score many times with
    `encoded_document_likelihood`.

    Example:

    ```python
    encoded = encode_documents(lm.preprocessor.tokenizer, ["Some text."])
    encoded_document_likelihood(lm, encoded)["bits_per_character"]
    ```
    """
    seqs, chars = [], 0
    for text in texts:
        ids = ([tokenizer.start_token_id] + encode_text(tokenizer, text))[
            :max_length
        ]
        if len(ids) < 2:
            continue
        seqs.append(ids)
        # Characters covered by the (possibly truncated) tokens.
        chars += (
            len(text)
            if len(ids) < max_length
            else len(_decode(tokenizer, ids[1:]))
        )
    return seqs, chars


def encoded_document_likelihood(model, encoded, batch_size=8):
    """`document_likelihood` of `encode_documents`' output, under the
    model's current scoring rule (sequences are batched by length, so
    little is padded)."""
    seqs, chars = encoded
    if not seqs or not chars:
        raise ValueError("No text to score: every document was empty.")
    seqs = sorted(seqs, key=len)
    nll, tokens = 0.0, 0
    for start in range(0, len(seqs), batch_size):
        ids, mask = pad_batch(seqs[start : start + batch_size])
        lls = token_log_likelihoods(model, ids, mask, batch_size=batch_size)
        valid = mask[:, 1:].astype(bool)
        nll -= float(lls[valid].astype("float64").sum())
        tokens += int(valid.sum())
    return {
        "perplexity": float(np.exp(nll / tokens)),
        "nats_per_character": nll / chars,
        "bits_per_character": nll / chars / np.log(2.0),
        "tokens_per_character": tokens / chars,
        "tokens": tokens,
        "characters": chars,
    }


def document_likelihood(model, tokenizer, texts, max_length=256, batch_size=8):
    """Scores each text on its own (`<s>` + tokens, truncated to
    `max_length`): a tokenizer-independent view for comparing vocabularies.

    Returns:
        dict with `perplexity` (per token), `nats_per_character`,
        `bits_per_character`, `tokens_per_character`, `tokens` and
        `characters`.
    """
    return encoded_document_likelihood(
        model, encode_documents(tokenizer, texts, max_length), batch_size
    )
