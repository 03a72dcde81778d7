"""Vocabulary expansion for new languages (paper Sec. 4.4): SentencePiece
tokenizers extended with new pieces, and the continual pre-training setup.
The models' own `expand_vocabulary` lives with each model family."""

from keras_mhf.expansion.tokenizer_expansion import SCRIPTS
from keras_mhf.expansion.tokenizer_expansion import append_pieces
from keras_mhf.expansion.tokenizer_expansion import expand_sentencepiece
from keras_mhf.expansion.tokenizer_expansion import (
    freeze_for_continual_pretraining,
)
from keras_mhf.expansion.tokenizer_expansion import in_script
