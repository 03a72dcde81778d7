import json

import numpy as np
import pytest
from keras import ops

from keras_mhf import evaluation

# The width every direct computation is scored at, right-padded (causal:
# the real positions' scores do not depend on it): one compiled shape.
DIRECT_WIDTH = 24


def direct_loglikelihood(model, ids, n_context):
    """Independent path: score the whole sequence once, sum the target
    tokens."""
    assert len(ids) <= DIRECT_WIDTH
    padded = np.zeros((1, DIRECT_WIDTH), "int32")
    padded[0, : len(ids)] = ids
    scores = np.asarray(ops.convert_to_numpy(model.score(padded, padded > 0)))[
        0, : len(ids)
    ]
    lp = evaluation.scoring._log_softmax(scores)
    positions = np.arange(n_context - 1, len(ids) - 1)
    return lp[positions, np.array(ids[n_context:])].sum(), bool(
        np.all(lp[positions].argmax(-1) == np.array(ids[n_context:]))
    )


def test_encode_pair_moves_trailing_space(small_tokenizer):
    context, continuation = evaluation.encode_pair(
        small_tokenizer, "The cell ", "is"
    )
    same = evaluation.encode_pair(small_tokenizer, "The cell", " is")
    assert (context, continuation) == same
    assert context[0] == small_tokenizer.start_token_id


def test_lambada_matches_direct_computation(tiny_lm, small_tokenizer, tmp_path):
    texts = [
        "The cell is the basic unit of life",
        "Water boils at one hundred degrees",
    ]
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    metrics, examples = evaluation.lambada(
        tiny_lm, small_tokenizer, str(path), batch_size=1
    )
    lls = []
    for text, example in zip(texts, examples):
        context, word = text.rsplit(" ", 1)
        assert example["target"] == " " + word
        ctx, cont = evaluation.encode_pair(small_tokenizer, context, " " + word)
        ll, greedy = direct_loglikelihood(tiny_lm, ctx + cont, len(ctx))
        np.testing.assert_allclose(example["loglikelihood"], ll, rtol=1e-5)
        assert example["correct"] == greedy
        lls.append(ll)
    np.testing.assert_allclose(
        metrics["perplexity"], np.exp(-np.mean(lls)), rtol=1e-5
    )
    # Batching with right-padding gives the same numbers.
    batched, _ = evaluation.lambada(
        tiny_lm, small_tokenizer, str(path), batch_size=2
    )
    np.testing.assert_allclose(
        batched["perplexity"], metrics["perplexity"], rtol=1e-4
    )


def test_document_likelihood_matches_direct_computation(
    tiny_lm, small_tokenizer
):
    texts = [
        "The cell is the basic unit of life.",
        "Water boils.",
        "Light travels faster than sound does in air.",
    ]
    max_length = 8  # the last text is cut
    seqs, characters = evaluation.encode_documents(
        small_tokenizer, texts, max_length
    )
    nll = 0.0
    for ids in seqs:
        nll -= direct_loglikelihood(tiny_lm, ids, 1)[0]
    # Batched by length, right-padded: the same total.
    result = evaluation.encoded_document_likelihood(
        tiny_lm, (seqs, characters), batch_size=2
    )
    tokens = sum(len(s) - 1 for s in seqs)
    np.testing.assert_allclose(
        result["nats_per_character"], nll / characters, rtol=1e-5
    )
    np.testing.assert_allclose(
        result["bits_per_character"], nll / characters / np.log(2), rtol=1e-5
    )
    assert result["tokens"] == tokens
    assert result["tokens_per_character"] == tokens / characters
    # The cut text counts only the characters its kept tokens cover.
    assert characters < sum(len(t) for t in texts)
    assert evaluation.document_likelihood(
        tiny_lm, small_tokenizer, texts, max_length, batch_size=2
    ) == pytest.approx(result)
    with pytest.raises(ValueError, match="No text to score"):
        evaluation.encoded_document_likelihood(tiny_lm, ([], 0))


def test_multiple_choice_acc_and_acc_norm(tiny_lm, small_tokenizer, tmp_path):
    docs = [
        {
            "query": "Water boils at",
            "choices": ["one hundred degrees", "cells"],
            "gold": 0,
        },
        {
            "query": "The cell is",
            "choices": ["light", "the basic unit of life"],
            "gold": 1,
        },
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    metrics, examples = evaluation.multiple_choice(
        tiny_lm, small_tokenizer, str(path)
    )
    acc, acc_norm = [], []
    for doc, example in zip(docs, examples):
        lls = []
        for choice in doc["choices"]:
            ctx, cont = evaluation.encode_pair(
                small_tokenizer, doc["query"], " " + choice
            )
            lls.append(direct_loglikelihood(tiny_lm, ctx + cont, len(ctx))[0])
        np.testing.assert_allclose(example["loglikelihoods"], lls, rtol=1e-5)
        lengths = np.array([len(c) for c in doc["choices"]])
        acc.append(int(np.argmax(lls)) == doc["gold"])
        acc_norm.append(int(np.argmax(np.array(lls) / lengths)) == doc["gold"])
    assert metrics["acc"] == np.mean(acc) and metrics["acc_norm"] == np.mean(
        acc_norm
    )


def test_tasks_report_both_scoring_rules(tiny_lm, small_tokenizer, tmp_path):
    """With a calibrated temperature, LAMBADA and multiple-choice metrics
    are the calibrated rule's, and `paper_rule` holds those of the same
    model at temperature 1.0."""
    from tests.evaluation.harness_rows import write_rows

    piqa = write_rows(str(tmp_path), "piqa")
    lambada = write_rows(str(tmp_path), "lambada")
    paper, paper_examples = evaluation.multiple_choice(
        tiny_lm, small_tokenizer, piqa, task="piqa"
    )
    paper_lambada, _ = evaluation.lambada(tiny_lm, small_tokenizer, lambada)
    assert "paper_rule" not in paper and "paper_rule" not in paper_lambada
    tiny_lm.scoring_temperature = 1.7
    calibrated, examples = evaluation.multiple_choice(
        tiny_lm, small_tokenizer, piqa, task="piqa"
    )
    calibrated_lambada, _ = evaluation.lambada(
        tiny_lm, small_tokenizer, lambada
    )
    assert calibrated["scoring_temperature"] == 1.7
    assert calibrated["paper_rule"] == {
        k: paper[k] for k in ("acc", "acc_norm")
    }
    for example, before in zip(examples, paper_examples):
        np.testing.assert_allclose(
            example["loglikelihoods_paper_rule"],
            before["loglikelihoods"],
            rtol=1e-5,
        )
        assert not np.allclose(
            example["loglikelihoods"], before["loglikelihoods"], rtol=1e-3
        )
    np.testing.assert_allclose(
        calibrated_lambada["paper_rule"]["perplexity"],
        paper_lambada["perplexity"],
        rtol=1e-5,
    )
    assert calibrated_lambada["perplexity"] != pytest.approx(
        paper_lambada["perplexity"], rel=1e-3
    )


def test_rank_correlations():
    x = [0.1, 0.4, 0.4, 0.9, 0.3]
    y = [1.0, 2.0, 3.0, 5.0, 0.5]
    np.testing.assert_allclose(
        evaluation.pearson(x, y), np.corrcoef(x, y)[0, 1]
    )
    scipy_stats = pytest.importorskip("scipy.stats")
    np.testing.assert_allclose(
        evaluation.spearman(x, y), scipy_stats.spearmanr(x, y)[0]
    )


def test_rare_word_similarity(tiny_lm, small_tokenizer, tmp_path):
    path = tmp_path / "card.tsv"
    path.write_text(
        "cell\tunit_of_life\t3.5\nwater\tsteam\t3.0\nlight\tsound\t1.0\n"
        "atom\tnucleus\t2.5\n"
    )
    metrics, examples = evaluation.rare_word_similarity(
        tiny_lm, small_tokenizer, str(path)
    )
    assert metrics["pairs"] == 4
    assert examples[0]["word2"] == "unit of life"
    final, penultimate = evaluation.last_token_hidden_states(
        tiny_lm, small_tokenizer, ["cell", "unit of life"]
    )
    cos = (
        final[0]
        @ final[1]
        / np.linalg.norm(final[0])
        / np.linalg.norm(final[1])
    )
    np.testing.assert_allclose(examples[0]["cosine_final"], cos, rtol=1e-5)
    assert not np.allclose(final, penultimate)
    # Against the model's own forward pass (KerasHub's layer_intercept_fn
    # for the second-to-last block), one text at a time, unpadded.
    for k, text in enumerate(["cell", "unit of life"]):
        ids = np.array(
            [[small_tokenizer.start_token_id]]
            + [[int(t)] for t in np.asarray(small_tokenizer(text))],
            "int32",
        ).T
        captured = {}

        def intercept(x, i):
            if i == tiny_lm.backbone.num_layers - 2:
                captured["h"] = x
            return x

        tiny_lm.score(ids, layer_intercept_fn=intercept)
        hidden = tiny_lm.backbone(
            {"token_ids": ids, "padding_mask": np.ones_like(ids)}
        )
        np.testing.assert_allclose(
            final[k],
            np.asarray(ops.convert_to_numpy(hidden))[0, -1],
            rtol=1e-4,
            atol=1e-5,
        )
        np.testing.assert_allclose(
            penultimate[k],
            np.asarray(ops.convert_to_numpy(captured["h"]))[0, -1],
            rtol=1e-4,
            atol=1e-5,
        )
    for key in (
        "final_pearson",
        "final_spearman",
        "second_to_last_pearson",
        "second_to_last_spearman",
    ):
        assert -1.0 <= metrics[key] <= 1.0


def test_evaluate_recipe_end_to_end(tiny_lm, tmp_path, corpus, capsys):
    preset = str(tmp_path / "preset")
    tiny_lm.save_to_preset(preset)
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n\n".join(corpus[:8]))
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text(
        json.dumps({"text": "The cell is the basic unit of life"}) + "\n"
    )
    mc = tmp_path / "mc.jsonl"
    mc.write_text(
        json.dumps(
            {"query": "Water boils at", "choices": ["one", "two"], "gold": 0}
        )
        + "\n"
    )
    card = tmp_path / "card.tsv"
    card.write_text("cell\tlife\t3.0\nwater\tsteam\t2.0\nlight\tatom\t1.0\n")
    output = tmp_path / "results.jsonl"
    from keras_mhf.cli import main as cli

    capsys.readouterr()
    status = cli.main(
        ["evaluate", "--preset", preset, "--perplexity", str(held_out)]
        + ["--lambada", str(lambada), "--multiple-choice", str(mc)]
        + ["--card660", str(card), "--sequence-length", "16"]
        + ["--output", str(output)]
    )
    out, err = capsys.readouterr()
    assert status == 0, err[-2000:]
    results = json.loads(out[out.index("{") :])
    assert results[f"perplexity:{held_out}"]["perplexity"] > 1
    assert "acc" in results[f"lambada:{lambada}"]
    assert "acc_norm" in results[f"multiple_choice:{mc}"]
    assert "final_spearman" in results[f"rare_words:{card}"]
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert lines[0]["format"] == "keras_mhf.evaluation_results"
    lines = [line for line in lines[1:] if "index" in line]
    assert {line["task"] for line in lines} == {
        "perplexity",
        "lambada",
        "multiple_choice",
        "rare_words",
    }
    blocks = [line for line in lines if line["task"] == "perplexity"]
    assert blocks and all(line["tokens"] == 16 for line in blocks)


def test_same_file_name_in_two_folders_is_kept_apart(tiny_lm, tmp_path):
    """Results are keyed by the path as given, not the basename."""
    preset = str(tmp_path / "preset")
    tiny_lm.save_to_preset(preset)
    paths = []
    for folder, text in (
        ("a", "The cell is the basic unit of life"),
        ("b", "Water boils at one hundred degrees"),
    ):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "lambada.jsonl"
        path.write_text(json.dumps({"text": text}) + "\n")
        paths.append(str(path))
    results = evaluation.evaluate_preset(preset, lambada_files=paths)
    assert sorted(results) == sorted(f"lambada:{p}" for p in paths)


def _task_files(tmp_path):
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text(
        "".join(
            json.dumps({"text": t}) + "\n"
            for t in (
                "The cell is the basic unit of life",
                "Water boils at one hundred degrees",
                "Light travels faster than sound",
                "The heart pumps blood through the body",
                "Plants need light to grow",
            )
        )
    )
    mc = tmp_path / "mc.jsonl"
    mc.write_text(
        "".join(
            json.dumps({"query": q, "choices": c, "gold": 0}) + "\n"
            for q, c in (
                ("Water boils at", ["one hundred", "two", "cold"]),
                ("The cell is", ["alive", "a rock"]),
                ("Light is", ["fast", "slow", "heavy", "green"]),
            )
        )
    )
    return str(lambada), str(mc)


def test_results_stream_and_an_interrupted_evaluation_resumes(
    tiny_lm, tmp_path, monkeypatch
):
    """Per-example lines are written as examples are scored; a rerun on a
    file cut short (even mid-line) scores only what is missing and gives
    the same numbers; settings or task files that changed are refused."""
    from keras_mhf.evaluation.evaluation_results import EvaluationResults

    preset = str(tmp_path / "preset")
    tiny_lm.save_to_preset(preset)
    lambada, mc = _task_files(tmp_path)
    output = tmp_path / "results.jsonl"
    kwargs = dict(
        lambada_files=[lambada],
        multiple_choice_files=[mc],
        batch_size=2,
        output=str(output),
    )
    whole = evaluation.evaluate_preset(preset, **kwargs)
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert lines[0]["format"] == "keras_mhf.evaluation_results"
    examples = [line for line in lines if "index" in line]
    assert sorted((e["task"], e["index"]) for e in examples) == sorted(
        [("lambada", i) for i in range(5)]
        + [("multiple_choice", i) for i in range(3)]
    )
    # Cut after two lambada examples, in the middle of the third line.
    text = output.read_text().splitlines(keepends=True)
    keep = 1 + 1 + 2  # header, task line, two examples
    output.write_text("".join(text[:keep]) + text[keep][:10])
    scored = []
    original = evaluation.loglikelihoods

    def counting(model, tokenizer, requests, *args, **kw):
        scored.extend(requests)
        return original(model, tokenizer, requests, *args, **kw)

    monkeypatch.setattr(evaluation.tasks, "loglikelihoods", counting)
    resumed = evaluation.evaluate_preset(preset, **kwargs)
    assert len(scored) == 3 + 9  # 3 lambada passages, 9 choices
    for key, metrics in whole.items():
        for name, value in metrics.items():
            np.testing.assert_allclose(resumed[key][name], value, rtol=1e-6)
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    indices = [(x["task"], x["index"]) for x in lines if "index" in x]
    assert len(indices) == len(set(indices)) == 8
    # Finished: nothing is scored again.
    scored.clear()
    assert evaluation.evaluate_preset(preset, **kwargs) == resumed
    assert scored == []
    with pytest.raises(ValueError, match="another evaluation.*limit"):
        evaluation.evaluate_preset(preset, limit=2, **kwargs)
    with open(lambada, "a") as f:
        f.write(json.dumps({"text": "A new passage ends here"}) + "\n")
    with pytest.raises(ValueError, match="changed since"):
        evaluation.evaluate_preset(preset, **kwargs)
    output.write_text(output.read_text().replace('"task"', "task", 1))
    with pytest.raises(ValueError, match="corrupt"):
        EvaluationResults.open(str(output), {}).__enter__()


def test_compiled_scorers_are_built_and_release_the_model(small_tokenizer):
    """Every layer of the compiled scorers is built after a call (on JAX,
    Keras calls an unbuilt model eagerly, op by op, before every
    `predict_on_batch`), and the scorer cache does not keep a model alive."""
    import gc
    import weakref

    import keras

    from keras_mhf.evaluation.calibration import RAW_SCORES
    from keras_mhf.evaluation.calibration import raw_scores
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models.next_token_scorer import TARGET_LOSSES
    from keras_mhf.models.next_token_scorer import NextTokenScorer
    from keras_mhf.models.next_token_scorer import built_scorer
    from keras_mhf.models.next_token_scorer import target_losses

    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        small_tokenizer, "tiny_h3b64", sequence_length=16
    )
    ids = np.array([[1, 5, 9, 12, 7]], "int32")
    evaluation.next_token_scores(lm, ids)
    target_losses(lm, ids, np.ones_like(ids), ids)
    raw_scores(lm, ids)
    models = [
        NextTokenScorer.cached(lm, 8).model,
        built_scorer(lm, TARGET_LOSSES),
        built_scorer(lm, RAW_SCORES),
    ]
    for model in models:
        unbuilt = [x.name for x in model._flatten_layers() if not x.built]
        assert unbuilt == []
    alive = weakref.ref(lm)
    del lm, models
    gc.collect()
    assert alive() is None


def test_card660_results_stream_and_resume(tiny_lm, tmp_path, monkeypatch):
    from keras_mhf.evaluation import card660

    preset = str(tmp_path / "preset")
    tiny_lm.save_to_preset(preset)
    words = ["cell", "water", "light", "atom", "steam", "sound", "life"]
    path = tmp_path / "card.tsv"
    path.write_text(
        "".join(
            f"{a}\t{b}\t{(i % 4) / 2}\n"
            for i, (a, b) in enumerate(
                (a, b) for a in words for b in words if a < b
            )
        )
    )
    output = tmp_path / "results.jsonl"
    monkeypatch.setattr(card660, "PAIRS_PER_CHUNK", 5)
    kwargs = dict(card660_files=[str(path)], output=str(output), batch_size=4)
    whole = evaluation.evaluate_preset(preset, **kwargs)
    lines = output.read_text().splitlines(keepends=True)
    records = [line for line in lines if '"index"' in line]
    assert len(records) == 21
    # Cut after 7 records, mid-line: the rerun scores only the other 14.
    output.write_text("".join(lines[: 2 + 7]) + lines[9][:5])
    embedded = []
    original = card660.last_token_hidden_states

    def counting(model, tokenizer, texts, *args, **kw):
        embedded.extend(texts)
        return original(model, tokenizer, texts, *args, **kw)

    monkeypatch.setattr(card660, "last_token_hidden_states", counting)
    resumed = evaluation.evaluate_preset(preset, **kwargs)
    assert 0 < len(embedded) <= len(words)
    for name, value in whole[f"rare_words:{path}"].items():
        np.testing.assert_allclose(
            resumed[f"rare_words:{path}"][name], value, rtol=1e-5
        )


def test_a_refused_task_file_leaves_nothing_that_stops_the_corrected_rerun(
    tiny_lm, tmp_path
):
    """A task file refused before anything of it was scored leaves no trace
    in the results file: the rerun on the corrected file evaluates it (and
    the tasks finished before it are read back, not refused)."""
    preset = str(tmp_path / "preset")
    tiny_lm.save_to_preset(preset)
    lambada, _ = _task_files(tmp_path)
    piqa = tmp_path / "piqa.jsonl"
    good = {"goal": "Boil water", "sol1": "Heat it.", "sol2": "Cool it."}
    piqa.write_text(json.dumps(dict(good, label=2)) + "\n")
    output = tmp_path / "results.jsonl"
    kwargs = dict(
        lambada_files=[lambada],
        tasks=[("piqa", str(piqa))],
        batch_size=2,
        output=str(output),
    )
    with pytest.raises(evaluation.TaskFileError, match="piqa.jsonl:1: "):
        evaluation.evaluate_preset(preset, **kwargs)
    piqa.write_text(json.dumps(dict(good, label=0)) + "\n")
    results = evaluation.evaluate_preset(preset, **kwargs)
    assert results[f"piqa:{piqa}"]["examples"] == 1
    assert results[f"lambada:{lambada}"]["examples"] == 5
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    headers = [x for x in lines[1:] if "sha256" in x]
    assert [x["task"] for x in headers] == ["lambada", "piqa"]
