from keras_hub.src.tests.test_case import TestCase

from keras_mhf.models import MultiHashFormerTokenizer
from tests.conftest import small_proto_bytes


class MultiHashFormerTokenizerTest(TestCase):
    def setUp(self):
        self.init_kwargs = {"proto": small_proto_bytes()}
        self.input_data = [
            "The cell is the basic unit of life.",
            "Water boils.",
        ]

    def test_tokenizer_basics(self):
        self.run_preprocessing_layer_test(
            cls=MultiHashFormerTokenizer,
            init_kwargs=self.init_kwargs,
            input_data=self.input_data,
        )

    def test_special_tokens_and_two_pad_notions(self):
        tokenizer = MultiHashFormerTokenizer(**self.init_kwargs)
        vocabulary = tokenizer.get_vocabulary()
        self.assertEqual(vocabulary[tokenizer.start_token_id], "<s>")
        self.assertEqual(vocabulary[tokenizer.end_token_id], "</s>")
        # No <pad> piece: the signature pad is </s> (the authors' pad = eos)
        # and the preprocessor pads with <unk>, so padding never reads as an
        # end token during generation.
        self.assertNotIn("<pad>", vocabulary)
        self.assertEqual(
            tokenizer.signature_pad_token_id, tokenizer.end_token_id
        )
        self.assertEqual(vocabulary[tokenizer.pad_token_id], "<unk>")

    def test_vocabulary_holds_raw_pieces(self):
        tokenizer = MultiHashFormerTokenizer(**self.init_kwargs)
        self.assertTrue(
            any(piece.startswith("▁") for piece in tokenizer.get_vocabulary())
        )

    def test_serialization(self):
        self.run_serialization_test(
            MultiHashFormerTokenizer(**self.init_kwargs)
        )
