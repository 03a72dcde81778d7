import keras
from keras_hub.models import CausalLMPreprocessor

from keras_mhf.models.causal_lm_inputs import check_texts
from keras_mhf.models.multi_hash_former.multi_hash_former_backbone import (
    MultiHashFormerBackbone,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_tokenizer import (
    MultiHashFormerTokenizer,
)
from keras_mhf.models.preset_consistency import check_preset_consistency
from keras_mhf.utils.arguments import check_positive_ints


@keras.saving.register_keras_serializable(package="keras_mhf")
class MultiHashFormerCausalLMPreprocessor(CausalLMPreprocessor):
    """KerasHub causal-LM preprocessor for MultiHashFormer.

    Tokenizes strings, adds `<s>`/`</s>`, pads to `sequence_length + 1` and
    returns `({"token_ids", "padding_mask"}, next_token_ids, sample_weight)`
    for `fit`; `generate_preprocess`/`generate_postprocess` serve `generate`.
    Inputs are checked on entry (`keras_mhf.models.causal_lm_inputs.
    check_texts`): a non-string entry, an empty batch, a dict or a numeric
    tensor fails with one clear error naming it, instead of an error inside
    the tokenizer; `sequence_length` overrides must be ints >= 1.

    Args:
        tokenizer: a `MultiHashFormerTokenizer`.
        sequence_length: int, packed length. Defaults to 1024.
        add_start_token: bool. Defaults to `True`.
        add_end_token: bool. Defaults to `True`.

    Example:

    ```python
    from keras_mhf.pretraining import train_sentencepiece

    texts = ["The quick brown fox jumps."] * 20
    path = train_sentencepiece(texts, 300, "tok.model")  # or your own
    tokenizer = keras_mhf.models.MultiHashFormerTokenizer(path)
    preprocessor = keras_mhf.models.MultiHashFormerCausalLMPreprocessor(
        tokenizer, sequence_length=64
    )
    x, y, sample_weight = preprocessor(["The quick brown fox."])
    ```
    """

    backbone_cls = MultiHashFormerBackbone
    tokenizer_cls = MultiHashFormerTokenizer

    def load_preset_assets(self, preset):
        """KerasHub's asset loading, after refusing a preset whose files
        disagree (`keras_mhf.models.preset_consistency`): every KerasHub
        route that loads a task with this preprocessor passes here, before
        the weights are read."""
        check_preset_consistency(preset)
        super().load_preset_assets(preset)

    def call(self, x, y=None, sample_weight=None, sequence_length=None):
        check_texts(x)
        if sequence_length is not None:
            check_positive_ints(
                "MultiHashFormerCausalLMPreprocessor",
                sequence_length=sequence_length,
            )
        return super().call(
            x, y=y, sample_weight=sample_weight, sequence_length=sequence_length
        )

    def generate_preprocess(self, x, sequence_length=None):
        check_texts(x, "prompts")
        if sequence_length is not None:
            check_positive_ints(
                "MultiHashFormerCausalLMPreprocessor",
                sequence_length=sequence_length,
            )
        return super().generate_preprocess(x, sequence_length=sequence_length)
