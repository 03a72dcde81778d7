"""MultiHashFormer for Keras 3: hash-based generative language models."""

from keras_mhf.signature_table import SignatureTable

__version__ = "0.1.0"
