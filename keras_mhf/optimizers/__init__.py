"""Optimizers of the recipes: `BiasCorrectedAdamW`, AdamW with epsilon after
bias correction, as `torch.optim.AdamW` and the authors' runs."""

from keras_mhf.optimizers.bias_corrected_adam_w import BiasCorrectedAdamW
from keras_mhf.optimizers.bias_corrected_adam_w import task_default_optimizer
