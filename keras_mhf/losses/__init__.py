"""Training objective of MultiHashFormer (paper Sec. 3.4)."""

from keras_mhf.losses.signature_cross_entropy import SignatureCrossEntropy
