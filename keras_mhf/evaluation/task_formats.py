"""The paper's ten English tasks (Sec. 4.3), read from the files users hold
and prompted exactly as lm-eval 0.4's task definitions prompt them.

Each task reads, line by line, the rows of the Hugging Face dataset lm-eval
loads for it (exported as JSON lines) and the pre-formatted files of
llm-foundry and lm-eval (`{"query", "choices", "gold"}`; for LAMBADA also
OpenAI's `{"text"}` and llm-foundry's `{"context", "continuation"}`). A row
becomes lm-eval's requests: the context is the task's `doc_to_text`, each
choice is scored as the continuation `delimiter + choice` (`delimiter`:
lm-eval's `target_delimiter`, `" "` for every task here), and the metrics
are the task's `metric_list`: `acc` takes the choice of highest summed
log-likelihood, `acc_norm` the highest per character of the choice, ReCoRD
scores its best entity with SQuAD's token F1 and exact match.

The tasks: `lambada`, `arc_easy`, `copa`, `openbookqa`, `piqa`, `hellaswag`,
`race`, `sciq`, `siqa`, `record` (`TASKS` lists each one's formats; the
table of rows, prompts and metrics is in docs/evaluation.md).

Example:

```python
parse = task_parser("piqa")
parse('{"goal": "Boil water", "sol1": "Heat it.", "sol2": "Cool it.", '
      '"label": 0}')
# {'query': 'Question: Boil water\\nAnswer:', 'choices': ['Heat it.',
#  'Cool it.'], 'gold': 0}
```
"""

import ast
import collections
import json
import re
import string

import numpy as np

# lm-eval's names of the tasks, and other names users know them by.
ALIASES = {
    "lambada_openai": "lambada",
    # Same prompt as ARC-Easy (lm-eval's arc_challenge includes it).
    "arc_challenge": "arc_easy",
    "obqa": "openbookqa",
    "social_iqa": "siqa",
}
# lm-eval's `target_delimiter` (the default, " ", for all ten tasks).
DELIMITER = " "
# RACE's answer letters: its questions have 4 options, and lm-eval's race
# task scores 4 (its `doc_to_choice`) and reads the letters A to D.
RACE_LETTERS = ("A", "B", "C", "D")


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


def _fields(record, *keys):
    return all(k in record for k in keys)


def _text(record, key):
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{key!r} is {_kind(value)}, not a string")
    return value


def _string(record, key, what):
    """A non-empty string field; a missing one names the record's fields."""
    if key not in record:
        fields = ", ".join(map(repr, list(record)[:6])) or "none"
        raise ValueError(f"no {key!r} field ({what}; its fields: {fields})")
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        shown = "an empty string" if value == "" else _kind(value)
        raise ValueError(f"{key!r} is {shown}, not a non-empty string")
    return value


def lambada_parser(delimiter=None):
    """`parse(line) -> (context, continuation)` for LAMBADA lines:
    `{"text"}` (OpenAI, EleutherAI/lambada_openai; lm-eval's
    `lambada_openai`: the text but its last word, and `" " + last word`) or
    `{"context", "continuation"}` (llm-foundry: the continuation follows
    `delimiter`, `" "` unless given)."""
    delimiter = DELIMITER if delimiter is None else delimiter

    def parse(line):
        record = json_object(line)
        if "text" not in record and _fields(record, "context", "continuation"):
            return (
                _string(record, "context", "the passage"),
                delimiter + _string(record, "continuation", "its last word"),
            )
        text = _string(
            record,
            "text",
            "LAMBADA needs the passage, or 'context' and 'continuation'",
        )
        parts = text.strip().rsplit(" ", 1)
        if len(parts) < 2 or not parts[0].strip():
            raise ValueError(
                "'text' has a single word: LAMBADA needs a context before the "
                "last word"
            )
        return parts[0], delimiter + parts[1]

    return parse


def multiple_choice_record(record):
    """A `{"query", "choices": [...], "gold": i}` record, checked: at least
    two non-empty string choices and `gold` an integer index into them."""
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


def parse_lambada(line):
    """A LAMBADA line as `(context, " " + last word)` (`lambada_parser`)."""
    return lambada_parser()(line)


def parse_multiple_choice(line):
    """A `{"query", "choices": [...], "gold": i}` line
    (`multiple_choice_record`)."""
    return multiple_choice_record(json_object(line))


def _strings(record, key, minimum=2):
    value = record[key]
    if (
        not isinstance(value, list)
        or len(value) < minimum
        or not all(isinstance(v, str) for v in value)
    ):
        raise ValueError(
            f"{key!r} must be a list of at least {minimum} strings, got "
            f"{value!r:.80}"
        )
    return value


def _index(value, count, what):
    """An integer label (`3`, `"3"`) checked against `count` choices."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if not 0 <= value < count:
        raise ValueError(
            f"{what} is {value}, outside the {count} choices (0..{count - 1})"
        )
    return value


def _labelled(record, key, answer_key, strip=False):
    """`choices: {"text": [...], "label": [...]}` and a letter answer key
    (ARC, OpenBookQA)."""
    choices = record[key]
    if not isinstance(choices, dict) or not _fields(choices, "text", "label"):
        raise ValueError(
            f"{key!r} must be an object with 'text' and 'label' lists"
        )
    texts = _strings(choices, "text")
    labels = choices["label"]
    if not isinstance(labels, list) or not all(
        isinstance(label, str) for label in labels
    ):
        raise ValueError(
            f"'{key}.label' must be a list of strings, got {labels!r:.80}"
        )
    if len(labels) != len(texts):
        raise ValueError(
            f"{key!r} has {len(texts)} texts but {len(labels)} labels: "
            "each answer needs its label"
        )
    if len(set(labels)) < len(labels):
        raise ValueError(
            f"{key!r} labels {labels} repeat a label: each answer needs its own"
        )
    answer = _text(record, answer_key)
    answer = answer.lstrip() if strip else answer
    if answer not in labels:
        raise ValueError(
            f"{answer_key!r} is {answer!r}, not one of the labels {labels}"
        )
    return texts, labels.index(answer)


def _arc(record):
    choices, gold = _labelled(record, "choices", "answerKey")
    question = _text(record, "question")
    return {
        "query": f"Question: {question}\nAnswer:",
        "choices": choices,
        "gold": gold,
    }


def _copa_choice(choice):
    return " " + choice[0].lower() + choice[1:]


def _copa(record):
    connector = {"cause": "because", "effect": "therefore"}.get(
        record["question"]
    )
    if connector is None:
        raise ValueError(
            f"'question' is {record['question']!r}, not 'cause' or 'effect'"
        )
    choices = [_text(record, "choice1"), _text(record, "choice2")]
    if not all(choices):
        raise ValueError("'choice1' and 'choice2' must not be empty")
    return {
        # The premise's final period gives way to the connector.
        "query": _text(record, "premise").strip()[:-1] + f" {connector}",
        "choices": [_copa_choice(c) for c in choices],
        "gold": _index(record["label"], 2, "'label'"),
    }


def _openbookqa(record):
    choices, gold = _labelled(record, "choices", "answerKey", strip=True)
    return {
        "query": _text(record, "question_stem"),
        "choices": choices,
        "gold": gold,
    }


def _piqa(record):
    return {
        "query": f"Question: {_text(record, 'goal')}\nAnswer:",
        "choices": [_text(record, "sol1"), _text(record, "sol2")],
        "gold": _index(record["label"], 2, "'label'"),
    }


def _hellaswag_clean(text):
    """lm-eval's cleaning of HellaSwag text (WikiHow's bracket tags)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(record):
    context = _text(record, "ctx_a") + " " + _text(record, "ctx_b").capitalize()
    endings = _strings(record, "endings")
    return {
        "query": _hellaswag_clean(
            _text(record, "activity_label") + ": " + context
        ),
        "choices": [_hellaswag_clean(e) for e in endings],
        "gold": _index(record["label"], len(endings), "'label'"),
    }


def _race_problems(record):
    if "problems" in record:
        problems = record["problems"]
        if isinstance(problems, str):  # EleutherAI/race: a Python literal
            try:
                problems = ast.literal_eval(problems)
            except (ValueError, SyntaxError):
                raise ValueError(
                    "'problems' is not a list of {'question', 'options', "
                    "'answer'} problems"
                ) from None
    else:  # one question per row (ehovy/race)
        problems = [{k: record[k] for k in ("question", "options", "answer")}]
    if not isinstance(problems, list) or not problems:
        raise ValueError("'problems' must be a non-empty list")
    for number, problem in enumerate(problems, 1):
        if not isinstance(problem, dict) or not _fields(
            problem, "question", "options", "answer"
        ):
            raise ValueError(
                "each problem needs 'question', 'options' and 'answer'"
            )
        which = (
            "the question"
            if len(problems) == 1
            else f"problem {number} of {len(problems)}"
        )
        options = _strings(problem, "options")
        if len(options) != len(RACE_LETTERS):
            raise ValueError(
                f"{which} has {len(options)} options; RACE questions have 4 "
                "(A to D), and lm-eval's race task scores the first 4 only. "
                "Give it 4 options, or write it as a {'query', 'choices', "
                "'gold'} line to score all its options"
            )
        if problem["answer"] not in RACE_LETTERS:
            raise ValueError(
                f"the answer of {which} is {problem['answer']!r}, not one of "
                "the letters A, B, C, D of its 4 options"
            )
    return problems


def _race_answer(problem):
    return problem["options"][RACE_LETTERS.index(problem["answer"])]


def _race(record):
    problems = _race_problems(record)
    text = "Article: " + _text(record, "article") + "\n\n"
    for problem in problems[:-1]:
        if problem["question"][-6:] == "  _  .":  # a cloze: fill it in
            text += problem["question"][:-5] + _race_answer(problem) + "\n"
        else:
            text += (
                "Question: " + problem["question"] + "\n"
                "Answer: " + _race_answer(problem) + "\n"
            )
    last = problems[-1]
    return {
        "query": text + last["question"],
        "choices": list(last["options"]),
        "gold": RACE_LETTERS.index(last["answer"]),
    }


def _sciq(record):
    return {
        "query": f"{_text(record, 'support').lstrip()}\nQuestion: "
        f"{_text(record, 'question')}\nAnswer:",
        "choices": [
            _text(record, "distractor1"),
            _text(record, "distractor2"),
            _text(record, "distractor3"),
            _text(record, "correct_answer"),
        ],
        "gold": 3,
    }


def _siqa(record):
    return {
        "query": f"Q: {_text(record, 'context')} "
        f"{_text(record, 'question')}\nA:",
        "choices": [_text(record, f"answer{x}") for x in "ABC"],
        # Labels count from 1.
        "gold": _siqa_label(record["label"]),
    }


def _siqa_label(label):
    if str(label).strip() not in ("1", "2", "3") or isinstance(label, bool):
        raise ValueError(f"'label' is {label!r}, not 1, 2 or 3")
    return int(label) - 1


def _record(record):
    passage, query = _text(record, "passage"), _text(record, "query")
    if "@placeholder" not in query:
        raise ValueError(
            "'query' has no '@placeholder': every entity would give the same "
            "choice. Give the cloze query, with '@placeholder' where the "
            "answer goes"
        )
    entities = sorted(set(_strings(record, "entities", 1)))
    answers = sorted(set(_strings(record, "answers", 1)))
    if not set(answers) & set(entities):
        raise ValueError(
            f"none of the 'answers' {answers!r:.80} is among the 'entities' "
            "(the choices): no choice could be right"
        )
    initial, *highlights = passage.strip().split("\n@highlight\n")
    text = initial + "\n\n" + "".join(f"  - {h}.\n" for h in highlights)
    return {
        "query": text,
        "choices": [
            f"  - {query}".replace("@placeholder", e) for e in entities
        ],
        "entities": entities,
        "answers": answers,
    }


# --- ReCoRD's metrics (SQuAD's answer normalisation, token F1, exact match)


def _normalize_answer(text):
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text, flags=re.UNICODE)
    return " ".join(text.split())


def squad_f1(gold, prediction):
    """SQuAD's token F1 of two answers (after its normalisation)."""
    gold_tokens = _normalize_answer(gold).split()
    predicted = _normalize_answer(prediction).split()
    if not gold_tokens or not predicted:
        return float(gold_tokens == predicted)
    common = collections.Counter(gold_tokens) & collections.Counter(predicted)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_exact(gold, prediction):
    """SQuAD's exact match of two answers (after its normalisation)."""
    return float(_normalize_answer(gold) == _normalize_answer(prediction))


def choice_metrics(doc, lls):
    """acc and acc_norm of one question from its choices' log-likelihoods
    (numpy's argmax, as lm-eval: ties go to the first choice)."""
    lls = np.asarray(lls, "float64")
    lengths = np.array([len(c) for c in doc["choices"]], "float64")
    return {
        "acc": float(np.argmax(lls) == doc["gold"]),
        "acc_norm": float(np.argmax(lls / lengths) == doc["gold"]),
    }


def record_metrics(doc, lls):
    """ReCoRD: the entity of highest log-likelihood, scored against every
    answer with SQuAD's F1 and exact match (the best of them)."""
    prediction = doc["entities"][int(np.argmax(lls))]
    return {
        "f1": max(squad_f1(a, prediction) for a in doc["answers"]),
        "em": max(squad_exact(a, prediction) for a in doc["answers"]),
    }


# name -> (formats: [(fields, where they come from, read)], metrics).
GENERIC = (("query", "choices", "gold"), "llm-foundry / lm-eval", None)
TASKS = {
    "arc_easy": (
        [
            (("question", "choices", "answerKey"), "allenai/ai2_arc", _arc),
            GENERIC,
        ],
        ("acc", "acc_norm"),
    ),
    "copa": (
        [
            (
                ("premise", "choice1", "choice2", "question", "label"),
                "super_glue copa",
                _copa,
            ),
            GENERIC,
        ],
        ("acc",),
    ),
    "openbookqa": (
        [
            (
                ("question_stem", "choices", "answerKey"),
                "allenai/openbookqa",
                _openbookqa,
            ),
            GENERIC,
        ],
        ("acc", "acc_norm"),
    ),
    "piqa": (
        [(("goal", "sol1", "sol2", "label"), "piqa", _piqa), GENERIC],
        ("acc", "acc_norm"),
    ),
    "hellaswag": (
        [
            (
                ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
                "Rowan/hellaswag",
                _hellaswag,
            ),
            GENERIC,
        ],
        ("acc", "acc_norm"),
    ),
    "race": (
        [
            (("article", "problems"), "EleutherAI/race", _race),
            (
                ("article", "question", "options", "answer"),
                "ehovy/race",
                _race,
            ),
            GENERIC,
        ],
        ("acc",),
    ),
    "sciq": (
        [
            (
                (
                    "support",
                    "question",
                    "distractor1",
                    "distractor2",
                    "distractor3",
                    "correct_answer",
                ),
                "allenai/sciq",
                _sciq,
            ),
            GENERIC,
        ],
        ("acc", "acc_norm"),
    ),
    "siqa": (
        [
            (
                ("context", "question", "answerA", "answerB", "answerC"),
                "lighteval/siqa",
                _siqa,
            ),
            GENERIC,
        ],
        ("acc",),
    ),
    "record": (
        [
            (
                ("passage", "query", "entities", "answers"),
                "super_glue record",
                _record,
            ),
        ],
        ("f1", "em"),
    ),
}
MULTIPLE_CHOICE_TASKS = tuple(TASKS)
TASK_NAMES = ("lambada",) + MULTIPLE_CHOICE_TASKS


def task_name(name):
    """The canonical name of a task (`"social_iqa"` -> `"siqa"`); a
    `ValueError` listing the tasks for an unknown one."""
    canonical = ALIASES.get(name, name)
    if canonical not in TASK_NAMES:
        raise ValueError(
            f"Unknown task {name!r}: the tasks are {', '.join(TASK_NAMES)} "
            f"(lm-eval's names {', '.join(ALIASES)} work too)."
        )
    return canonical


def task_metrics(name):
    """The metrics lm-eval reports for a multiple-choice task (`None`: the
    generic `{"query", "choices", "gold"}` file: acc and acc_norm)."""
    if name is None:
        return ("acc", "acc_norm")
    return TASKS[task_name(name)][1]


def example_metrics(name, doc, lls):
    """One question's metrics for task `name` (those lm-eval reports) from
    its choices' log-likelihoods."""
    if name is not None and task_name(name) == "record":
        return record_metrics(doc, lls)
    metrics = choice_metrics(doc, lls)
    return {k: metrics[k] for k in task_metrics(name)}


def task_parser(name):
    """`parse(line) -> {"query", "choices", "gold"}` (`name` `None`: the
    generic `{"query", "choices", "gold"}` line) (ReCoRD: `entities`
    and `answers` instead of `gold`) for a multiple-choice task's JSON
    lines, in any of the task's formats; a line in none of them raises a
    `ValueError` naming the fields each format needs."""
    if name is None:
        return parse_multiple_choice
    name = task_name(name)
    formats = TASKS[name][0]

    def parse(line):
        record = json_object(line)
        for fields, _, read in formats:
            if _fields(record, *fields):
                if read is None:
                    return multiple_choice_record(record)
                try:
                    return read(record)
                except (KeyError, TypeError, IndexError) as error:
                    raise ValueError(
                        f"not a {name} row ({type(error).__name__}: {error})"
                    ) from None
        expected = " or ".join(
            "{" + ", ".join(map(repr, fields)) + "}" + f" ({source})"
            for fields, source, _ in formats
        )
        found = ", ".join(map(repr, list(record)[:8])) or "none"
        raise ValueError(f"{name} expects {expected}; this line has {found}")

    return parse
