"""Corpora as they are published: Parquet files (FineWeb-Edu's schema), Hugging
Face `datasets` save_to_disk folders, Arrow files and `.zst` files read as
the same documents as `.jsonl`, prepare to the same shards, resume at any
document, and refuse what is damaged (no Keras: runs once, see conftest's
BACKEND_INDEPENDENT)."""

import gzip
import json
import os
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from keras_mhf.data import CorpusWarning
from keras_mhf.data import DocumentReader
from keras_mhf.data import list_corpus_files
from keras_mhf.data import prepare_data
from keras_mhf.data import read_documents
from keras_mhf.data.arrow_documents import TextColumn
from tests.conftest import CORPUS

COUNT = 90
ROW_GROUP = 8  # rows per Parquet row group: a dozen groups


def make_texts(count=COUNT, seed=3):
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(CORPUS, size=rng.integers(1, 4))) + f" ({i})"
        for i in range(count)
    ]


def fineweb_edu_table(texts, field="text"):
    """`texts` with the other columns of FineWeb-Edu's Parquet files."""
    n = len(texts)
    return pa.table(
        {
            field: texts,
            "id": [f"<urn:uuid:{i:08d}>" for i in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{i}" for i in range(n)],
            "date": ["2024-02-21T12:00:00Z"] * n,
            "file_path": ["s3://commoncrawl/crawl-data/x.warc.gz"] * n,
            "language": ["en"] * n,
            "language_score": pa.array([0.95] * n, pa.float64()),
            "token_count": pa.array([len(t) // 4 for t in texts], pa.int64()),
            "score": pa.array([3.1] * n, pa.float64()),
            "int_score": pa.array([3] * n, pa.int64()),
        }
    )


def write_parquet(path, texts, field="text", row_group=ROW_GROUP):
    pq.write_table(
        fineweb_edu_table(texts, field), path, row_group_size=row_group
    )
    return str(path)


def jsonl_bytes(texts, field="text"):
    return "".join(json.dumps({field: t}) + "\n" for t in texts).encode()


def write_zst(path, data):
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    return str(path)


def save_dataset(path, texts, num_shards=2, **columns):
    import datasets

    datasets.disable_progress_bars()
    data = {"text": texts, "id": list(range(len(texts))), **columns}
    datasets.Dataset.from_dict(data).save_to_disk(
        str(path), num_shards=num_shards
    )
    return str(path)


@pytest.fixture(scope="module")
def texts():
    return make_texts()


@pytest.fixture(scope="module")
def formats(tmp_path_factory, texts):
    """The same documents in every format: name -> input path."""
    root = tmp_path_factory.mktemp("formats")
    (root / "docs.jsonl").write_bytes(jsonl_bytes(texts))
    with gzip.open(root / "docs.jsonl.gz", "wb") as f:
        f.write(jsonl_bytes(texts))
    arrow = root / "docs.arrow"  # the IPC file format, named directly
    table = fineweb_edu_table(texts)
    with pa.ipc.new_file(str(arrow), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=7):
            writer.write_batch(batch)
    return {
        "jsonl": str(root / "docs.jsonl"),
        "jsonl.gz": str(root / "docs.jsonl.gz"),
        "jsonl.zst": write_zst(root / "docs.jsonl.zst", jsonl_bytes(texts)),
        "txt.zst": write_zst(
            root / "docs.txt.zst", ("\n\n".join(texts) + "\n").encode()
        ),
        "parquet": write_parquet(root / "docs.parquet", texts),
        "save_to_disk": save_dataset(root / "saved", texts),
        "arrow": str(arrow),
    }


@pytest.fixture(scope="module")
def small_model(tmp_path_factory, small_proto):
    path = tmp_path_factory.mktemp("tokenizer") / "small.model"
    path.write_bytes(small_proto)
    return str(path)


def test_every_format_reads_the_same_documents(formats, texts):
    assert pq.ParquetFile(formats["parquet"]).metadata.num_row_groups > 10
    assert [
        os.path.basename(f) for f in list_corpus_files(formats["save_to_disk"])
    ] == [
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
    ]
    for name, path in formats.items():
        assert list(read_documents(path)) == texts, name


def test_every_format_prepares_the_same_shards(tmp_path, formats, small_model):
    def shards(name):
        output = tmp_path / name
        index = prepare_data(
            formats[name],
            small_model,
            str(output),
            validation_fraction=0.2,
            shard_tokens=300,
            workers=1,
            progress=False,
        )
        files = {
            n: (output / n).read_bytes()
            for n in sorted(os.listdir(output))
            if n.endswith(".bin")
        }
        return files, index["splits"]

    expected, splits = shards("jsonl")
    assert len(expected) > 2 and splits["validation"]["documents"] > 0
    for name in ("jsonl.zst", "txt.zst", "parquet", "save_to_disk", "arrow"):
        assert shards(name) == (expected, splits), name


def test_text_field_picks_the_column_or_the_json_field(tmp_path, texts):
    parquet = write_parquet(tmp_path / "c.parquet", texts, field="content")
    assert list(read_documents(parquet, text_field="content")) == texts
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_bytes(jsonl_bytes(texts, field="content"))
    assert list(read_documents(str(jsonl), text_field="content")) == texts
    # The column holds strings: the URLs are documents too, if asked for.
    urls = list(read_documents(parquet, text_field="url"))
    assert urls[0] == "https://example.org/0" and len(urls) == len(texts)


@pytest.mark.parametrize("name", ["parquet", "save_to_disk", "arrow"])
def test_a_reader_resumes_after_every_document(formats, texts, name):
    reader = DocumentReader(formats[name])
    documents, progress = [], []
    for document in reader:
        documents.append(document)
        progress.append(reader.bytes_read)
    assert [d.text for d in documents] == texts
    assert progress == sorted(progress) and 0 < progress[0]
    assert reader.bytes_read == reader.total_bytes
    for number, document in enumerate(documents):
        rest = DocumentReader(formats[name], start=document.end)
        assert [d.text for d in rest] == texts[number + 1 :], number
    assert documents[9].line == 10 and documents[9].end[1:3] == (10, 11)


def test_parquet_resumes_at_the_row_group_of_the_row(formats, texts):
    with TextColumn(formats["parquet"], "text") as column:
        first, values = next(column.batches(start_row=3 * ROW_GROUP + 5))
        assert column._first_row == 3 * ROW_GROUP  # earlier groups unread
        assert first == 3 * ROW_GROUP + 5
        assert values[0] == texts[first]


def test_a_missing_field_names_what_the_file_has(tmp_path, formats, capsys):
    with pytest.raises(ValueError) as error:
        list(read_documents(formats["parquet"], text_field="body"))
    message = str(error.value)
    assert "docs.parquet has no column 'body'" in message
    for column in ("'text'", "'id'", "'url'", "'int_score'", "--text-field"):
        assert column in message
    with pytest.raises(
        ValueError, match=r"no column 'body' \(its columns: 'text', 'id'"
    ):
        list(read_documents(formats["save_to_disk"], text_field="body"))
    # Not skippable: every row lacks it.
    with pytest.raises(ValueError, match="no column 'body'"):
        list(
            DocumentReader(
                formats["parquet"], on_error="skip", text_field="body"
            )
        )
    with pytest.raises(
        ValueError,
        match=r"docs.jsonl:1: no 'body' field \(its fields: 'text'; --text-field",
    ):
        list(read_documents(formats["jsonl"], text_field="body"))


def test_a_column_that_is_not_text_is_refused(formats):
    with pytest.raises(
        ValueError,
        match=r"docs.parquet: the column 'token_count' holds int64, not text",
    ):
        list(read_documents(formats["parquet"], text_field="token_count"))


def test_null_texts_are_bad_rows_and_empty_texts_are_counted(tmp_path):
    texts = ["one", None, "  ", "two", "", None, "three"]
    path = str(tmp_path / "n.parquet")
    pq.write_table(pa.table({"text": texts}), path, row_group_size=3)
    with pytest.raises(
        ValueError, match=r"n.parquet row 2: 'text' is null.*--on-error skip"
    ):
        list(read_documents(path))
    reader = DocumentReader(path, on_error="skip")
    with pytest.warns(
        CorpusWarning,
        match=r"n.parquet row [26]: 'text' is null.*skipped the row",
    ):
        documents = list(reader)
    assert [d.text for d in documents] == ["one", "two", "three"]
    assert (reader.skipped, reader.empty) == (2, 2)
    assert documents[1].end.skipped == 1 and documents[1].end.empty == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CorpusWarning)
        resumed = DocumentReader(path, on_error="skip", start=documents[1].end)
        assert [d.text for d in resumed] == ["three"]
    assert (resumed.skipped, resumed.empty) == (2, 2)
    jsonl = tmp_path / "e.jsonl"
    jsonl.write_bytes(jsonl_bytes(["a", " ", "", "b"]))
    reader = DocumentReader(str(jsonl))
    assert [d.text for d in reader] == ["a", "b"] and reader.empty == 2


def test_prepare_reports_empty_texts_and_skipped_rows(tmp_path, small_model):
    texts = make_texts(40) + ["", "   ", None]
    path = str(tmp_path / "e.parquet")
    pq.write_table(pa.table({"text": texts}), path, row_group_size=10)
    with pytest.warns(CorpusWarning):
        index = prepare_data(
            path,
            small_model,
            str(tmp_path / "out"),
            validation_fraction=0.2,
            workers=1,
            progress=False,
            on_error="skip",
        )
    assert (index["skipped_lines"], index["empty_documents"]) == (1, 2)
    assert index["text_field"] == "text"


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_cut_short_parquet_file_is_refused_even_when_skipping(
    tmp_path, formats, on_error
):
    data = open(formats["parquet"], "rb").read()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError,
        match=r"cut.parquet: the Parquet file is damaged or cut short .*again",
    ):
        list(DocumentReader(str(cut), on_error=on_error))
    damaged = tmp_path / "damaged.parquet"  # its footer, but pages missing
    damaged.write_bytes(data[: len(data) // 3] + data[-(len(data) // 3) :])
    with pytest.raises(
        ValueError, match="damaged.parquet: the Parquet file is damaged"
    ):
        list(DocumentReader(str(damaged), on_error=on_error))


def test_a_cut_short_arrow_stream_is_refused_even_when_skipping(
    tmp_path, texts
):
    path = tmp_path / "s.arrow"
    table = pa.table({"text": texts})
    with pa.ipc.new_stream(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=30):
            writer.write_batch(batch)
    data = path.read_bytes()
    # Cut at the end of a record batch: pyarrow alone reads it as shorter.
    boundary = data[: len(data) - 8]
    for name, cut in (
        ("boundary", boundary),
        ("inside", data[: len(data) // 2]),
    ):
        short = tmp_path / f"{name}.arrow"
        short.write_bytes(cut)
        with pytest.raises(
            ValueError,
            match=rf"{name}.arrow: the Arrow file is damaged or cut short",
        ):
            list(DocumentReader(str(short), on_error="skip"))


def test_a_cut_short_zst_file_is_handled_like_a_gz_file(tmp_path):
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(400)]
    data = zstandard.ZstdCompressor(level=1).compress(
        ("\n".join(lines) + "\n").encode()
    )
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError,
        match=r"cut.jsonl.zst:\d+: the compressed file is cut short.*--on-error skip",
    ):
        list(DocumentReader(str(path)))
    with pytest.warns(
        CorpusWarning, match="cut short.*skipped the rest of the file"
    ):
        documents = list(DocumentReader(str(path), on_error="skip"))
    assert 0 <= len(documents) < 400
    assert [d.text for d in documents] == [
        json.loads(x)["text"].strip() for x in lines[: len(documents)]
    ]
    damaged = bytearray(data)
    damaged[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
    path = tmp_path / "damaged.txt.zst"
    path.write_bytes(bytes(damaged))
    with pytest.raises(
        ValueError,
        match=r"damaged.txt.zst:\d+: the compressed file is cut short or damaged",
    ):
        list(DocumentReader(str(path)))


def test_datasets_dict_folders(tmp_path, texts):
    import datasets

    datasets.disable_progress_bars()
    train = datasets.Dataset.from_dict({"text": texts[:50]})
    test = datasets.Dataset.from_dict({"text": texts[50:]})
    datasets.DatasetDict({"train": train}).save_to_disk(str(tmp_path / "one"))
    assert list(read_documents(str(tmp_path / "one"))) == texts[:50]
    both = tmp_path / "both"
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(both))
    with pytest.raises(ValueError) as error:
        list_corpus_files(str(both))
    message = str(error.value)
    assert "\n" not in message and "2 splits (train, test)" in message
    assert "FOLDER/SPLIT" in message and str(both / "train") in message
    assert list(read_documents(str(both / "test"))) == texts[50:]


def test_a_folder_walk_reads_a_saved_dataset_in_its_order_only(tmp_path, texts):
    root = tmp_path / "corpora"
    saved = save_dataset(root / "b_saved", texts[:60], num_shards=3)
    # Left there by `datasets` (map, filter): not part of the dataset.
    (root / "b_saved" / "cache-0123456789abcdef.arrow").write_bytes(
        open(os.path.join(saved, "data-00000-of-00003.arrow"), "rb").read()
    )
    write_parquet(root / "a.parquet", texts[60:])
    files = [os.path.relpath(f, root) for f in list_corpus_files(str(root))]
    assert files == [
        "a.parquet",
        os.path.join("b_saved", "data-00000-of-00003.arrow"),
        os.path.join("b_saved", "data-00001-of-00003.arrow"),
        os.path.join("b_saved", "data-00002-of-00003.arrow"),
    ]
    assert list(read_documents(str(root))) == texts[60:] + texts[:60]
    pattern = str(root / "*.parquet")
    assert list(read_documents([pattern, saved])) == texts[60:] + texts[:60]


def test_a_resume_with_another_text_field_is_refused(
    tmp_path, texts, small_model
):
    table = fineweb_edu_table(texts).append_column(
        "body", pa.array(texts[::-1])
    )
    path = str(tmp_path / "two.parquet")
    pq.write_table(table, path, row_group_size=ROW_GROUP)
    out = str(tmp_path / "out")
    options = dict(validation_fraction=0.2, workers=1, progress=False)
    prepare_data(path, small_model, out, **options)
    with pytest.raises(ValueError, match=r"text field: 'text' -> 'body'"):
        prepare_data(path, small_model, out, text_field="body", **options)


def run_cli(argv, capsys):
    """`keras-mhf ARGV` in this process: `(exit status, stdout, stderr)`."""
    from keras_mhf.cli import main as cli

    capsys.readouterr()
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_keras_mhf_prepare_reads_parquet_with_text_field(
    tmp_path, texts, small_model, capsys
):
    path = write_parquet(tmp_path / "edu.parquet", texts, field="content")
    command = ["prepare", "--tokenizer", small_model, "--workers", "1"]
    command += ["--validation-fraction", "0.2", "--quiet", path]
    status, _, err = run_cli(command + ["--output", tmp_path / "a"], capsys)
    assert status == 1
    assert err.count("\n") == 1 and "edu.parquet has no column 'text'" in err
    assert "'content'" in err and "--text-field" in err
    status, _, err = run_cli(
        command + ["--output", tmp_path / "b", "--text-field", "content"],
        capsys,
    )
    assert status == 0, err
    index = json.loads((tmp_path / "b" / "index.json").read_text())
    assert index["text_field"] == "content"
    documents = index["splits"]["train"]["documents"]
    assert documents + index["splits"]["validation"]["documents"] == len(texts)
