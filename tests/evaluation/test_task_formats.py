"""The paper's ten tasks read from their Hugging Face rows and llm-foundry's
files are prompted and scored exactly as lm-eval 0.4's own task definitions
prompt and score the same rows: each hand-made row's requests (context,
continuation) equal lm-eval's, and its metrics from the same
log-likelihoods equal lm-eval's `process_results`. Backend-independent:
text and numbers only (lm-eval builds its requests without a model)."""

import json
import os
import random

import numpy as np
import pytest

from keras_mhf.evaluation import task_formats
from keras_mhf.evaluation.tasks import TaskFileError
from keras_mhf.evaluation.tasks import TaskFileWarning
from keras_mhf.evaluation.tasks import read_task_file
from tests.evaluation.harness_rows import LM_EVAL_TASKS
from tests.evaluation.harness_rows import ROWS
from tests.evaluation.harness_rows import install_squad_metrics
from tests.evaluation.harness_rows import write_lm_eval_tasks
from tests.evaluation.harness_rows import write_rows

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory):
    """lm-eval's own tasks on the hand-made rows: `{name: (task, docs)}`."""
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    install_squad_metrics()
    folder = tmp_path_factory.mktemp("harness")
    definitions, _ = write_lm_eval_tasks(str(folder))
    manager = TaskManager(include_path=definitions)
    loaded = manager.load_task_or_group([f"local_{n}" for n in LM_EVAL_TASKS])
    return {
        name: (task, list(task.eval_docs))
        for name, task in (
            (name.removeprefix("local_"), task) for name, task in loaded.items()
        )
    }


def lm_eval_requests(task, doc):
    context = task.fewshot_context(doc, 0)
    requests = task.construct_requests(doc, context)
    if not isinstance(requests, list):  # a loglikelihood task: one request
        requests = [requests]
    return [tuple(r.args) for r in requests]


def our_requests(name, row, delimiter=" "):
    line = json.dumps(row)
    if name == "lambada":
        return [task_formats.lambada_parser(delimiter)(line)]
    doc = task_formats.task_parser(name)(line)
    return [(doc["query"], delimiter + c) for c in doc["choices"]]


@pytest.mark.parametrize("name", list(LM_EVAL_TASKS))
def test_prompts_and_choices_are_lm_evals(lm_eval_tasks, name):
    task, docs = lm_eval_tasks[name]
    assert len(docs) == len(ROWS[name])
    for row, doc in zip(ROWS[name], docs):
        assert our_requests(name, row) == lm_eval_requests(task, doc), row


@pytest.mark.parametrize("name", [n for n in LM_EVAL_TASKS if n != "lambada"])
def test_metrics_are_lm_evals(lm_eval_tasks, name):
    """From the same random log-likelihoods (and ties), each row's metrics
    are those of lm-eval's `process_results`, and they are the metrics
    lm-eval reports for the task."""
    task, docs = lm_eval_tasks[name]
    rng = random.Random(0)
    for row, doc in zip(ROWS[name], docs):
        ours = task_formats.task_parser(name)(json.dumps(row))
        for trial in range(20):
            lls = [
                -rng.choice([1.0, 2.0, 3.5, rng.uniform(0, 9)])
                for _ in ours["choices"]
            ]
            expected = task.process_results(doc, [(ll, False) for ll in lls])
            got = task_formats.example_metrics(name, ours, lls)
            assert got == pytest.approx(
                {k: float(v) for k, v in expected.items()}
            ), (row, lls)
        assert set(task_formats.task_metrics(name)) == set(task.aggregation())


def test_record_metrics_match_squad(lm_eval_tasks):
    """SQuAD's normalisation: articles, punctuation and case do not count;
    partial overlaps get token F1 (against lm-eval's SQuAD-style scorer)."""
    import sys

    squad_metrics = sys.modules["transformers.data.metrics.squad_metrics"]

    pairs = [
        ("the Celsius", "Celsius"),
        ("Paris, France", "France"),
        ("An apple a day", "apple day!"),
        ("", "x"),
        ("a", ""),
    ]
    for gold, predicted in pairs:
        assert task_formats.squad_f1(gold, predicted) == pytest.approx(
            squad_metrics.compute_f1(gold, predicted)
        )
        assert task_formats.squad_exact(gold, predicted) == float(
            squad_metrics.compute_exact(gold, predicted)
        )


def test_other_formats_of_the_same_rows(lm_eval_tasks):
    """llm-foundry's LAMBADA `{"context", "continuation"}`, RACE one
    question per row, lm-eval's processed HellaSwag `{"query", "choices",
    "gold"}`, and an explicit delimiter."""
    task, docs = lm_eval_tasks["lambada"]
    for row, doc in zip(ROWS["lambada"], docs):
        context, last = row["text"].rsplit(" ", 1)
        foundry = {"context": context, "continuation": last}
        assert our_requests("lambada", foundry) == lm_eval_requests(task, doc)
        assert our_requests("lambada", foundry, "\n")[0][1] == "\n" + last
    task, docs = lm_eval_tasks["race"]
    single = ROWS["race"][1]
    problem = eval(single["problems"])[0]  # noqa: S307 (our own literal)
    row = {"article": single["article"], **problem}
    assert our_requests("race", row) == lm_eval_requests(task, docs[1])
    task, docs = lm_eval_tasks["hellaswag"]
    for doc in docs:
        processed = {k: doc[k] for k in ("query", "choices", "gold")}
        assert our_requests("hellaswag", processed) == lm_eval_requests(
            task, doc
        )
    doc = task_formats.task_parser("piqa")(json.dumps(ROWS["piqa"][0]))
    assert doc["query"] == "Question: How do I boil water?\nAnswer:"


def test_task_names_and_aliases():
    assert task_formats.task_name("social_iqa") == "siqa"
    assert task_formats.task_name("lambada_openai") == "lambada"
    assert task_formats.task_name("arc_challenge") == "arc_easy"
    with pytest.raises(ValueError, match="Unknown task 'winogrande'.*piqa"):
        task_formats.task_name("winogrande")


@pytest.mark.parametrize(
    "name, row, problem",
    [
        ("piqa", {"question": "q", "a": 1}, r"piqa expects \{'goal', 'sol1'"),
        (
            "piqa",
            {"goal": "g", "sol1": "a", "sol2": "b", "label": 2},
            r"'label' is 2, outside the 2 choices",
        ),
        ("siqa", dict(ROWS["siqa"][0], label="0"), "not 1, 2 or 3"),
        (
            "arc_easy",
            dict(ROWS["arc_easy"][0], answerKey="E"),
            r"'answerKey' is 'E', not one of the labels",
        ),
        ("copa", dict(ROWS["copa"][0], question="why"), "not 'cause'"),
        (
            "record",
            {"query": "q", "choices": ["a", "b"], "gold": 0},
            "record expects",
        ),
        (
            "race",
            {"article": "a", "problems": "[{'question': 'q'}]"},
            "each problem needs",
        ),
        (
            "hellaswag",
            dict(ROWS["hellaswag"][0], endings="x"),
            "'endings' must be",
        ),
    ],
)
def test_a_row_in_no_known_format_is_refused_in_one_line(
    tmp_path, name, row, problem
):
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(
        TaskFileError, match=f"{name}.jsonl:1: .*{problem}"
    ) as e:
        read_task_file(str(path), task_formats.task_parser(name))
    assert "\n" not in str(e.value)


def test_every_task_reads_a_file_of_its_rows(tmp_path):
    for name in task_formats.MULTIPLE_CHOICE_TASKS:
        docs, skipped = read_task_file(
            write_rows(str(tmp_path), name), task_formats.task_parser(name)
        )
        assert len(docs) == 2 and skipped == 0
        assert all(len(d["choices"]) >= 2 for d in docs)
    assert np.isclose(
        task_formats.record_metrics(
            {"entities": ["France", "Paris"], "answers": ["France"]},
            [-1.0, -2.0],
        )["em"],
        1.0,
    )


def _race_row(*options_and_answers):
    """An EleutherAI/race row of one problem per `(options, answer)`."""
    return {
        "article": "Tom has a dog.",
        "problems": str(
            [
                {"question": f"Question {i}?", "options": o, "answer": a}
                for i, (o, a) in enumerate(options_and_answers)
            ]
        ),
    }


FOUR = ["a", "b", "c", "d"]
FIVE = ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize(
    "name, row, problem",
    [
        ("race", _race_row((FIVE, "E")), "the question has 5 options; RACE"),
        ("race", _race_row((FIVE, "A")), "the question has 5 options"),
        (
            "race",
            _race_row((FOUR, "A"), (FIVE, "B")),
            "problem 2 of 2 has 5 options",
        ),
        (
            "race",
            {"article": "a", "question": "q", "options": FIVE, "answer": "E"},
            "has 5 options.*'query', 'choices', 'gold'",
        ),
        ("race", _race_row((["a", "b", "c"], "A")), "has 3 options; RACE"),
        ("race", _race_row((FOUR, "")), "answer of the question is ''"),
        ("race", _race_row((FOUR, "AB")), "is 'AB', not one of the letters"),
        (
            "arc_easy",
            dict(
                ROWS["arc_easy"][0],
                choices={"text": FOUR, "label": list("ABCDE")},
                answerKey="E",
            ),
            "'choices' has 4 texts but 5 labels",
        ),
        (
            "openbookqa",
            dict(
                ROWS["openbookqa"][1],
                choices={"text": FOUR, "label": list("ABC")},
            ),
            "'choices' has 4 texts but 3 labels",
        ),
        (
            "arc_easy",
            dict(
                ROWS["arc_easy"][0],
                choices={"text": FOUR, "label": list("ABBD")},
            ),
            "repeat a label",
        ),
        (
            "arc_easy",
            dict(ROWS["arc_easy"][0], choices={"text": FOUR, "label": "ABCD"}),
            "'choices.label' must be a list of strings",
        ),
        (
            "record",
            dict(ROWS["record"][0], query="The athletes celebrated."),
            "'query' has no '@placeholder'",
        ),
        (
            "record",
            dict(ROWS["record"][0], answers=["Spain"]),
            "none of the 'answers' .* is among the 'entities'",
        ),
    ],
)
def test_a_row_whose_gold_is_not_among_its_scored_choices_is_refused(
    tmp_path, name, row, problem
):
    """Nothing silent: a row whose gold is not one of the choices scored,
    whose labels and texts disagree, or whose choices would all be the same
    is refused naming `file:line` (never an `IndexError`), and with
    `on_error="skip"` is left out and counted, never scored."""
    good = json.dumps(ROWS[name][0])
    path = tmp_path / f"{name}.jsonl"
    path.write_text(f"{good}\n{json.dumps(row)}\n{good}\n")
    parse = task_formats.task_parser(name)
    with pytest.raises(TaskFileError, match=f"{name}.jsonl:2: .*{problem}"):
        read_task_file(str(path), parse)
    with pytest.warns(TaskFileWarning, match=f"{name}.jsonl:2: .*left out"):
        docs, skipped = read_task_file(str(path), parse, on_error="skip")
    assert skipped == 1 and docs == [parse(good)] * 2


def test_lm_evals_race_scores_four_options_and_reads_a_to_d_only():
    """Why a RACE question without 4 options is refused: lm-eval's race task
    scores the first 4 options whatever their number, and fails on the
    answer "E" (it knows the letters A to D only)."""
    from lm_eval.tasks.race import preprocess_race

    doc = _race_row((FIVE, "B"))
    assert preprocess_race.doc_to_choice(doc) == FOUR
    with pytest.raises(KeyError, match="E"):
        preprocess_race.doc_to_target(_race_row((FIVE, "E")))
