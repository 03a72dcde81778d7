"""Keras layers of MultiHashFormer (paper Sec. 3)."""

from keras_mhf.layers.cascade_hash_decoder import CascadeHashDecoder
from keras_mhf.layers.hash_encoder import HashEncoder
from keras_mhf.layers.signature_lookup import SignatureLookup
