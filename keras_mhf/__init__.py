"""MultiHashFormer for Keras 3: hash-based generative language models."""

import os as _os
import sys as _sys

if _sys.argv and _os.path.basename(_sys.argv[0]) == "keras-mhf":
    # The command line: TensorFlow's start-up lines mean nothing there.
    _os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")

from keras_mhf.utils import native_logs as _native_logs

# A no-op unless an entry point set KERAS_MHF_QUIET_STARTUP=1 (see
# keras_mhf/utils/native_logs.py): drops TensorFlow's start-up lines that
# mean nothing on a CPU machine.
with _native_logs.filtered_startup():
    from keras_mhf import layers
    from keras_mhf import losses
    from keras_mhf import models
    from keras_mhf.signatures import SignatureTable

__version__ = "0.1.0"
