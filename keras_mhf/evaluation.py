"""Evaluation of MultiHashFormer and Standard causal LMs, computed the way
lm-eval computes it: log-likelihoods from log-softmax over the real
vocabulary (MHF: paper Sec. 3.4, inference), per-token, per-example.

Every function takes a KerasHub causal LM whose `score()` returns `[b, s, V]`
scores (`MultiHashFormerCausalLM` or the Standard `Qwen3CausalLM`) and its
tokenizer.
"""

import contextlib
import os
import sys

import numpy as np
from keras import ops

from keras_mhf.calibration import expected_calibration_error
from keras_mhf.models.next_token_scorer import NextTokenScorer
from keras_mhf.utils.progress import Progress
from keras_mhf.utils.progress import progress_enabled


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
    """`next_token_scores` through the eager `model.score()` and numpy, as
    evaluation computed it before the compiled scorer (kept to check that
    both give the same numbers, and to measure the speed-up)."""
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
    return _perplexity(model, blocks, batch_size, progress, label)[0]


def _perplexity(model, blocks, batch_size, progress=None, label="perplexity"):
    """`(perplexity metrics, per-token nll [n, L], per-token hits)`."""
    temperature = getattr(model, "scoring_temperature", None)
    two_rules = temperature is not None and temperature != 1.0
    progress = Progress(
        label, len(blocks) * (2 if two_rules else 1), "blocks", progress
    )
    nll, correct, confidence = _chunked_block_scores(
        model, blocks, batch_size, progress
    )
    metrics = _metrics(nll, correct, confidence)
    if two_rules:
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


# --- Task data --------------------------------------------------------------


def _encode(tokenizer, text):
    return [
        int(t)
        for t in np.asarray(ops.convert_to_numpy(tokenizer(text))).reshape(-1)
    ]


def _pad_batch(seqs):
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
    whole = _encode(tokenizer, context + continuation)
    context_ids = _encode(tokenizer, context)
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
):
    """lm-eval style log-likelihood requests.

    Args:
        requests: list of `(context, continuation)` strings.
        batch_size: requests per batch (sorted longest first).
        reference: score with `reference_next_token_scores` (the eager path
            evaluation used before the compiled scorer; for checks and
            `tools/benchmark_evaluation.py`).
        progress: report progress (`keras_mhf.utils.progress.Progress`;
            `None`: the `show_progress` setting).
        label, unit: the progress line's label and unit.
        on_batch: called after each batch with the request indices it
            scored and their results (to stream results as they come).

    Returns:
        list of `(log_likelihood, is_greedy)`: the summed log-probability of
        the continuation's tokens given the context, and whether each of them
        is the argmax under teacher forcing.
    """
    progress = Progress(label, len(requests), unit, progress)
    encoded = [encode_pair(tokenizer, c, x) for c, x in requests]
    results = [None] * len(encoded)
    order = sorted(
        range(len(encoded)),
        key=lambda i: -len(encoded[i][0]) - len(encoded[i][1]),
    )
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        ids, mask = _pad_batch([encoded[i][0] + encoded[i][1] for i in batch])
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


def read_jsonl(path):
    import json

    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_last_word_file(documents, path, count=100, max_words=60):
    """Writes LAMBADA-format JSONL from held-out documents: each passage is a
    document's first `max_words` words, and its last word, without trailing
    punctuation, is the target (passages whose last word is not alphabetic
    are skipped)."""
    import json

    written = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in documents:
            words = doc.split()[:max_words]
            if len(words) < 8:
                continue
            words[-1] = words[-1].rstrip(".,;:!?\"')")
            if not words[-1].isalpha():
                continue
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
            written += 1
            if written == count:
                break
    return path


def lambada(
    model,
    tokenizer,
    path,
    batch_size=8,
    limit=None,
    progress=None,
    results=None,
):
    """LAMBADA in OpenAI's `lambada_test.jsonl` format (`{"text": ...}`).

    The target is the last space-separated word; accuracy counts examples
    whose every target token is the greedy choice, and perplexity is
    `exp(-mean log-likelihood of the target)`, as lm-eval's `lambada_openai`.
    `progress` reports the passages scored (`None`: the `show_progress`
    setting). With `results` (a `keras_mhf.evaluation_results.TaskResults`)
    each passage's record is written as soon as it is scored, and passages
    an earlier run recorded are not scored again.

    Returns:
        `(metrics, per_example)`.
    """
    docs = read_jsonl(path)[:limit]
    requests = []
    for doc in docs:
        context, word = doc["text"].rsplit(" ", 1)
        requests.append((context, " " + word))

    def record(index, result):
        context, target = requests[index]
        return {
            "context": context,
            "target": target,
            "loglikelihood": result[0],
            "correct": result[1],
        }

    examples = _scored_examples(
        model,
        tokenizer,
        requests,
        [[i] for i in range(len(requests))],
        lambda index, found: record(index, found[0]),
        batch_size,
        progress,
        f"lambada {path}",
        "passages",
        results,
    )
    lls = np.array([e["loglikelihood"] for e in examples])
    metrics = {
        "acc": float(np.mean([e["correct"] for e in examples])),
        "perplexity": float(np.exp(-lls.mean())),
        "examples": len(docs),
    }
    return metrics, examples


def _scored_examples(
    model,
    tokenizer,
    requests,
    example_requests,
    make_record,
    batch_size,
    progress,
    label,
    unit,
    results=None,
):
    """Scores the requests of the examples `results` has not recorded yet
    and returns every example's record, in example order.

    `example_requests[k]` lists example k's request indices;
    `make_record(k, [(log_likelihood, is_greedy), ...])` makes its record,
    written to `results` (if given) as soon as its last request is scored.
    """
    done = {} if results is None else dict(results.done)
    todo = [k for k in range(len(example_requests)) if k not in done]
    owner, pending = {}, {}
    for k in todo:
        pending[k] = {}
        for request in example_requests[k]:
            owner[request] = k
    order = [r for k in todo for r in example_requests[k]]

    def on_batch(batch, found):
        for local, result in zip(batch, found):
            k = owner[order[local]]
            pending[k][order[local]] = result
            if len(pending[k]) == len(example_requests[k]):
                parts = pending.pop(k)
                record = make_record(k, [parts[r] for r in example_requests[k]])
                if results is not None:
                    results.add(k, record)
                done[k] = record

    loglikelihoods(
        model,
        tokenizer,
        [requests[r] for r in order],
        batch_size,
        progress=progress,
        label=label,
        unit=unit,
        on_batch=on_batch,
    )
    return [
        {key: v for key, v in done[k].items() if key not in _LINE_KEYS}
        for k in range(len(example_requests))
    ]


# Keys of a results line that are not the example's own record.
_LINE_KEYS = ("task", "file", "index")


def multiple_choice(
    model,
    tokenizer,
    path,
    batch_size=8,
    limit=None,
    progress=None,
    results=None,
):
    """Multiple choice in `{"query", "choices": [...], "gold": i}` JSONL.

    Each choice is scored as the continuation `" " + choice` of the query;
    `acc` takes the highest summed log-likelihood, `acc_norm` the highest
    log-likelihood per character of the choice, like lm-eval. `progress`
    reports the choices scored (`None`: the `show_progress` setting).
    `results` streams and resumes, as for `lambada`.

    Returns:
        `(metrics, per_example)`.
    """
    docs = read_jsonl(path)[:limit]
    requests, example_requests = [], []
    for d in docs:
        start = len(requests)
        requests.extend((d["query"], " " + c) for c in d["choices"])
        example_requests.append(list(range(start, len(requests))))

    def record(index, found):
        d = docs[index]
        lls = np.array([r[0] for r in found])
        lengths = np.array([len(c) for c in d["choices"]], "float64")
        return {
            "query": d["query"],
            "loglikelihoods": lls.tolist(),
            "prediction": int(lls.argmax()),
            "prediction_norm": int((lls / lengths).argmax()),
            "gold": d["gold"],
        }

    examples = _scored_examples(
        model,
        tokenizer,
        requests,
        example_requests,
        record,
        batch_size,
        progress,
        f"multiple choice {path}",
        "choices",
        results,
    )
    return {
        "acc": float(np.mean([e["prediction"] == e["gold"] for e in examples])),
        "acc_norm": float(
            np.mean([e["prediction_norm"] == e["gold"] for e in examples])
        ),
        "examples": len(docs),
    }, examples


def last_token_hidden_states(model, tokenizer, texts, batch_size=16):
    """Hidden state of each text's last token from the final layer (after
    the final norm) and from the second-to-last block, as in the paper's
    Sec. 4.3 (Hugging Face `hidden_states[-1]` and `[-2]`)."""
    backbone = model.backbone
    target_block = backbone.num_layers - 2
    finals, penultimates = [], []
    for start in range(0, len(texts), batch_size):
        ids, mask = _pad_batch(
            [
                [tokenizer.start_token_id] + _encode(tokenizer, t)
                for t in texts[start : start + batch_size]
            ]
        )
        captured = {}

        def intercept(x, i):
            if i == target_block:
                captured["h"] = x
            return x

        if target_block >= 0:
            model.score(ids, mask, layer_intercept_fn=intercept)
        final = np.asarray(
            ops.convert_to_numpy(
                backbone({"token_ids": ids, "padding_mask": mask})
            ),
            "float32",
        )
        last = mask.sum(1) - 1
        rows = np.arange(len(ids))
        finals.append(final[rows, last])
        if target_block >= 0:
            h = np.asarray(ops.convert_to_numpy(captured["h"]), "float32")
        else:  # a one-layer model: the second-to-last "layer" is the embedding
            h = (
                np.asarray(ops.convert_to_numpy(backbone.embed(ids)), "float32")
                if hasattr(backbone, "embed")
                else final
            )
        penultimates.append(h[rows, last])
    return np.concatenate(finals), np.concatenate(penultimates)


def _ranks(x):
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), "float64")
    ranks[order] = np.arange(len(x))
    # Average ranks of ties.
    values = np.asarray(x)[order]
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or values[end] != values[start]:
            ranks[order[start:end]] = (start + end - 1) / 2.0
            start = end
    return ranks


def pearson(x, y):
    x, y = np.asarray(x, "float64"), np.asarray(y, "float64")
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / np.sqrt((x * x).sum() * (y * y).sum()))


def spearman(x, y):
    return pearson(_ranks(x), _ranks(y))


def rare_word_similarity(model, tokenizer, path, batch_size=16, limit=None):
    """Card-660-format word similarity (TSV `word1<TAB>word2<TAB>score`;
    `_` in multi-word terms is read as a space).

    Cosine similarity of the last token's hidden states (final layer and
    second-to-last layer) against the human scores, Pearson and Spearman
    (paper Sec. 4.3).

    Returns:
        `(metrics, per_example)`.
    """
    pairs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3:
                raise ValueError(
                    f"{path}:{number}: expected word1<TAB>word2<TAB>score."
                )
            pairs.append(
                (
                    parts[0].replace("_", " "),
                    parts[1].replace("_", " "),
                    float(parts[2]),
                )
            )
    pairs = pairs[:limit]
    words = sorted({w for p in pairs for w in p[:2]})
    final, penultimate = last_token_hidden_states(
        model, tokenizer, words, batch_size
    )
    index = {w: i for i, w in enumerate(words)}

    def cosine(a, b):
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))

    gold = [p[2] for p in pairs]
    metrics, examples = {"pairs": len(pairs)}, []
    sims = {}
    for name, states in (("final", final), ("second_to_last", penultimate)):
        sims[name] = [
            cosine(states[index[a]], states[index[b]]) for a, b, _ in pairs
        ]
        metrics[f"{name}_pearson"] = pearson(sims[name], gold)
        metrics[f"{name}_spearman"] = spearman(sims[name], gold)
    for k, (a, b, score) in enumerate(pairs):
        examples.append(
            {
                "word1": a,
                "word2": b,
                "gold": score,
                "cosine_final": sims["final"][k],
                "cosine_second_to_last": sims["second_to_last"][k],
            }
        )
    return metrics, examples


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
        ids = ([tokenizer.start_token_id] + _encode(tokenizer, text))[
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
        ids, mask = _pad_batch(seqs[start : start + batch_size])
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


def evaluate_preset(
    preset,
    perplexity_files=(),
    lambada_files=(),
    multiple_choice_files=(),
    card660_files=(),
    sequence_length=128,
    max_blocks=256,
    limit=None,
    batch_size=8,
    output=None,
    progress=None,
):
    """Loads a MHF or Standard preset and runs the requested evaluations
    (the engine behind `recipes/evaluate.py`).

    `progress` reports each long task's progress with an ETA on stderr
    (`None`: the `keras_mhf.utils.progress.show_progress` setting).

    Results are keyed `"<task>:<path as given>"`, so two files with the same
    name in different folders stay apart. `output` gets one JSON line per
    example (perplexity: one per block, with its NLL and accuracy) as soon
    as it is scored, and each task's metrics when it ends
    (`keras_mhf.evaluation_results`); rerun with the same `output`, an
    interrupted evaluation resumes: finished tasks and recorded examples
    are not scored again.

    Returns:
        `{task_key: metrics}`.
    """
    import keras_hub

    from keras_mhf.evaluation_results import EvaluationResults

    model = keras_hub.models.CausalLM.from_preset(preset)
    tokenizer = model.preprocessor.tokenizer
    settings = {
        "preset": os.path.abspath(preset),
        "preset_sha256": _preset_sha256(preset),
        "sequence_length": sequence_length,
        "max_blocks": max_blocks,
        "limit": limit,
    }
    tasks = (
        [("perplexity", path) for path in perplexity_files]
        + [("lambada", path) for path in lambada_files]
        + [("multiple_choice", path) for path in multiple_choice_files]
        + [("rare_words", path) for path in card660_files]
    )
    if output is None:
        log = contextlib.nullcontext(None)
    else:
        log = EvaluationResults.open(output, settings)
    results = {}
    with log as log:
        for task, path in tasks:
            stream = None if log is None else log.task(task, path)
            if stream is not None and stream.metrics is not None:
                metrics = stream.metrics  # finished in an earlier run
            else:
                metrics = _evaluate_task(
                    model,
                    tokenizer,
                    task,
                    path,
                    stream,
                    sequence_length,
                    max_blocks,
                    limit,
                    batch_size,
                    progress,
                )
                if stream is not None:
                    stream.finish(metrics)
            results[f"{task}:{path}"] = metrics
    scorer = NextTokenScorer._cache.get(model, {}).get(batch_size)
    if scorer is not None and progress_enabled(progress):
        shapes = sorted(scorer.shapes)
        sys.stderr.write(
            f"Scored with {len(shapes)} compiled scoring shapes (batch x "
            f"length): {', '.join(f'{b}x{n}' for b, n in shapes)}\n"
        )
    return results


def _preset_sha256(preset):
    """One sha256 over the preset's config, task and weights files."""
    import hashlib

    from keras_mhf.utils.files import file_sha256

    digest = hashlib.sha256()
    for name in ("config.json", "task.json", "model.weights.h5"):
        path = os.path.join(preset, name)
        if os.path.exists(path):
            digest.update(f"{name}:{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def _evaluate_task(
    model,
    tokenizer,
    task,
    path,
    stream,
    sequence_length,
    max_blocks,
    limit,
    batch_size,
    progress,
):
    """One task of `evaluate_preset`: its metrics; per-example records go
    to `stream` (a `TaskResults`, or `None`)."""
    if task in ("lambada", "multiple_choice"):
        run = lambada if task == "lambada" else multiple_choice
        metrics, _ = run(
            model, tokenizer, path, batch_size, limit, progress, stream
        )
        return metrics
    if task == "perplexity":
        import sentencepiece as spm

        from keras_mhf.data import pack_documents
        from keras_mhf.data import read_documents

        sp = spm.SentencePieceProcessor(model_proto=tokenizer.proto)
        blocks = pack_documents(
            read_documents(path),
            sp.encode,
            tokenizer.start_token_id,
            sequence_length,
        )[:max_blocks]
        metrics, nll, correct = _perplexity(
            model, blocks, batch_size, progress, f"perplexity {path}"
        )
        examples = [
            {
                "block": i,
                "loss": float(n.mean()),
                "accuracy": float(c.mean()),
                "tokens": int(n.size),
            }
            for i, (n, c) in enumerate(zip(nll, correct))
        ]
    else:
        metrics, examples = rare_word_similarity(
            model, tokenizer, path, batch_size, limit
        )
    if stream is not None:
        for index, example in enumerate(examples):
            stream.add(index, example)
    return metrics
