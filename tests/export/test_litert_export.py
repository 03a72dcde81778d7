"""`export(path, format="litert")` on TensorFlow: the `.tflite` file runs in
the LiteRT interpreter of the TensorFlow package (builtin ops only, no Flex
delegate) and reproduces the functional output (the cascade's bucket
logits) and, from them, the token log-probs of `score()`."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer
from tests.conftest import CORPUS
from tests.conftest import small_proto_bytes
from tests.numpy_reference import token_log_probs

pytestmark = pytest.mark.skipif(
    keras.config.backend() != "tensorflow",
    reason="LiteRT export converts a TensorFlow graph (KERAS_BACKEND=tensorflow)",
)


def test_litert_interpreter_reproduces_keras(tmp_path):
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        MultiHashFormerTokenizer(small_proto_bytes()),
        "tiny_h3b64",
        sequence_length=16,
    )
    batch = lm.preprocessor(CORPUS[:2])[0]
    token_ids = np.asarray(batch["token_ids"], "int32")
    padding_mask = np.asarray(batch["padding_mask"], "int32")
    path = str(tmp_path / "model.tflite")
    lm.export(path, format="litert")
    with pytest.warns(UserWarning, match="deprecated"):
        interpreter = tf.lite.Interpreter(model_path=path)
    runner = interpreter.get_signature_runner()
    signatures = np.asarray(lm.backbone.signature_lookup.get_signatures())
    for length in (16, 9):  # the exported shapes are dynamic
        ids, mask = token_ids[:, :length], padding_mask[:, :length]
        served = runner(token_ids=ids, padding_mask=mask)["output_0"]
        expected = lm({"token_ids": ids, "padding_mask": mask})
        expected = np.asarray(ops.convert_to_numpy(expected))
        assert served.shape == expected.shape  # [b, s, H, B]
        np.testing.assert_allclose(served, expected, atol=1e-5)
        score = np.asarray(ops.convert_to_numpy(lm.score(ids, mask)))
        rows = mask.astype(bool)
        np.testing.assert_allclose(
            token_log_probs(
                served.astype("float64"), signatures, lm.scoring_temperature
            )[rows],
            score[rows],
            atol=1e-4,
        )
