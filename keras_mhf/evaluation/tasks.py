"""The evaluation tasks read from files: LAMBADA and multiple choice,
scored as lm-eval scores them (`keras_mhf.evaluation.scoring`), with
per-example records streamed to an `EvaluationResults` file."""

import json
import warnings

import numpy as np

from keras_mhf.evaluation.scoring import loglikelihoods

# With on_error="skip", each of the first bad lines gets its own warning.
WARN_LINES = 20


class TaskFileError(ValueError):
    """A task file that cannot be scored as it is: a bad line (named
    `file:line`), or no example at all."""


class TaskFileWarning(UserWarning):
    """A bad task-file line left out with `on_error="skip"`."""


def read_task_file(path, parse, on_error="fail", limit=None, unit="examples"):
    """The examples of a task file, one per non-blank line, in order.

    Args:
        path: the file (UTF-8).
        parse: `parse(line) -> example`; raises `ValueError` saying what is
            wrong with the line.
        on_error: `"fail"`: a bad line raises `TaskFileError` naming
            `file:line`; `"skip"`: it is left out with a `TaskFileWarning`
            (the first `WARN_LINES` one by one, then a count).
        limit: read at most this many examples.
        unit: what an example is, for the messages.

    Returns:
        `(examples, skipped)`.

    Raises:
        TaskFileError: a bad line (with `"fail"`), or no example to score.

    Example:

    ```python
    examples, skipped = read_task_file("piqa.jsonl", parse_multiple_choice)
    ```
    """
    if on_error not in ("fail", "skip"):
        raise ValueError(
            f"on_error must be 'fail' or 'skip', got {on_error!r}."
        )
    examples, skipped = [], 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if limit is not None and len(examples) >= limit:
                break
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                examples.append(parse(line))
                continue
            except ValueError as error:  # UnicodeDecodeError, JSON, parse
                problem = str(error).rstrip(".")
            if on_error == "fail":
                raise TaskFileError(
                    f"{path}:{number}: {problem}. Fix or remove the line, or "
                    "pass --on-error skip (on_error='skip') to leave bad "
                    "lines out."
                )
            skipped += 1
            if skipped <= WARN_LINES:
                warnings.warn(
                    f"{path}:{number}: {problem}; left out.",
                    TaskFileWarning,
                    stacklevel=2,
                )
    if skipped > WARN_LINES:
        warnings.warn(
            f"{path}: {skipped} bad lines left out in all.",
            TaskFileWarning,
            stacklevel=2,
        )
    if not examples:
        raise TaskFileError(
            f"{path} holds no {unit} to score"
            + (f" ({skipped} bad lines left out)" if skipped else "")
            + ": give a file with at least one."
        )
    return examples, skipped


def json_object(line):
    """The JSON object on `line` (`ValueError` saying what is wrong)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"not valid JSON ({error.msg.removesuffix(' at')} at column "
            f"{error.colno})"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {_kind(record)}")
    return record


def _kind(value):
    return "null" if value is None else f"a {type(value).__name__}"


def _string(record, key, what):
    if key not in record:
        fields = ", ".join(map(repr, list(record)[:6])) or "none"
        raise ValueError(f"no {key!r} field ({what}; its fields: {fields})")
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        shown = "an empty string" if value == "" else _kind(value)
        raise ValueError(f"{key!r} is {shown}, not a non-empty string")
    return value


def parse_lambada(line):
    """A LAMBADA line (`{"text": ...}`) as `(context, " " + last word)`."""
    text = _string(json_object(line), "text", "LAMBADA needs the passage")
    parts = text.strip().rsplit(" ", 1)
    if len(parts) < 2 or not parts[0].strip():
        raise ValueError(
            "'text' has a single word: LAMBADA needs a context before the "
            "last word"
        )
    return parts[0], " " + parts[1]


def parse_multiple_choice(line):
    """A multiple-choice line (`{"query", "choices": [...], "gold": i}`),
    checked: at least two non-empty string choices and `gold` an integer
    index into them."""
    record = json_object(line)
    query = _string(record, "query", "the question or context")
    choices = record.get("choices")
    if not isinstance(choices, list) or len(choices) < 2:
        count = len(choices) if isinstance(choices, list) else _kind(choices)
        raise ValueError(
            f"'choices' must be a list of at least 2 answers, got {count}"
        )
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice.strip():
            raise ValueError(f"choice {i} is {_kind(choice)}, not a string")
    if "gold" not in record:
        raise ValueError("no 'gold' field (the index of the right choice)")
    gold = record["gold"]
    if isinstance(gold, bool) or not isinstance(gold, int):
        raise ValueError(
            f"'gold' must be the integer index of the right choice, got "
            f"{gold!r}"
        )
    if not 0 <= gold < len(choices):
        raise ValueError(
            f"'gold' is {gold}, outside the {len(choices)} choices "
            f"(0..{len(choices) - 1})"
        )
    return {"query": query, "choices": choices, "gold": gold}


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
    on_error="fail",
):
    """LAMBADA in OpenAI's `lambada_test.jsonl` format (`{"text": ...}`).

    The target is the last space-separated word; accuracy counts examples
    whose every target token is the greedy choice, and perplexity is
    `exp(-mean log-likelihood of the target)`, as lm-eval's `lambada_openai`.
    `progress` reports the passages scored (`None`: the `show_progress`
    setting). With `results` (a `keras_mhf.evaluation.evaluation_results.TaskResults`)
    each passage's record is written as soon as it is scored, and passages
    an earlier run recorded are not scored again. A bad line (not JSON, no
    `text`, a single word) raises `TaskFileError` naming `file:line`, or
    with `on_error="skip"` is left out (counted in `skipped_lines`); a file
    with no passage raises.

    Returns:
        `(metrics, per_example)`.
    """
    requests, skipped = read_task_file(
        path, parse_lambada, on_error, limit, "passages"
    )

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
        "examples": len(requests),
    }
    return _with_skipped(metrics, skipped), examples


def _with_skipped(metrics, skipped):
    """`metrics` with the count of bad lines left out, when there were."""
    return metrics | ({"skipped_lines": skipped} if skipped else {})


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
    on_error="fail",
):
    """Multiple choice in `{"query", "choices": [...], "gold": i}` JSONL.

    Each choice is scored as the continuation `" " + choice` of the query;
    `acc` takes the highest summed log-likelihood, `acc_norm` the highest
    log-likelihood per character of the choice, like lm-eval. `progress`
    reports the choices scored (`None`: the `show_progress` setting).
    `results` streams and resumes, and `on_error` acts, as for `lambada`
    (bad lines: not JSON, a missing or empty `query`, fewer than two
    `choices`, a `gold` that is not an index into them).

    Returns:
        `(metrics, per_example)`.
    """
    docs, skipped = read_task_file(
        path, parse_multiple_choice, on_error, limit, "questions"
    )
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
    metrics = {
        "acc": float(np.mean([e["prediction"] == e["gold"] for e in examples])),
        "acc_norm": float(
            np.mean([e["prediction_norm"] == e["gold"] for e in examples])
        ),
        "examples": len(docs),
    }
    return _with_skipped(metrics, skipped), examples
