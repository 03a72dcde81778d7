"""Optimizers of the recipes: `BiasCorrectedAdamW`, AdamW with epsilon after
bias correction, as `torch.optim.AdamW` and the authors' runs, and
`OptimizerStepSchedule`, a learning-rate schedule of optimizer steps under
gradient accumulation."""

from keras_mhf.optimizers.bias_corrected_adam_w import BiasCorrectedAdamW
from keras_mhf.optimizers.bias_corrected_adam_w import task_default_optimizer
from keras_mhf.optimizers.optimizer_step_schedule import OptimizerStepSchedule
