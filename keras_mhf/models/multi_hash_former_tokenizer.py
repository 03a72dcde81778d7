import keras
from keras_hub.tokenizers import SentencePieceTokenizer

from keras_mhf.models.multi_hash_former_backbone import MultiHashFormerBackbone


@keras.saving.register_keras_serializable(package="keras_mhf")
class MultiHashFormerTokenizer(SentencePieceTokenizer):
    """SentencePiece tokenizer for MultiHashFormer models.

    Works with the paper's Mistral v0.3 model (32,768 pieces, `<s>`/`</s>`, no
    pad: the pad token is `</s>`, id 2, as in the authors' code) and with any
    SentencePiece model, e.g. one trained with
    `keras_hub.tokenizers.compute_sentence_piece_proto`. Special tokens:
    `<s>` (start), `</s>` (end) and `<pad>` if the model has one, else `</s>`.
    `get_vocabulary()` returns the piece strings exactly as the model holds
    them (with `▁`), which is what the signature table hashes.

    Args:
        proto: path to a SentencePiece `.model` file or its bytes.
        **kwargs: standard `keras_hub.tokenizers.SentencePieceTokenizer`
            arguments.

    Example:

    ```python
    tokenizer = keras_mhf.models.MultiHashFormerTokenizer(
        "../shared/data/mistral_v03_tokenizer/tokenizer.model"
    )
    tokenizer("The quick brown fox.")
    ```
    """

    backbone_cls = MultiHashFormerBackbone

    def __init__(self, proto=None, **kwargs):
        self._add_special_token("<s>", "start_token")
        self._add_special_token("</s>", "end_token")
        self.pad_token = None
        self.pad_token_id = None
        super().__init__(proto=proto, **kwargs)

    def _update_special_token_ids(self):
        super()._update_special_token_ids()
        vocabulary = self._token_to_id_map
        self.pad_token = "<pad>" if "<pad>" in vocabulary else self.end_token
        self.pad_token_id = vocabulary[self.pad_token]
