"""The errors a pre-training run raises (see `keras_mhf.pretraining.pretrain`).

`RunConfigError` is raised before training (the recipe reports it as
`error: ...` and exits 2); the others stop a run that has started (the recipe
exits 1).
"""


class RunConfigError(ValueError):
    """A setting of the run is invalid, or the data, tokenizer or output
    directory do not fit it. Raised before training; the recipe reports it as
    `error: ...` and exits 2.

    Example:

    ```python
    RunConfig("d", "o", steps=0).validate()  # RunConfigError: --steps ...
    ```
    """


class CheckpointError(RuntimeError):
    """The output directory holds checkpoints, none of which can be loaded.

    Example:

    ```python
    try:
        pretrain("prepared/openstax", "runs/mhf")
    except CheckpointError as error:
        print(error)  # names each checkpoint and what is wrong with it
    ```
    """


class NonFiniteTrainingError(RuntimeError):
    """Training produced a non-finite loss or non-finite weights.

    Attributes:
        step: the global optimizer step at which it was detected.
        checkpoint: the newest (finite) checkpoint kept, or `None`.

    Example:

    ```python
    try:
        pretrain("prepared/openstax", "runs/mhf", learning_rate=1e6)
    except NonFiniteTrainingError as error:
        print(error.step, error.checkpoint)
    ```
    """

    def __init__(self, message, step, checkpoint):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class NonFiniteLossError(NonFiniteTrainingError):
    """The training loss became NaN or infinite (e.g. a learning rate that
    is too high); nothing was written from the diverged weights."""


class NonFiniteWeightsError(NonFiniteTrainingError):
    """A weight became NaN or infinite although the loss stayed finite; the
    checkpoint, preset or summary that was about to be written was not."""


class NonFiniteValues(ValueError):
    """A checkpoint was not committed: some of its values are NaN or
    infinite (`checkpoint_store.CheckpointWriter` raises it in its writing
    thread; `checkpoints.RunCheckpoints.wait` turns it into a
    `NonFiniteWeightsError` naming the last good checkpoint). `paths` names
    those variables.

    Example:

    ```python
    NonFiniteValues(300, ["hash_encoder/embeddings_0"]).paths
    ```
    """

    def __init__(self, step, paths):
        super().__init__(
            f"the values of {len(paths)} variables are not finite at step "
            f"{step} (e.g. {paths[0]})"
        )
        self.step, self.paths = step, paths
