"""The evaluation tasks read from files: LAMBADA and multiple choice,
scored as lm-eval scores them (`keras_mhf.evaluation.scoring`), with
per-example records streamed to an `EvaluationResults` file."""

import numpy as np

from keras_mhf.evaluation.scoring import loglikelihoods


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
    setting). With `results` (a `keras_mhf.evaluation.evaluation_results.TaskResults`)
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
