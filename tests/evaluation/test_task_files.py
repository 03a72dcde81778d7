"""Task files and results files that cannot be scored as they are: every
bad line is named `file:line` (or left out with `on_error="skip"`), an empty
file is refused, a results file with lines that are not records is refused,
and no NaN is ever written. Backend-independent: files and JSON only."""

import json
import warnings

import pytest

from keras_mhf.evaluation import TaskFileError
from keras_mhf.evaluation import TaskFileWarning
from keras_mhf.evaluation import read_task_file
from keras_mhf.evaluation.card660 import parse_card660
from keras_mhf.evaluation.evaluation_results import EvaluationResults
from keras_mhf.evaluation.task_formats import parse_lambada
from keras_mhf.evaluation.task_formats import parse_multiple_choice


def write(tmp_path, name, *lines):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


GOOD_LAMBADA = json.dumps({"text": "The cell is the basic unit of life"})
GOOD_CHOICE = json.dumps(
    {"query": "Water boils at", "choices": ["a", "b"], "gold": 1}
)


@pytest.mark.parametrize(
    "parse, line, problem",
    [
        (
            parse_lambada,
            '{"text": "a\tb"}',
            r"not valid JSON \(Invalid control",
        ),
        (parse_lambada, '{"foo": 1}', r"no 'text' field .*'foo'"),
        (parse_lambada, '{"text": null}', "'text' is null"),
        (parse_lambada, '{"text": "word"}', "a single word"),
        (parse_lambada, "[1, 2]", "expected a JSON object, got a list"),
        (
            parse_multiple_choice,
            '{"query": "q", "choices": ["a", "b"]}',
            "no 'gold'",
        ),
        (
            parse_multiple_choice,
            '{"query": "q", "choices": [], "gold": 0}',
            "at least 2 answers, got 0",
        ),
        (
            parse_multiple_choice,
            '{"query": "q", "choices": ["a", "b"], "gold": 7}',
            r"'gold' is 7, outside the 2 choices \(0..1\)",
        ),
        (
            parse_multiple_choice,
            '{"query": "q", "choices": ["a", "b"], "gold": true}',
            "integer index",
        ),
        (
            parse_multiple_choice,
            '{"choices": ["a", "b"], "gold": 0}',
            "no 'query'",
        ),
        (parse_card660, "word1\tword2", "expected word1<TAB>word2<TAB>score"),
        (parse_card660, "word1\tword2\thigh", "'high' is not a number"),
        (parse_card660, "word1\tword2\tnan", "not finite"),
    ],
)
def test_a_bad_line_is_named_with_its_file_and_line(
    tmp_path, parse, line, problem
):
    good = {
        parse_lambada: GOOD_LAMBADA,
        parse_multiple_choice: GOOD_CHOICE,
        parse_card660: "cat\tdog\t3.5",
    }[parse]
    path = write(tmp_path, "task", good, "", line, good)
    with pytest.raises(
        TaskFileError, match=f"task:3: .*{problem}.*--on-error skip"
    ):
        read_task_file(path, parse)
    with pytest.warns(TaskFileWarning, match=f"task:3: .*{problem}.*left out"):
        examples, skipped = read_task_file(path, parse, on_error="skip")
    assert len(examples) == 2 and skipped == 1


def test_not_utf8_and_limits(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_bytes(
        GOOD_LAMBADA.encode() + b"\n\xff\xfe\n" + GOOD_LAMBADA.encode() + b"\n"
    )
    with pytest.raises(TaskFileError, match="task.jsonl:2: 'utf-8' codec"):
        read_task_file(str(path), parse_lambada)
    # The limit stops reading before the bad line.
    examples, _ = read_task_file(str(path), parse_lambada, limit=1)
    assert examples == [("The cell is the basic unit of", " life")]


@pytest.mark.parametrize(
    "parse", [parse_lambada, parse_multiple_choice, parse_card660]
)
def test_a_file_with_nothing_to_score_is_refused(tmp_path, parse):
    empty = write(tmp_path, "empty")
    with pytest.raises(TaskFileError, match="holds no .* to score"):
        read_task_file(empty, parse)
    bad_only = write(tmp_path, "bad", "not json", "\tx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TaskFileWarning)
        with pytest.raises(TaskFileError, match=r"2 bad lines left out"):
            read_task_file(bad_only, parse, on_error="skip")


def test_many_bad_lines_warn_one_by_one_then_once(tmp_path):
    path = write(tmp_path, "task", *(["{}"] * 25), GOOD_LAMBADA)
    with pytest.warns(TaskFileWarning) as caught:
        examples, skipped = read_task_file(path, parse_lambada, on_error="skip")
    assert skipped == 25 and len(examples) == 1
    assert len(caught) == 21 and "25 bad lines left out in all" in str(
        caught[-1].message
    )


@pytest.mark.parametrize(
    "extra",
    [
        '{"foo": 1}',
        "42",
        "null",
        '{"task": "x", "file": "y"}',
        '{"task": "x", "file": "y", "index": "3"}',
    ],
)
def test_a_results_file_with_a_line_that_is_not_a_record_is_refused(
    tmp_path, extra
):
    path = tmp_path / "results.jsonl"
    with EvaluationResults.open(str(path), {"preset": "p"}) as results:
        task = results.task("lambada", write(tmp_path, "l.jsonl", GOOD_LAMBADA))
        task.add(0, {"loglikelihood": -1.0, "correct": True})
    with open(path, "a") as f:
        f.write(extra + "\n")
    with pytest.raises(
        ValueError, match=r"results.jsonl:4 is not a results line"
    ):
        with EvaluationResults.open(str(path), {"preset": "p"}):
            pass


def test_no_nan_is_written_to_a_results_file(tmp_path):
    path = tmp_path / "results.jsonl"
    with EvaluationResults.open(str(path), {"preset": "p"}) as results:
        task = results.task("lambada", write(tmp_path, "l.jsonl", GOOD_LAMBADA))
        with pytest.raises(ValueError, match="Out of range float"):
            task.finish({"acc": float("nan")})
    assert "NaN" not in path.read_text()


def test_a_task_file_is_recorded_with_its_first_result_only(tmp_path):
    """Opening a task writes nothing: a task refused before its first
    record leaves no sha256 behind, and one left by an earlier run with no
    record after it does not stop the corrected file either; a file
    changed after results of it were recorded is refused."""
    path = tmp_path / "results.jsonl"
    task_file = write(tmp_path, "l.jsonl", "not json")
    with EvaluationResults.open(str(path), {"preset": "p"}) as results:
        results.task("lambada", task_file)
    assert len(path.read_text().splitlines()) == 1
    # A results file whose last run stopped right after writing the sha256.
    with open(path, "a") as f:
        f.write(
            json.dumps({"task": "lambada", "file": task_file, "sha256": "0"})
            + "\n"
        )
    write(tmp_path, "l.jsonl", GOOD_LAMBADA)
    with EvaluationResults.open(str(path), {"preset": "p"}) as results:
        task = results.task("lambada", task_file)
        task.add(0, {"loglikelihood": -1.0, "correct": True})
    with EvaluationResults.open(str(path), {"preset": "p"}) as results:
        assert list(results.task("lambada", task_file).done) == [0]
    write(tmp_path, "l.jsonl", GOOD_LAMBADA, GOOD_LAMBADA)
    with pytest.raises(ValueError, match="l.jsonl changed since"):
        with EvaluationResults.open(str(path), {"preset": "p"}) as results:
            results.task("lambada", task_file)
