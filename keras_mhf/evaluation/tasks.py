"""The evaluation tasks read from files: LAMBADA and multiple choice,
scored as lm-eval scores them (`keras_mhf.evaluation.scoring`), with
per-example records streamed to an `EvaluationResults` file."""

import contextlib
import warnings

import numpy as np

from keras_mhf.evaluation import task_formats
from keras_mhf.evaluation.scoring import encode_pair
from keras_mhf.evaluation.scoring import loglikelihoods
from keras_mhf.evaluation.scoring import paper_rule
from keras_mhf.evaluation.scoring import two_rules
from keras_mhf.evaluation.task_formats import lambada_parser
from keras_mhf.utils.progress import Progress

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
    examples, skipped = read_task_file("piqa.jsonl", task_parser("piqa"))
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


def last_word_passages(documents, count=100, max_words=60):
    """The LAMBADA-format passages of held-out documents (at most `count`):
    each a document's first `max_words` words, its last word, without
    trailing punctuation, the target. Documents shorter than 8 words, or
    whose last word is not alphabetic, give none."""
    passages = []
    for doc in documents:
        words = doc.split()[:max_words]
        if len(words) < 8:
            continue
        words[-1] = words[-1].rstrip(".,;:!?\"')")
        if not words[-1].isalpha():
            continue
        passages.append(" ".join(words))
        if len(passages) == count:
            break
    return passages


def write_last_word_file(documents, path, count=100, max_words=60):
    """Writes LAMBADA-format JSONL from held-out documents: each passage is a
    document's first `max_words` words, and its last word, without trailing
    punctuation, is the target (passages whose last word is not alphabetic
    are skipped; see `last_word_passages`)."""
    import json

    with open(path, "w", encoding="utf-8") as f:
        for passage in last_word_passages(documents, count, max_words):
            f.write(json.dumps({"text": passage}) + "\n")
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
    delimiter=None,
):
    """LAMBADA as lm-eval's `lambada_openai` scores it, from OpenAI's
    `lambada_test.jsonl` (`{"text": ...}`, also the rows of
    EleutherAI/lambada_openai) or llm-foundry's `{"context",
    "continuation"}` lines.

    The target is the last space-separated word (or the continuation,
    after `delimiter`: `" "` unless given); accuracy counts examples whose
    every target token is the greedy choice, and perplexity is
    `exp(-mean log-likelihood of the target)`. A MultiHashFormer whose
    `scoring_temperature` is not 1.0 is scored under both rules: the
    metrics are its calibrated rule's, with `scoring_temperature` and
    `paper_rule` (the same metrics under the paper's rule) beside them.
    `progress` reports the passages scored (`None`: the `show_progress`
    setting). With `results` (a
    `keras_mhf.evaluation.evaluation_results.TaskResults`) each passage's
    record is written as soon as it is scored, and passages an earlier run
    recorded are not scored again. A bad line (not JSON, no `text`, a
    single word) raises `TaskFileError` naming `file:line`, or with
    `on_error="skip"` is left out (counted in `skipped_lines`); a file with
    no passage raises.

    Returns:
        `(metrics, per_example)`.
    """
    requests, skipped = read_task_file(
        path, lambada_parser(delimiter), on_error, limit, "passages"
    )

    def record(index, found):
        context, target = requests[index]
        return {
            "context": context,
            "target": target,
            **{
                f"loglikelihood{suffix}": result[0][0]
                for suffix, result in found.items()
            },
            **{
                f"correct{suffix}": result[0][1]
                for suffix, result in found.items()
            },
        }

    examples = _scored_examples(
        model,
        tokenizer,
        requests,
        [[i] for i in range(len(requests))],
        record,
        batch_size,
        progress,
        f"lambada {path}",
        "passages",
        results,
    )

    def metrics(suffix):
        lls = np.array([e[f"loglikelihood{suffix}"] for e in examples])
        return {
            "acc": float(np.mean([e[f"correct{suffix}"] for e in examples])),
            "perplexity": float(np.exp(-lls.mean())),
        }

    return _task_metrics(model, metrics, len(requests), skipped), examples


def _task_metrics(model, metrics, examples, skipped):
    """A task's metrics under the model's rule, with `paper_rule` and
    `scoring_temperature` beside them when it has two, the number of
    examples and the bad lines left out."""
    result = metrics("")
    if two_rules(model):
        result["paper_rule"] = metrics(PAPER_RULE)
        result["scoring_temperature"] = model.scoring_temperature
    result["examples"] = examples
    return result | ({"skipped_lines": skipped} if skipped else {})


# Suffix of the per-example fields scored under the paper's rule.
PAPER_RULE = "_paper_rule"
# Examples scored (and their records written) at a time.
EXAMPLES_PER_CHUNK = 64


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
    `make_record(k, {suffix: [(log_likelihood, is_greedy), ...]})` makes its
    record from its requests' results under the model's rule (suffix `""`)
    and, for a model with two rules, the paper's (`PAPER_RULE`); records are
    written to `results` (if given) a chunk of examples at a time.
    """
    done = {} if results is None else dict(results.done)
    todo = [k for k in range(len(example_requests)) if k not in done]
    rules = ["", PAPER_RULE] if two_rules(model) else [""]
    total = sum(len(example_requests[k]) for k in todo) * len(rules)
    if len(rules) > 1:
        unit += " x 2 rules"
    progress = Progress(label, total, unit, progress)
    scored = 0

    def on_batch(batch, _):
        nonlocal scored
        scored += len(batch)
        progress.update(scored)

    for start in range(0, len(todo), EXAMPLES_PER_CHUNK):
        chunk = todo[start : start + EXAMPLES_PER_CHUNK]
        order = [r for k in chunk for r in example_requests[k]]
        texts = [requests[r] for r in order]
        # Encoded once, scored under each rule.
        encoded = [encode_pair(tokenizer, c, x) for c, x in texts]
        found = {}
        for suffix in rules:
            rule = paper_rule(model) if suffix else contextlib.nullcontext()
            with rule:
                found[suffix] = dict(
                    zip(
                        order,
                        loglikelihoods(
                            model,
                            tokenizer,
                            texts,
                            batch_size,
                            progress=False,
                            on_batch=on_batch,
                            encoded=encoded,
                        ),
                    )
                )
        for k in chunk:
            record = make_record(
                k,
                {
                    suffix: [by_request[r] for r in example_requests[k]]
                    for suffix, by_request in found.items()
                },
            )
            if results is not None:
                results.add(k, record)
            done[k] = record
    progress.close()
    return example_records(done, len(example_requests))


# Keys of a results line that are not the example's own record.
LINE_KEYS = ("task", "file", "index")


def example_records(done, count):
    """The records of examples `0..count-1` from `done` (`{index: results
    line}`), without the keys that place a line in its file (`LINE_KEYS`).

    Example:

    >>> example_records({0: {"task": "piqa", "index": 0, "acc": 1.0}}, 1)
    [{'acc': 1.0}]
    """
    return [
        {key: v for key, v in done[k].items() if key not in LINE_KEYS}
        for k in range(count)
    ]


def multiple_choice(
    model,
    tokenizer,
    path,
    batch_size=8,
    limit=None,
    progress=None,
    results=None,
    on_error="fail",
    task=None,
    delimiter=None,
):
    """A multiple-choice task as lm-eval scores it.

    Args:
        task: one of `keras_mhf.evaluation.task_formats.MULTIPLE_CHOICE_TASKS`
            (`"arc_easy"`, `"copa"`, `"openbookqa"`, `"piqa"`,
            `"hellaswag"`, `"race"`, `"sciq"`, `"siqa"`, `"record"`; lm-eval's
            names work too): the file holds that task's Hugging Face rows or
            pre-formatted `{"query", "choices", "gold"}` lines, prompted as
            lm-eval's task definition prompts them, and the metrics are the
            task's (acc, acc_norm, or ReCoRD's f1 and em). `None`: a
            `{"query", "choices": [...], "gold": i}` file, scored for acc and
            acc_norm.
        delimiter: what joins the prompt and each choice (lm-eval's
            `target_delimiter`; `None`: `" "`, the ten tasks' own).

    Each choice is scored as the continuation `delimiter + choice` of the
    prompt; `acc` takes the highest summed log-likelihood, `acc_norm` the
    highest log-likelihood per character of the choice, like lm-eval. Two
    rules, `progress`, `results` and `on_error` act as for `lambada` (bad
    lines: not JSON, in none of the task's formats, too few choices, a gold
    label that is not one of them, labels that do not match the choices'
    texts, a RACE question without 4 options, a ReCoRD query without
    `@placeholder`).

    Returns:
        `(metrics, per_example)`.
    """
    docs, skipped = read_task_file(
        path, task_formats.task_parser(task), on_error, limit, "questions"
    )
    delimiter = task_formats.DELIMITER if delimiter is None else delimiter
    requests, example_requests = [], []
    for d in docs:
        start = len(requests)
        requests.extend((d["query"], delimiter + c) for c in d["choices"])
        example_requests.append(list(range(start, len(requests))))

    def record(index, found):
        d = docs[index]
        lls = [r[0] for r in found[""]]
        # The choice of highest log-likelihood (ties: the first).
        line = {"query": d["query"], "prediction": int(np.argmax(lls))}
        for suffix, results_ in found.items():
            lls = [r[0] for r in results_]
            line[f"loglikelihoods{suffix}"] = lls
            line[f"metrics{suffix}"] = task_formats.example_metrics(
                task, d, lls
            )
        if "gold" in d:
            line["gold"] = d["gold"]
        return line

    examples = _scored_examples(
        model,
        tokenizer,
        requests,
        example_requests,
        record,
        batch_size,
        progress,
        f"{task or 'multiple choice'} {path}",
        "choices",
        results,
    )

    def metrics(suffix):
        return {
            name: float(
                np.mean([e[f"metrics{suffix}"][name] for e in examples])
            )
            for name in task_formats.task_metrics(task)
        }

    return _task_metrics(model, metrics, len(docs), skipped), examples
