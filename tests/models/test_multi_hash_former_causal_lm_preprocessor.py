import numpy as np
from keras import ops
from keras_hub.src.tests.test_case import TestCase

from keras_mhf.models import MultiHashFormerCausalLMPreprocessor
from keras_mhf.models import MultiHashFormerTokenizer
from tests.conftest import small_proto_bytes


class MultiHashFormerCausalLMPreprocessorTest(TestCase):
    def setUp(self):
        self.tokenizer = MultiHashFormerTokenizer(small_proto_bytes())
        self.init_kwargs = {"tokenizer": self.tokenizer, "sequence_length": 8}
        self.input_data = ["The cell is the basic unit of life."]

    def test_preprocessor_basics(self):
        output = self.run_preprocessor_test(
            cls=MultiHashFormerCausalLMPreprocessor,
            init_kwargs=self.init_kwargs,
            input_data=self.input_data,
        )
        x, y, sample_weight = output
        ids = np.asarray(ops.convert_to_numpy(x["token_ids"]))[0]
        self.assertEqual(ids[0], self.tokenizer.start_token_id)
        # y is x shifted by one; the weights mark real next tokens.
        np.testing.assert_array_equal(
            np.asarray(ops.convert_to_numpy(y))[0][:-1], ids[1:]
        )
        self.assertEqual(
            tuple(np.shape(ops.convert_to_numpy(sample_weight))), (1, 8)
        )

    def test_padding_uses_the_packing_pad_and_masks_it(self):
        preprocessor = MultiHashFormerCausalLMPreprocessor(**self.init_kwargs)
        x, _, sample_weight = preprocessor(["Water"])
        ids = np.asarray(ops.convert_to_numpy(x["token_ids"]))[0]
        mask = np.asarray(ops.convert_to_numpy(x["padding_mask"]))[0]
        self.assertTrue(
            np.all(ids[~mask.astype(bool)] == self.tokenizer.pad_token_id)
        )
        self.assertFalse(np.asarray(ops.convert_to_numpy(sample_weight))[0][-1])

    def test_generate_preprocess_and_postprocess(self):
        preprocessor = MultiHashFormerCausalLMPreprocessor(**self.init_kwargs)
        x = preprocessor.generate_preprocess(["The cell"], sequence_length=10)
        ids = np.asarray(ops.convert_to_numpy(x["token_ids"]))
        self.assertEqual(ids.shape, (1, 10))
        # No end token is added for generation.
        self.assertNotIn(
            self.tokenizer.end_token_id,
            ids[0][np.asarray(ops.convert_to_numpy(x["padding_mask"]))[0]],
        )
        text = preprocessor.generate_postprocess(x)
        self.assertEqual(text, ["The cell"])
