"""Per-example evaluation results streamed to a JSON-lines file as they are
computed, so that a long evaluation shows its work on disk and a rerun
resumes where the last one stopped (`keras_mhf.evaluation.evaluate_preset`,
`keras-mhf evaluate --output`).

The file, one JSON object per line:

- a header: `{"format": "keras_mhf.evaluation_results", "format_version": 1,
  "settings": {...}}`: what was evaluated (the preset's weights sha256, the
  settings that change the numbers). A rerun with other settings is refused.
- per task and file, before its first record: `{"task", "file", "sha256"}`.
  A rerun whose task file changed since is refused; a task file refused
  before any of it was recorded (a bad line) leaves no line, so the rerun on
  the corrected file evaluates it.
- per example (perplexity: per block), as soon as it is scored:
  `{"task", "file", "index", ...}`.
- per task and file, when it ends: `{"task", "file", "metrics"}`. A rerun
  reads finished tasks' metrics back instead of scoring them again.

Lines are appended and flushed one at a time; a line cut short by a crash is
dropped when the file is opened again. One process writes to a file at a
time (`keras_mhf.utils.output_lock`).
"""

import contextlib
import json
import os

from keras_mhf.utils.files import file_sha256
from keras_mhf.utils.files import fsync_file
from keras_mhf.utils.output_lock import output_lock

FORMAT = "keras_mhf.evaluation_results"
# 2 (0.2): multiple-choice and LAMBADA records hold both scoring rules.
FORMAT_VERSION = 2


class EvaluationResults:
    """An evaluation's results file, opened for resuming and appending.

    Use it through `open()`, which holds the file's lock.

    Args:
        path: the JSON-lines file (created if missing).
        settings: a JSON-serializable dict identifying the evaluation; a
            file written with other settings is refused.

    Example:

    ```python
    with EvaluationResults.open("results.jsonl", {"preset": "..."}) as log:
        task = log.task("lambada", "lambada_test.jsonl")
        for index, record in enumerate(records):
            if index not in task.done:
                task.add(index, record)
        task.finish({"acc": 0.5})
    ```
    """

    def __init__(self, path, settings):
        self.path = os.fspath(path)
        self.settings = json.loads(json.dumps(settings))
        self._tasks = {}  # (task, file) -> {"header", "done", "metrics"}
        self._file = None

    @classmethod
    @contextlib.contextmanager
    def open(cls, path, settings):
        """The results file, locked for this process and ready to append."""
        results = cls(path, settings)
        directory = os.path.dirname(os.path.abspath(results.path))
        lock = f".{os.path.basename(results.path)}.lock"
        with output_lock(directory, "an evaluation", lock_name=lock):
            results._load()
            try:
                yield results
            finally:
                results._close()

    def _load(self):
        lines = []
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                data = f.read()
            complete = data.rfind(b"\n") + 1
            if complete < len(data):
                # The last line was cut short by a crash: drop it.
                with open(self.path, "r+b") as f:
                    f.truncate(complete)
            for number, raw in enumerate(data[:complete].splitlines(), 1):
                try:
                    line = json.loads(raw)
                except ValueError:
                    line = None
                if number > 1 and not _is_record(line):
                    line = None
                if line is None:
                    raise ValueError(
                        f"{self.path}:{number} is not a results line (a JSON "
                        "object with task, file and index, metrics or "
                        "sha256): the results file is corrupt. Move it away "
                        "to evaluate again from the start."
                    )
                lines.append(line)
        if lines:
            self._check_header(lines[0])
            for line in lines[1:]:
                self._replay(line)
        self._file = open(self.path, "a", encoding="utf-8")
        if not lines:
            self._write(
                {
                    "format": FORMAT,
                    "format_version": FORMAT_VERSION,
                    "settings": self.settings,
                }
            )

    def _check_header(self, header):
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(
                f"{self.path} is not a keras_mhf evaluation results file "
                "(its first line has no results header). Use another "
                "--output."
            )
        if header.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{self.path} was written in results format version "
                f"{header.get('format_version')}; this keras_mhf reads "
                f"version {FORMAT_VERSION}. Use another --output."
            )
        if header.get("settings") != self.settings:
            changed = sorted(
                key
                for key in set(header["settings"]) | set(self.settings)
                if header["settings"].get(key) != self.settings.get(key)
            )
            raise ValueError(
                f"{self.path} holds the results of another evaluation "
                f"(different {', '.join(changed)}): a rerun only resumes "
                "the same evaluation. Use another --output, or move the "
                "file away."
            )

    def _entry(self, task, file):
        return self._tasks.setdefault(
            (task, str(file)), {"header": None, "done": {}, "metrics": None}
        )

    def _replay(self, line):
        entry = self._entry(line["task"], line["file"])
        if "index" in line:
            entry["done"][line["index"]] = line
        elif "metrics" in line:
            entry["metrics"] = line["metrics"]
        else:
            entry["header"] = line

    def _write(self, line):
        # allow_nan=False: NaN is not JSON; no line may hold one.
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._file.flush()

    def _close(self):
        if self._file is not None:
            self._file.close()
            fsync_file(self.path)
            self._file = None

    def task(self, task, file):
        """The results of `task` on `file` (a `TaskResults`). The file's
        sha256 is written before its first record (or its metrics) and
        checked on a rerun: a file that changed since results of it were
        recorded is refused; one of which nothing was recorded (its task
        stopped on a bad line) is evaluated anew.

        Args:
            task: the task's name (`"lambada"`, ...).
            file: the task file, as given.
        """
        entry = self._entry(task, file)
        header = {
            "task": task,
            "file": str(file),
            "sha256": file_sha256(file),
        }
        recorded = entry["done"] or entry["metrics"] is not None
        if entry["header"] not in (None, header) and recorded:
            raise ValueError(
                f"{file} changed since {self.path} recorded its {task} "
                f"results (sha256 {entry['header']['sha256'][:12]}..., now "
                f"{header['sha256'][:12]}...). Use another --output to "
                "evaluate the new file."
            )
        return TaskResults(self, task, str(file), entry, header)


def _is_record(line):
    """Whether a results line (after the header) is one this module writes:
    a task's header, an example's record or a task's metrics."""
    if not isinstance(line, dict):
        return False
    if not isinstance(line.get("task"), str) or not isinstance(
        line.get("file"), str
    ):
        return False
    if "index" in line:
        return isinstance(line["index"], int) and not isinstance(
            line["index"], bool
        )
    if "metrics" in line:
        return isinstance(line["metrics"], dict)
    return isinstance(line.get("sha256"), str)


class TaskResults:
    """One task's results in an `EvaluationResults` file: `done` (index ->
    record, from this run and earlier ones), `metrics` (set when the task
    finished), `add` and `finish`."""

    def __init__(self, results, task, file, entry, header):
        self._results, self.task, self.file = results, task, file
        self._entry, self._header = entry, header

    @property
    def done(self):
        return self._entry["done"]

    @property
    def metrics(self):
        return self._entry["metrics"]

    def add(self, index, record):
        """Appends example `index`'s record (a dict of JSON values)."""
        line = {"task": self.task, "file": self.file, "index": int(index)}
        line.update(record)
        self._write(line)
        self._entry["done"][int(index)] = line

    def finish(self, metrics):
        """Records the task's metrics: a rerun reads them back."""
        self._write({"task": self.task, "file": self.file, "metrics": metrics})
        self._entry["metrics"] = metrics

    def _write(self, line):
        """Writes `line`, after the task file's sha256 the first time."""
        if self._entry["header"] != self._header:
            self._results._write(self._header)
            self._entry["header"] = self._header
        self._results._write(line)
