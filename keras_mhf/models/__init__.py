"""KerasHub models: MultiHashFormer backbone, causal LM, preprocessor,
tokenizer, and the Standard (Qwen3) baseline."""

from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    architecture_config,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    architecture_names,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    count_parameters,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    parse_architecture,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_backbone import (
    MultiHashFormerBackbone,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm import (
    MultiHashFormerCausalLM,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm_preprocessor import (
    MultiHashFormerCausalLMPreprocessor,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_tokenizer import (
    MultiHashFormerTokenizer,
)
from keras_mhf.models.preset_loading import load_causal_lm
from keras_mhf.models.qwen3_decoder_block import Qwen3DecoderBlock
from keras_mhf.models.standard.standard_backbone import StandardBackbone
from keras_mhf.models.standard.standard_causal_lm import StandardCausalLM
from keras_mhf.models.standard.standard_causal_lm import standard_backbone
from keras_mhf.models.standard.standard_causal_lm import standard_causal_lm
