"""`keras_mhf.pretraining.hooks` is `keras_mhf.utils.hooks`, the same module
object (the data preparation fires events too, and `keras_mhf.data` does not
import `keras_mhf.pretraining`), so replacing `hooks.event` through either
name reaches every caller."""

import sys

from keras_mhf.utils import hooks

sys.modules[__name__] = hooks
