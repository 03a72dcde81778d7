"""The documentation's examples run and its links resolve.

Covers README.md and docs/*.md:

1. Every ```python block runs. A file's blocks form programs: a block starts
   a new program unless the line right before its fence is
   `<!-- continues the example above -->`, which appends it to the file's
   previous runnable block (so a page can build a model once and show its
   methods in several short blocks). Each program runs in a fresh
   `sys.executable` process whose working directory is a pytest `tmp_path`,
   with the current environment (KERAS_BACKEND passes through, so the
   programs run in every backend pass of `tools/test.sh`), and must exit 0.
   A block opts out only when the line right before its fence is
   `<!-- not runnable: REASON -->` with a non-empty reason (e.g. "needs a
   prepared corpus"); any other comment there is an error, so a typo cannot
   silently skip a block. Runnable programs are kept to tiny models and a
   few steps: the suite runs them on three backends.
2. Every relative Markdown link `[text](path)` or `[text](path#anchor)`
   resolves to an existing file (http(s), mailto and same-page `#anchor`
   links are not checked); an anchor into a Markdown file must name one of
   its headings (GitHub's heading ids).
3. docs/performance.md is exactly what `benchmarks.write_performance_docs`
   (`python -m benchmarks.write_performance_docs`) writes from
   benchmarks/results/ now; imported as a module of the `benchmarks`
   package, which the repository root on `sys.path` makes importable (pytest
   puts it there for the `tests` package, as for `from tests.conftest
   import ...`).
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md"] + DOCS

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NOT_RUNNABLE = re.compile(r"^\s*<!--\s*not runnable:(.*?)-->\s*$")
CONTINUES = re.compile(r"^\s*<!--\s*continues the example above\s*-->\s*$")
COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
PROGRAM_TIMEOUT_S = 900


def _relative(path):
    return str(path.relative_to(REPO))


def code_blocks(path):
    """`(line of the fence, language, code, the line before the fence)`
    for every fenced block of a Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, language = i, match.group(2).lower()
        end = i + 1
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        code = textwrap.dedent("\n".join(lines[start + 1 : end]))
        before = lines[start - 1] if start > 0 else ""
        blocks.append((start + 1, language, code, before))
        i = end + 1
    return blocks


def python_programs(path):
    """The runnable programs of a page: `(first fence line, code)`."""
    programs = []
    for line, language, code, before in code_blocks(path):
        if language != "python":
            continue
        if NOT_RUNNABLE.match(before):
            continue
        if CONTINUES.match(before) and programs:
            first, previous = programs[-1]
            programs[-1] = (first, previous + "\n" + code)
        else:
            programs.append((line, code))
    return programs


PROGRAMS = [
    pytest.param(page, code, id=f"{_relative(page)}:{line}")
    for page in PAGES
    for line, code in python_programs(page)
]


def test_pages_exist():
    assert (REPO / "docs" / "index.md").exists()
    assert len(DOCS) >= 10, [d.name for d in DOCS]


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_python_block_markers(page):
    """A comment right before a ```python fence is one of the two markers;
    `not runnable` carries a reason; `continues` follows a runnable block."""
    problems = []
    runnable_seen = False
    for line, language, _, before in code_blocks(page):
        if language != "python":
            continue
        where = f"{_relative(page)}:{line}"
        not_runnable = NOT_RUNNABLE.match(before)
        if not_runnable:
            if not not_runnable.group(1).strip():
                problems.append(f"{where}: 'not runnable' without a reason")
            continue
        if CONTINUES.match(before):
            if not runnable_seen:
                problems.append(f"{where}: continues no runnable block")
        elif COMMENT.match(before):
            problems.append(
                f"{where}: unknown marker {before.strip()!r}; use "
                "<!-- not runnable: REASON --> or "
                "<!-- continues the example above -->"
            )
        runnable_seen = True
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page, code", PROGRAMS)
def test_python_examples_run(page, code, tmp_path):
    env = dict(os.environ)
    # The package is importable however the suite was started (an installed
    # checkout, or PYTHONPATH=.); the example's own paths start at tmp_path.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH")) if p
    )
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=PROGRAM_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"example from {_relative(page)} exited {result.returncode}\n"
        f"--- code ---\n{code}\n--- stdout (end) ---\n{result.stdout[-3000:]}"
        f"\n--- stderr (end) ---\n{result.stderr[-6000:]}"
    )


def _strip_code(text):
    """Markdown text without fenced blocks and inline code spans, whose
    brackets are not links."""
    text = re.sub(r"^\s*```.*?^\s*```\s*$", "", text, flags=re.S | re.M)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def heading_ids(path):
    """GitHub's ids of a Markdown file's headings."""
    ids, counts = set(), {}
    text = re.sub(
        r"^\s*```.*?^\s*```\s*$",
        "",
        path.read_text(encoding="utf-8"),
        flags=re.S | re.M,
    )
    for match in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_relative_links_resolve(page):
    problems = []
    for target in LINK.findall(_strip_code(page.read_text(encoding="utf-8"))):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve()
        if not resolved.exists():
            problems.append(f"{target}: {resolved} does not exist")
        elif anchor and resolved.suffix == ".md":
            if anchor not in heading_ids(resolved):
                problems.append(f"{target}: no heading #{anchor} there")
    assert not problems, f"{_relative(page)}:\n" + "\n".join(problems)


def test_performance_page_is_generated(tmp_path):
    from benchmarks import write_performance_docs

    output = tmp_path / "performance.md"
    assert write_performance_docs.main(["--output", str(output)]) == 0
    expected = output.read_text(encoding="utf-8")
    current = (REPO / "docs" / "performance.md").read_text(encoding="utf-8")
    assert current == expected, (
        "docs/performance.md is out of date: run "
        "python -m benchmarks.write_performance_docs"
    )
