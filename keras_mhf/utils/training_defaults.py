"""The defaults of the options `keras-mhf pretrain` and `keras-mhf finetune`
share (`keras_mhf.cli.common.add_training_options`), in a module without
Keras so that `--help` shows them at once. `PRETRAIN_DEFAULTS` are
`RunConfig`'s own (a test checks that they agree); `FINETUNE_DEFAULTS` are
what `keras_mhf.pretraining.finetune` uses for settings it is not given.

Example:

>>> FINETUNE_DEFAULTS["steps"], PRETRAIN_DEFAULTS["steps"]
(100, 300)
"""

PRETRAIN_DEFAULTS = dict(
    steps=300,
    learning_rate=2e-3,
    warmup_steps=30,
    weight_decay=0.1,
    validation_fraction=0.05,
    checkpoint_every=50,
)

# Fine-tuning starts from a trained model: fewer, gentler steps.
FINETUNE_DEFAULTS = dict(
    steps=100,
    learning_rate=1e-3,
    warmup_steps=10,
    weight_decay=0.0,
    checkpoint_every=25,
    validation_fraction=0.1,
)
