import keras
from keras_hub.models import CausalLMPreprocessor

from keras_mhf.models.multi_hash_former_backbone import MultiHashFormerBackbone
from keras_mhf.models.multi_hash_former_tokenizer import (
    MultiHashFormerTokenizer,
)


@keras.saving.register_keras_serializable(package="keras_mhf")
class MultiHashFormerCausalLMPreprocessor(CausalLMPreprocessor):
    """KerasHub causal-LM preprocessor for MultiHashFormer.

    Tokenizes strings, adds `<s>`/`</s>`, pads to `sequence_length + 1` and
    returns `({"token_ids", "padding_mask"}, next_token_ids, sample_weight)`
    for `fit`; `generate_preprocess`/`generate_postprocess` serve `generate`.

    Args:
        tokenizer: a `MultiHashFormerTokenizer`.
        sequence_length: int, packed length. Defaults to 1024.
        add_start_token: bool. Defaults to `True`.
        add_end_token: bool. Defaults to `True`.

    Example:

    ```python
    preprocessor = keras_mhf.models.MultiHashFormerCausalLMPreprocessor(
        tokenizer, sequence_length=64
    )
    x, y, sample_weight = preprocessor(["The quick brown fox."])
    ```
    """

    backbone_cls = MultiHashFormerBackbone
    tokenizer_cls = MultiHashFormerTokenizer
