import gzip
import json
import os

import numpy as np
import pytest

from keras_mhf.data import CorpusWarning
from keras_mhf.data import DocumentReader
from keras_mhf.data import documents as documents_module
from keras_mhf.data import list_corpus_files
from keras_mhf.data import read_documents


def previous_txt_documents(text):
    """The `.txt` rule of the reader this package replaced (whole file)."""
    separator = "\n\n" if "\n\n" in text.strip() else "\n"
    return [block.strip() for block in text.split(separator) if block.strip()]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def jsonl(*texts):
    return "".join(json.dumps({"text": t}) + "\n" for t in texts)


@pytest.fixture
def corpus_dir(tmp_path):
    root = tmp_path / "corpus"
    write(root / "a.txt", "first doc\nstill first\n\nsecond doc\n")
    write(root / "b.jsonl", jsonl("third", "fourth"))
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(jsonl("fifth", "sixth"))
    write(root / "sub" / "d.txt", "seventh\neighth\n")
    write(root / "manifest.json", '{"books": []}')
    write(root / "SOURCE.md", "# where it comes from\n")
    write(root / "LICENSE", "license text\n")
    return root


def test_directory_reads_only_corpus_files_in_sorted_order(corpus_dir):
    files = [
        os.path.relpath(f, corpus_dir) for f in list_corpus_files(corpus_dir)
    ]
    assert files == [
        "a.txt",
        "b.jsonl",
        "c.jsonl.gz",
        os.path.join("sub", "d.txt"),
    ]
    assert list(read_documents(str(corpus_dir))) == [
        "first doc\nstill first",
        "second doc",
        "third",
        "fourth",
        "fifth",
        "sixth",
        "seventh",
        "eighth",
    ]
    assert list(read_documents(str(corpus_dir), limit=3)) == [
        "first doc\nstill first",
        "second doc",
        "third",
    ]


def test_globs_and_lists_of_inputs(corpus_dir):
    assert list(read_documents(str(corpus_dir / "*.jsonl*"))) == [
        "third",
        "fourth",
        "fifth",
        "sixth",
    ]
    pattern = str(corpus_dir / "**" / "*.txt")
    assert [os.path.basename(f) for f in list_corpus_files(pattern)] == [
        "a.txt",
        "d.txt",
    ]
    both = [str(corpus_dir / "sub"), str(corpus_dir / "b.jsonl")]
    assert list(read_documents(both)) == [
        "seventh",
        "eighth",
        "third",
        "fourth",
    ]


def test_bad_inputs_are_named(tmp_path, corpus_dir):
    with pytest.raises(
        ValueError, match=r"manifest\.json is not a corpus file.*\.jsonl\.gz"
    ):
        list_corpus_files(corpus_dir / "manifest.json")
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        list_corpus_files(tmp_path / "nowhere.txt")
    with pytest.raises(FileNotFoundError, match=r"matches no files"):
        list_corpus_files(str(tmp_path / "*.nothing"))
    with pytest.raises(ValueError, match="matches no corpus files"):
        list_corpus_files(str(corpus_dir / "*.md"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"No corpus files .* under .*empty"):
        list_corpus_files(tmp_path / "empty")
    with pytest.raises(ValueError, match="No corpus inputs"):
        list_corpus_files([])


def test_txt_streaming_matches_the_previous_reader(tmp_path):
    rng = np.random.default_rng(0)
    pieces = [
        "alpha beta",
        "gamma",
        "",
        "",
        " ",
        "  delta  ",
        "\t",
        "eps\tzeta",
    ]
    for case in range(150):
        lines = list(rng.choice(pieces, size=rng.integers(0, 12)))
        text = "\n".join(lines) + ("\n" if rng.random() < 0.5 else "")
        path = write(tmp_path / f"case_{case}.txt", text)
        assert list(read_documents(path)) == previous_txt_documents(text), repr(
            text
        )


def test_txt_mode_is_decided_by_the_head_of_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(documents_module, "TXT_HEAD_BYTES", 16)
    # No empty line in the first 16 bytes: one document per line, even though
    # a blank line comes later.
    path = write(
        tmp_path / "late.txt", "line one\nline two\nline three\n\nline four\n"
    )
    assert list(read_documents(path)) == [
        "line one",
        "line two",
        "line three",
        "line four",
    ]
    path = write(tmp_path / "early.txt", "one\n\ntwo\nthree\n")
    assert list(read_documents(path)) == ["one", "two\nthree"]


def test_bom_and_crlf_line_endings(tmp_path):
    path = write(
        tmp_path / "win.txt", b"\xef\xbb\xbfone\r\ntwo\r\n\r\nthree\r\n"
    )
    assert list(read_documents(path)) == ["one\ntwo", "three"]
    path = write(
        tmp_path / "win.jsonl",
        b'\xef\xbb\xbf{"text": "x"}\r\n{"text": "y"}\r\n',
    )
    assert list(read_documents(path)) == ["x", "y"]


BAD_LINES = [
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', 2, "not valid UTF-8"),
    (b'{"text": "ok"}\n\n{"text": oops}\n', 3, "invalid JSON"),
    (b'["a list"]\n', 1, "expected a JSON object, got a list"),
    (b'{"title": "no text"}\n', 1, "no 'text' field"),
    (b'{"text": null}\n', 1, "'text' is null"),
    (b'{"text": 3}\n', 1, "'text' is a int"),
]


@pytest.mark.parametrize("content,line,problem", BAD_LINES)
def test_bad_jsonl_lines_fail_with_file_and_line(
    tmp_path, content, line, problem
):
    path = write(tmp_path / "bad.jsonl", content)
    with pytest.raises(
        ValueError, match=rf"bad\.jsonl:{line}: {problem}.*on_error='skip'"
    ):
        list(read_documents(path))


def test_skip_mode_counts_and_warns_each_bad_line(tmp_path):
    good = jsonl("one", "two", "  ", "three")
    bad = b"".join(content for content, _, _ in BAD_LINES)
    path = write(
        tmp_path / "mixed.jsonl", good.encode() + bad + jsonl("four").encode()
    )
    reader = DocumentReader(path, on_error="skip")
    with pytest.warns(CorpusWarning) as caught:
        texts = [d.text for d in reader]
    assert texts == ["one", "two", "three", "ok", "ok", "four"]
    assert reader.skipped == 6
    messages = [str(w.message) for w in caught]
    for line in (6, 9, 10, 11, 12, 13):
        assert any(
            f"mixed.jsonl:{line}:" in m and "skipped" in m for m in messages
        )


def test_a_lone_surrogate_is_a_bad_line(tmp_path):
    """JSON's `\\ud800` escape decodes to a string that is not Unicode
    text (SentencePiece raised a TypeError without file:line, which
    `on_error="skip"` did not skip): a bad line, skipped under skip."""
    path = write(
        tmp_path / "surrogate.jsonl",
        b'{"text": "ok"}\n{"text": "a \\ud800 b"}\n{"text": "\\u00e9t\\u00e9"}\n',
    )
    with pytest.raises(
        ValueError,
        match=r"surrogate\.jsonl:2: 'text' holds a lone surrogate "
        r"\(\\ud800\), which is not valid Unicode text",
    ):
        list(read_documents(path))
    with pytest.warns(CorpusWarning, match=r"surrogate\.jsonl:2: .*skipped"):
        assert list(read_documents(path, on_error="skip")) == ["ok", "été"]


def test_non_utf8_txt_line(tmp_path):
    path = write(
        tmp_path / "bad.txt",
        b"good one\n\nbad \xff line\nsame doc\n\ngood two\n",
    )
    with pytest.raises(ValueError, match=r"bad\.txt:3: not valid UTF-8"):
        list(read_documents(path))
    with pytest.warns(
        CorpusWarning, match=r"bad\.txt:3: .*the document that holds it"
    ):
        assert list(read_documents(path, on_error="skip")) == [
            "good one",
            "good two",
        ]
    path = write(tmp_path / "lines.txt", b"a\nb \xff\nc\n")
    with pytest.warns(CorpusWarning, match=r"lines\.txt:2: "):
        assert list(read_documents(path, on_error="skip")) == ["a", "c"]


def test_every_document_position_resumes_the_stream(corpus_dir):
    reader = DocumentReader(str(corpus_dir))
    documents = list(reader)
    assert [
        (os.path.basename(reader.files[d.file_index]), d.line)
        for d in documents
    ] == [
        ("a.txt", 1),
        ("a.txt", 4),
        ("b.jsonl", 1),
        ("b.jsonl", 2),
        ("c.jsonl.gz", 1),
        ("c.jsonl.gz", 2),
        ("d.txt", 1),
        ("d.txt", 2),
    ]
    texts = [d.text for d in documents]
    for number, document in enumerate(documents):
        rest = [
            d.text for d in DocumentReader(str(corpus_dir), start=document.end)
        ]
        assert rest == texts[number + 1 :]
    assert reader.bytes_read == reader.total_bytes


def test_resumed_reader_keeps_the_skip_count(tmp_path):
    path = write(
        tmp_path / "s.jsonl", b'{"text": "a"}\nnot json\n{"text": "b"}\n[1]\n'
    )
    with pytest.warns(CorpusWarning):
        documents = list(DocumentReader(path, on_error="skip"))
    assert [d.end.skipped for d in documents] == [0, 1]
    resumed = DocumentReader(path, on_error="skip", start=documents[0].end)
    with pytest.warns(CorpusWarning):
        assert [d.text for d in resumed] == ["b"]
    assert resumed.skipped == 2


def test_openstax_directory_skips_its_manifest(openstax_dir):
    files = list_corpus_files(openstax_dir)
    names = sorted(os.path.basename(f) for f in files)
    assert "manifest.json" not in names and "SOURCE.md" not in names
    assert names == sorted(
        n for n in os.listdir(openstax_dir) if n.endswith(".jsonl")
    )
    first = next(iter(DocumentReader(files[:1])))
    assert first.text and first.line == 1


def test_many_bad_lines_are_all_counted_and_summarised(tmp_path):
    lines = [
        json.dumps({"text": f"doc {i}"}) if i % 2 else "{broken"
        for i in range(60)
    ]
    path = write(tmp_path / "many.jsonl", "\n".join(lines) + "\n")
    reader = DocumentReader(path, on_error="skip")
    with pytest.warns(CorpusWarning) as caught:
        assert len(list(reader)) == 30
    assert reader.skipped == 30
    messages = [str(w.message) for w in caught]
    assert len(messages) == documents_module.WARN_LINES + 1
    assert "Further bad lines are counted" in messages[-2]
    assert messages[-1].startswith("Skipped 30 bad lines in all")


def test_a_cut_short_gz_file_is_named(tmp_path):
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(400)]
    data = gzip.compress(("\n".join(lines) + "\n").encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError,
        match=r"cut.jsonl.gz:\d+: the compressed file is cut short.*--on-error skip",
    ):
        list(DocumentReader(str(path)))
    with pytest.warns(
        CorpusWarning, match="cut short.*skipped the rest of the file"
    ):
        documents = list(DocumentReader(str(path), on_error="skip"))
    assert 0 < len(documents) < 400
    assert (
        documents[-1].text
        == json.loads(lines[len(documents) - 1])["text"].strip()
    )
