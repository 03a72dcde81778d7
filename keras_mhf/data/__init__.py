"""Text corpora -> tokens for `model.fit` (numpy and sentencepiece, no Keras).

Two paths:

- In memory, for small corpora: `read_documents` -> `pack_documents` ->
  `blocks_to_features`.
- On disk, for real pre-training corpora: `prepare_data` (or
  `keras-mhf prepare`) tokenizes once into token shards;
  `PreparedCorpus` opens them; `window_dataset` streams deterministic,
  resumable, multi-host batches from them and `validation_windows` gives a
  fixed evaluation set.

Example:

```python
from keras_mhf.data import PreparedCorpus, prepare_data, window_dataset

prepare_data("corpus/", "tokenizer.model", "prepared/")
corpus = PreparedCorpus("prepared/")
dataset = window_dataset(corpus, "train", 128, 32, seed=0, num_steps=100)
```
"""

from keras_mhf.data.documents import CORPUS_EXTENSIONS
from keras_mhf.data.documents import CorpusWarning
from keras_mhf.data.documents import Document
from keras_mhf.data.documents import DocumentReader
from keras_mhf.data.documents import ReadPosition
from keras_mhf.data.documents import is_corpus_file
from keras_mhf.data.documents import list_corpus_files
from keras_mhf.data.documents import read_documents
from keras_mhf.data.packing import blocks_to_features
from keras_mhf.data.packing import pack_documents
from keras_mhf.data.prepare import DEFAULT_SHARD_TOKENS
from keras_mhf.data.prepare import available_cores
from keras_mhf.data.prepare import prepare_data
from keras_mhf.data.prepare import token_dtype
from keras_mhf.data.prepare import validation_score
from keras_mhf.data.prepared_corpus import PreparedCorpus
from keras_mhf.data.prepared_corpus import read_index
from keras_mhf.data.prepared_corpus import tokenizer_file_sha256
from keras_mhf.data.windows import WindowSampler
from keras_mhf.data.windows import validation_windows
from keras_mhf.data.windows import window_dataset
from keras_mhf.data.windows import window_starts
