"""TensorBoard curves of a pre-training run (`OUTPUT/tensorboard/` unless
`tensorboard=` says otherwise), written with TensorBoard's own event-file
writer (no TensorFlow needed).

Scalars (the step is the global optimizer step):

- `train/loss`: the mean training loss over the steps since the previous
  point (for MHF the sum over heads of the bucket cross-entropies), every
  `log_every` steps (the authors log every 10) and at each checkpoint;
- `train/learning_rate`: the rate the point's step used;
- `train/tokens_per_second`: training tokens over wall time since the
  previous point (the first point of a chunk includes compiling);
- at each checkpoint, from the run's `log.csv` row: `validation/loss`,
  `validation/accuracy`, `validation/perplexity_paper_rule` (reported
  windows, scoring temperature 1: the Standard model's one rule) and, for
  MHF, `validation/perplexity_calibrated` and `validation/scoring_temperature`.

A resumed run first drops the points past the checkpoint it resumes from
(`trim_curves`, as `trim_log` does for `log.csv`), so its curves hold every
step once.

Example:

```python
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

curves = EventAccumulator("runs/mhf/tensorboard").Reload()
[(e.step, e.value) for e in curves.Scalars("train/loss")]
```
"""

import glob
import os
import time

import keras
import numpy as np

EVENT_FILES = "events.out.tfevents.*"
_TRIMMED = ".curves-trimmed.tmp"


def _event_pb2():
    from tensorboard.compat.proto import event_pb2

    return event_pb2


def scalar_event(tag, value, step):
    """A TensorBoard `Event` holding one scalar."""
    from tensorboard.compat.proto import summary_pb2

    summary = summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))]
    )
    return _event_pb2().Event(
        wall_time=time.time(), step=int(step), summary=summary
    )


def _read_events(path):
    """The events of one event file, in order (a record cut short by a
    killed writer ends the file)."""
    from tensorboard.backend.event_processing.event_file_loader import (
        RawEventFileLoader,
    )

    parse = _event_pb2().Event.FromString
    return [parse(data) for data in RawEventFileLoader(path).Load()]


def trim_curves(directory, step):
    """Keeps each curve's points up to `step`, once: a run killed after its
    last checkpoint wrote points it will write again when it resumes.

    When the event files hold a point past `step` (or a point twice), their
    points up to `step` are written to one new event file (under another
    name, then renamed to the oldest file's name + `.trimmed`) and the old
    files are removed; otherwise nothing changes. A run killed in between
    leaves a point twice, which the next resume trims.

    Example:

    ```python
    trim_curves("runs/mhf/tensorboard", step=500)
    ```
    """
    files = sorted(glob.glob(os.path.join(directory, EVENT_FILES)))
    kept, changed = {}, False
    for path in files:
        for event in _read_events(path):
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                key = (value.tag, event.step)
                if event.step > step or key in kept:
                    changed = True
                if event.step <= step:
                    kept[key] = (event.wall_time, value)
    if not changed:
        return
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    event_pb2 = _event_pb2()
    temporary = os.path.join(directory, _TRIMMED)
    with open(temporary, "wb") as f:
        writer = RecordWriter(f)
        writer.write(
            event_pb2.Event(
                wall_time=time.time(), file_version="brain.Event:2"
            ).SerializeToString()
        )
        for (_, point_step), (wall_time, value) in sorted(
            kept.items(), key=lambda item: (item[0][1], item[1][0])
        ):
            summary = summary_pb2.Summary(value=[value])
            event = event_pb2.Event(
                wall_time=wall_time, step=point_step, summary=summary
            )
            writer.write(event.SerializeToString())
        f.flush()
        os.fsync(f.fileno())
    # Named after the oldest file, so that readers (which take files in
    # name order) read it before the files the resumed run writes.
    name = os.path.basename(files[0]).removesuffix(".trimmed") + ".trimmed"
    os.replace(temporary, os.path.join(directory, name))
    for path in files:
        if os.path.basename(path) != name:
            os.remove(path)


def open_curves(directory, step):
    """The event-file writer of a run that starts (or resumes) at `step`:
    the points past `step` are dropped first (`trim_curves`).

    Returns:
        A `tensorboard.summary.writer.event_file_writer.EventFileWriter`
        (`add_event`, `flush`, `close`), writing a new file in `directory`.

    Example:

    ```python
    writer = open_curves("runs/mhf/tensorboard", step=0)
    writer.add_event(scalar_event("train/loss", 7.5, 10))
    writer.close()
    ```
    """
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    os.makedirs(directory, exist_ok=True)
    trim_curves(directory, step)
    return EventFileWriter(directory, flush_secs=30)


def write_validation_point(writer, row):
    """The validation scalars of a `log.csv` row (see the module
    docstring), at the row's step; empty cells (a Standard run's
    calibration) are left out."""
    tags = {
        "validation/loss": "val_loss",
        "validation/accuracy": "val_accuracy",
        "validation/perplexity_paper_rule": "val_perplexity_reported",
        "validation/perplexity_calibrated": "val_perplexity_calibrated",
        "validation/scoring_temperature": "scoring_temperature",
    }
    for tag, column in tags.items():
        if row.get(column) not in (None, ""):
            writer.add_event(scalar_event(tag, row[column], row["step"]))


class TrainingCurves(keras.callbacks.Callback):
    """Writes the training scalars of one chunk of a run (one `fit` call)
    to TensorBoard: `train/loss`, `train/learning_rate`,
    `train/tokens_per_second` every `log_every` optimizer steps and at the
    chunk's last step (see the module docstring).

    The loss of a point is the mean of the batch losses since the previous
    point, taken from the running mean that `fit` reports (`logs["loss"]`
    after `k` batches is the mean of the first `k`).

    Args:
        writer: an `EventFileWriter` (`open_curves`).
        first_step: the global optimizer step before the chunk's first.
        last_step: the chunk's last global optimizer step.
        log_every: optimizer steps between points.
        micro_batches: `fit` batches per optimizer step (gradient
            accumulation).
        tokens_per_step: training tokens of one optimizer step.
        learning_rate: `learning_rate(step)`, the rate of (1-based) `step`.

    Example:

    ```python
    curves = TrainingCurves(writer, 0, 50, 10, 1, 8 * 128, lambda step: 1e-3)
    lm.fit(dataset, steps_per_epoch=50, callbacks=[curves])
    ```
    """

    def __init__(
        self,
        writer,
        first_step,
        last_step,
        log_every,
        micro_batches,
        tokens_per_step,
        learning_rate,
    ):
        super().__init__()
        self.writer = writer
        self.first_step = first_step
        self.last_step = last_step
        self.log_every = log_every
        self.micro_batches = micro_batches
        self.tokens_per_step = tokens_per_step
        self.learning_rate = learning_rate
        self._previous = None

    def on_train_begin(self, logs=None):
        # (batches, their loss sum, time) at the previous point.
        self._previous = (0, 0.0, time.perf_counter())

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1
        if done % self.micro_batches:
            return
        step = self.first_step + done // self.micro_batches
        if step % self.log_every and step != self.last_step:
            return
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        mean = float(np.asarray(keras.ops.convert_to_numpy(loss)))
        batches, total, started = self._previous
        now = time.perf_counter()
        total_now = mean * done
        steps = (done - batches) // self.micro_batches
        values = {
            "train/loss": (total_now - total) / (done - batches),
            "train/learning_rate": self.learning_rate(step),
            "train/tokens_per_second": steps
            * self.tokens_per_step
            / max(now - started, 1e-9),
        }
        for tag, value in values.items():
            self.writer.add_event(scalar_event(tag, value, step))
        self._previous = (done, total_now, now)
