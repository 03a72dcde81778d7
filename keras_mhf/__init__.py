"""MultiHashFormer for Keras 3: hash-based generative language models."""

from keras_mhf import layers
from keras_mhf import losses
from keras_mhf import models
from keras_mhf.signature_table import SignatureTable

__version__ = "0.1.0"
