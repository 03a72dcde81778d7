"""Evaluation of a saved model on task files: the engine behind
`keras-mhf evaluate`, resumable through `EvaluationResults`."""

import contextlib
import os
import sys

from keras_mhf.evaluation.card660 import rare_word_similarity
from keras_mhf.evaluation.scoring import perplexity_details
from keras_mhf.evaluation.task_formats import MULTIPLE_CHOICE_TASKS
from keras_mhf.evaluation.task_formats import task_name
from keras_mhf.evaluation.tasks import lambada
from keras_mhf.evaluation.tasks import multiple_choice
from keras_mhf.models.next_token_scorer import NextTokenScorer
from keras_mhf.utils.progress import progress_enabled


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
    on_error="fail",
    tasks=(),
    delimiter=None,
    text_field="text",
):
    """Loads a MHF or Standard preset and runs the requested evaluations
    (the engine behind `keras-mhf evaluate`).

    `tasks`: `(name, path)` pairs of the paper's tasks (`"lambada"`,
    `"arc_easy"`, `"copa"`, `"openbookqa"`, `"piqa"`, `"hellaswag"`,
    `"race"`, `"sciq"`, `"siqa"`, `"record"`), each file in one of the
    task's formats and prompted as lm-eval's task definition prompts it
    (`keras_mhf.evaluation.task_formats`). `delimiter` joins prompts and
    continuations in every LAMBADA and multiple-choice file (`None`: `" "`,
    lm-eval's target delimiter).

    `perplexity_files` are corpora as `keras_mhf.data.read_documents` reads
    them (text, JSONL, Parquet, Arrow, `datasets` save_to_disk folders);
    `text_field` names their JSON field or column of text.

    `on_error`: a bad line of a LAMBADA, multiple-choice or Card-660 file
    stops the evaluation naming its `file:line` (`"fail"`) or is left out
    with a warning and counted in the task's `skipped_lines` (`"skip"`);
    see `keras_mhf.evaluation.tasks.read_task_file`.

    `progress` reports each long task's progress with an ETA on stderr
    (`None`: the `keras_mhf.utils.progress.show_progress` setting).

    Results are keyed `"<task>:<path as given>"`, so two files with the same
    name in different folders stay apart. `output` gets one JSON line per
    example (perplexity: one per block, with its NLL and accuracy) as soon
    as it is scored, and each task's metrics when it ends
    (`keras_mhf.evaluation.evaluation_results`); rerun with the same `output`, an
    interrupted evaluation resumes: finished tasks and recorded examples
    are not scored again.

    Returns:
        `{task_key: metrics}`.
    """
    from keras_mhf.models.preset_loading import load_causal_lm

    model = load_causal_lm(preset)
    tokenizer = model.preprocessor.tokenizer
    settings = {
        "preset": os.path.abspath(preset),
        "preset_sha256": _preset_sha256(preset),
        "sequence_length": sequence_length,
        "max_blocks": max_blocks,
        "limit": limit,
    }
    if delimiter is not None:
        settings["delimiter"] = delimiter
    if text_field != "text":  # earlier results files were all "text"
        settings["text_field"] = text_field
    task_files = _task_files(
        perplexity_files,
        lambada_files,
        multiple_choice_files,
        tasks,
        card660_files,
    )
    results = {}
    with _results_log(output, settings) as log:
        for task, path in task_files:
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
                    on_error,
                    delimiter,
                    text_field,
                )
                if stream is not None:
                    stream.finish(metrics)
            results[f"{task}:{path}"] = metrics
    _report_shapes(model, batch_size, progress)
    return results


def _task_files(perplexity, lambada, multiple_choice, tasks, card660):
    """`[(task, path)]` in the order `evaluate_preset` runs them."""
    return (
        [("perplexity", path) for path in perplexity]
        + [("lambada", path) for path in lambada]
        + [("multiple_choice", path) for path in multiple_choice]
        + [(task_name(name), path) for name, path in tasks]
        + [("rare_words", path) for path in card660]
    )


def _results_log(output, settings):
    """The `EvaluationResults` of `output`, locked (a context yielding
    `None` when there is no output)."""
    from keras_mhf.evaluation.evaluation_results import EvaluationResults

    if output is None:
        return contextlib.nullcontext(None)
    return EvaluationResults.open(output, settings)


def _report_shapes(model, batch_size, progress):
    """With progress on, says on stderr how many scoring shapes compiled."""
    scorer = NextTokenScorer.cached(model, batch_size)
    if scorer is not None and progress_enabled(progress):
        shapes = sorted(scorer.shapes)
        sys.stderr.write(
            f"Scored with {len(shapes)} compiled scoring shapes (batch x "
            f"length): {', '.join(f'{b}x{n}' for b, n in shapes)}\n"
        )


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
    on_error,
    delimiter=None,
    text_field="text",
):
    """One task of `evaluate_preset`: its metrics; per-example records go
    to `stream` (a `TaskResults`, or `None`)."""
    scored = (model, tokenizer, path, batch_size, limit, progress, stream)
    if task == "lambada":
        return lambada(*scored, on_error, delimiter)[0]
    if task == "multiple_choice" or task in MULTIPLE_CHOICE_TASKS:
        name = None if task == "multiple_choice" else task
        return multiple_choice(*scored, on_error, name, delimiter)[0]
    if task == "rare_words":
        metrics, _ = rare_word_similarity(
            model,
            tokenizer,
            path,
            batch_size,
            limit,
            on_error,
            progress,
            stream,
        )
        return metrics
    if task == "perplexity":
        import sentencepiece as spm

        from keras_mhf.data import pack_documents
        from keras_mhf.data import read_documents

        sp = spm.SentencePieceProcessor(model_proto=tokenizer.proto)
        blocks = pack_documents(
            read_documents(path, text_field=text_field),
            sp.encode,
            tokenizer.start_token_id,
            sequence_length,
        )[:max_blocks]
        metrics, nll, correct = perplexity_details(
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
    if stream is not None:
        for index, example in enumerate(examples):
            stream.add(index, example)
    return metrics
