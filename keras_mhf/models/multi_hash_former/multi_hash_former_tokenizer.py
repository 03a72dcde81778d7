import keras
from keras_hub.tokenizers import SentencePieceTokenizer

from keras_mhf.models.multi_hash_former.multi_hash_former_backbone import (
    MultiHashFormerBackbone,
)


@keras.saving.register_keras_serializable(package="keras_mhf")
class MultiHashFormerTokenizer(SentencePieceTokenizer):
    """SentencePiece tokenizer for MultiHashFormer models.

    Works with the paper's Mistral v0.3 model (32,768 pieces, `<s>`/`</s>`, no
    pad: the pad token is `</s>`, id 2, as in the authors' code) and with any
    SentencePiece model, e.g. one trained with
    `keras_hub.tokenizers.compute_sentence_piece_proto`. Special tokens:
    `<s>` (start) and `</s>` (end).

    Two pad notions are kept apart. `signature_pad_token_id` is the token whose
    signature is all zeros: `<pad>` if the model has one, else `</s>`, as the
    authors' code sets `pad = eos`. `pad_token_id` is what the preprocessor
    fills unused positions with (they are masked): `<pad>` if present, else
    `<unk>` (id 0), like KerasHub's Mistral tokenizer, because KerasHub's
    `generate` stops at end tokens found after the prompt, so padding with
    `</s>` would end generation before it starts.
    `get_vocabulary()` returns the piece strings exactly as the model holds
    them (with `▁`), which is what the signature table hashes.

    Args:
        proto: path to a SentencePiece `.model` file or its bytes.
        **kwargs: standard `keras_hub.tokenizers.SentencePieceTokenizer`
            arguments.

    Example:

    ```python
    import io, sentencepiece as spm  # or pass a `.model` file's path
    texts, model = ["The quick brown fox jumps."] * 20, io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts),
        model_writer=model, vocab_size=24, minloglevel=2)
    tokenizer = keras_mhf.models.MultiHashFormerTokenizer(model.getvalue())
    tokenizer("The quick brown fox.")
    ```
    """

    backbone_cls = MultiHashFormerBackbone

    def __init__(self, proto=None, **kwargs):
        self._add_special_token("<s>", "start_token")
        self._add_special_token("</s>", "end_token")
        self.pad_token_id = None
        self.signature_pad_token_id = None
        super().__init__(proto=proto, **kwargs)

    def export_to_transformers(self, path, overwrite=False):
        """Writes Hugging Face tokenizer files (`tokenizer.model`,
        `tokenizer.json`, `tokenizer_config.json`,
        `special_tokens_map.json`) to a new directory: `AutoTokenizer`
        then gives exactly this tokenizer's ids, `<s>` prepended. See
        `keras_mhf.export.transformers.sentencepiece_tokenizer_files`.

        Example:

        ```python
        tokenizer.export_to_transformers("exported_tokenizer")
        ```
        """
        from keras_mhf.export.transformers import hf_exporter

        return hf_exporter.export_tokenizer(self, path, overwrite)

    def _update_special_token_ids(self):
        super()._update_special_token_ids()
        vocabulary = self._token_to_id_map
        if "<pad>" in vocabulary:
            self.pad_token_id = self.signature_pad_token_id = vocabulary[
                "<pad>"
            ]
        else:
            self.pad_token_id = (
                self._unk_token_id if self._unk_token_id >= 0 else 0
            )
            self.signature_pad_token_id = self.end_token_id
