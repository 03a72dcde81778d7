"""`keras-mhf quickstart --data FILE` splits the user's corpus into
training, validation and held-out slices (the whole command runs in
tests/test_docs_commands.py, the default quickstart in .ci/run)."""

import argparse
import json

from keras_mhf.cli import quickstart


def test_data_is_split_into_train_validation_and_test_slices(tmp_path):
    documents = [f"Document {i} says something." for i in range(45)]
    corpus = tmp_path / "my_corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in documents)
    )
    (tmp_path / "run").mkdir()  # `main` makes the output first
    args = argparse.Namespace(data=str(corpus), output=str(tmp_path / "run"))
    train, validation, held_out = quickstart.split_corpus(args)

    def texts(path):
        with open(path) as f:
            return [json.loads(line)["text"] for line in f]

    # 1/20 of the documents (at least one) for each held-out slice, the last.
    assert held_out == documents[-2:]
    assert texts(validation) == documents[-4:-2]
    assert texts(train) == documents[:-4]


def test_outputs_are_listed_as_the_output_was_given(
    tmp_path, monkeypatch, capsys
):
    # The runs hold resolved paths; a relative --output lists them relative
    # to the working directory, an absolute one as they are.
    monkeypatch.chdir(tmp_path)

    def listed(output):
        base = tmp_path / output
        runs = {
            model: {
                "tokenizer": str(base / model / "tokenizer.model"),
                "preset": str(base / model / "preset"),
            }
            for model in ("mhf", "standard")
        }
        exports = {"MHF .keras file": f"{output}/mhf/model.keras"}
        quickstart.print_outputs(output, runs, exports, None)
        lines = capsys.readouterr().out.splitlines()[2:]
        return [line.split()[-1] for line in lines]

    relative = listed("runs/qs")
    assert relative[:4] == [
        "runs/qs/mhf/tokenizer.model",
        "runs/qs/mhf/preset",
        "runs/qs/mhf/model.keras",
        "runs/qs/standard/preset",
    ]
    assert relative[-1] == "runs/qs/evaluation.json"
    absolute = listed(str(tmp_path / "qs"))
    assert absolute[0] == str(tmp_path / "qs" / "mhf" / "tokenizer.model")


def test_a_test_slice_without_last_word_passages_skips_that_task(
    tmp_path, monkeypatch, capsys
):
    """Documents too short for a last-word passage: the quickstart says so
    before training and evaluates perplexity alone (it trained both models,
    then failed on `held_out_last_word.jsonl holds no passages`)."""
    documents = [f"Document {i} says something." for i in range(45)]
    corpus = tmp_path / "short.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in documents)
    )
    output = tmp_path / "run"

    def no_training(*args, **kwargs):
        raise RuntimeError("training started")

    monkeypatch.setattr(quickstart, "train_both", no_training)
    try:
        quickstart.main(["--data", str(corpus), "--output", str(output)])
    except RuntimeError as error:
        assert str(error) == "training started"
    out = capsys.readouterr().out
    assert "Note: the test slice yields no last-word passage" in out
    assert not (output / "held_out_last_word.jsonl").exists()

    import keras_mhf.evaluation

    def evaluate_preset(preset, perplexity_files, lambada_files, **kwargs):
        assert lambada_files == []
        metrics = {"perplexity": 9.0, "ece": 0.1, "accuracy": 0.2}
        return {f"perplexity:{perplexity_files[0]}": metrics}

    monkeypatch.setattr(
        keras_mhf.evaluation, "evaluate_preset", evaluate_preset
    )
    runs = {
        "standard": {
            "preset": "p",
            "scoring_temperature": None,
            "parameters": 10,
        }
    }
    args = argparse.Namespace(
        output=str(output), sequence_length=16, batch_size=2
    )
    quickstart.evaluate_both(args, runs, documents[-2:], None)
    assert "no last-word passages" in capsys.readouterr().out
