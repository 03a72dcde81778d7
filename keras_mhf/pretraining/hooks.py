"""The instrumentation point of a pre-training run.

`event` does nothing. Tests replace it to inject faults at the named points
of a checkpoint write (raise, or SIGKILL the process) and tools replace it to
time a run. Every caller looks it up through this module at call time
(`hooks.event(...)`), so replacing the module attribute reaches them all:

```python
from keras_mhf.pretraining import hooks

def print_steps(name, **info):
    if name == "train_step":
        print(info["step"])

hooks.event = print_steps  # tests: monkeypatch.setattr(hooks, "event", ...)
```
"""


def event(name, **info):
    """Instrumentation point: does nothing (see the module docstring).

    Events: `"weights_written"` (`path`: the weights file in the temporary
    checkpoint directory), `"checkpoint_complete"` (`path`: the complete
    temporary directory, before its rename), `"checkpoint_renamed"`
    (`path`: the final directory, before pruning), `"train_step"` (`step`:
    the global step just run; fires after every optimizer step).

    Args:
        name: the event's name.
        **info: what the event carries (`path` or `step`).
    """
