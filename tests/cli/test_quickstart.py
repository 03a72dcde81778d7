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
