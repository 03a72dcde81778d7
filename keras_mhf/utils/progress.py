"""A progress line with an ETA for long loops (evaluation, calibration).

Library calls are silent unless asked (`progress=True`, or
`show_progress()` once, as the quickstart and the recipes do). A loop that
finishes within `delay` seconds prints nothing; a longer one prints, on
stderr, one line rewritten in place on a terminal (every 0.5 s) or a new
line every 10 s otherwise (logs), and a last line when it ends:

    lambada test.jsonl: 1,208/5,153 passages (23%) | 41.2 passages/s | ETA 1m35s
"""

import sys
import time

_SHOW = False


def show_progress(enabled=True):
    """Sets whether calls that take `progress=None` (the default) report
    progress; returns the previous setting.

    Example:

    ```python
    from keras_mhf.utils.progress import show_progress

    show_progress()  # evaluate_preset, calibrate, ... now report progress
    ```
    """
    global _SHOW
    previous, _SHOW = _SHOW, bool(enabled)
    return previous


def progress_enabled(enabled=None):
    """`enabled`, or the `show_progress` setting when it is `None`."""
    return _SHOW if enabled is None else bool(enabled)


def _duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """A periodic progress line with ETA on stderr (see the module docstring).

    Args:
        label: what runs, e.g. `"lambada test.jsonl"`.
        total: the number of units.
        unit: their name, plural (`"passages"`).
        enabled: `True`/`False`, or `None` for the `show_progress` setting.
        delay: seconds before the first line (shorter loops print nothing).

    Example:

    ```python
    progress = Progress("scoring", len(batches), "batches")
    for i, batch in enumerate(batches):
        ...
        progress.update(i + 1)
    progress.close()
    ```
    """

    def __init__(self, label, total, unit, enabled=None, delay=2.0):
        self.label, self.total, self.unit = label, max(int(total), 1), unit
        self.enabled = progress_enabled(enabled)
        self.delay = delay
        self.started = self.last = time.monotonic()
        self.done, self.shown = 0, False
        self.tty = self.enabled and sys.stderr.isatty()

    def update(self, done):
        """Records `done` units finished; prints when it is time to."""
        self.done = done
        now = time.monotonic()
        if not self.enabled or now - self.started < self.delay:
            return
        if self.shown and now - self.last < (0.5 if self.tty else 10.0):
            return
        self._show(now)

    def close(self):
        """Prints the last line (only if a line was shown before)."""
        if self.shown:
            self._show(time.monotonic(), final=True)

    def _show(self, now, final=False):
        self.last, self.shown = now, True
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        if final:
            tail = f"done in {_duration(elapsed)}"
        else:
            eta = (self.total - self.done) / rate if rate > 0 else None
            tail = "ETA " + ("--" if eta is None else _duration(eta))
        line = (
            f"{self.label}: {self.done:,}/{self.total:,} {self.unit} "
            f"({100 * self.done / self.total:.0f}%) | {rate:,.1f} "
            f"{self.unit}/s | {tail}"
        )
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
