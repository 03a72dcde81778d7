"""The instrumentation point of data preparation and pre-training runs.

`event` does nothing. Tests replace it to inject faults at the named points
of a run (raise, or SIGKILL the process) or to stop it early, and tools
replace it to time a run. Every caller looks it up through this module at
call time (`hooks.event(...)`), so replacing the module attribute reaches
them all. `keras_mhf.pretraining.hooks` is this same module:

```python
from keras_mhf.pretraining import hooks

def print_steps(name, **info):
    if name == "train_step":
        print(info["step"])

hooks.event = print_steps  # tests: monkeypatch.setattr(hooks, "event", ...)
```
"""


class Stop(Exception):
    """Raised by a hook at `"chunk_start"` to end a pre-training run there:
    the run stops training, as one with no steps left would, and returns
    its `"incomplete"` summary (a rerun resumes it)."""


def event(name, **info):
    """Instrumentation point: does nothing (see the module docstring).

    Events of `keras_mhf.data.prepare_data`:

    - `"shard_written"` (`path`: the complete shard file, just renamed from
      `.partial`; `split`): fires before the shard is checkpointed in
      `prepare_state.json`, so raising here stops the run as if it were
      killed right after the shard's rename (a rerun resumes it).

    Events of a pre-training run (`keras_mhf.pretraining.pretrain`):

    - `"chunk_start"` (`step`: the global step the chunk starts at;
      `chunks`: the chunks this call has run so far): fires before each
      chunk's training; raising `Stop` ends the run there with its
      `"incomplete"` summary (any other exception fails the run).
    - `"train_step"` (`step`: the global step just run; `callback`: the
      Keras callback whose `.model` is the model being trained, its
      weights as of this step; fires after every optimizer step).
    - `"weights_written"` (`path`: the weights file in the temporary
      checkpoint directory), `"checkpoint_complete"` (`path`: the complete
      temporary directory, before its rename), `"checkpoint_renamed"`
      (`path`: the final directory, before pruning).

    Args:
        name: the event's name.
        **info: what the event carries (as listed above).
    """
