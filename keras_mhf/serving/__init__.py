"""Serving a causal LM over HTTP with the OpenAI completions API
(`keras-mhf serve`): see docs/serving.md."""

from keras_mhf.serving.api_error import ApiError
from keras_mhf.serving.completion_batcher import CompletionBatcher
from keras_mhf.serving.completion_request import CompletionRequest
from keras_mhf.serving.completions_app import completions_app
from keras_mhf.serving.served_model import ServedModel
from keras_mhf.serving.served_tokenizer import ServedTokenizer
