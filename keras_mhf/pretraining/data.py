"""The data of a pre-training run: the tokenizer (given, recorded in a
prepared corpus, or trained on a bounded sample of raw text), the prepared
corpus the training windows stream from, and the fixed validation windows.

`load_data` is the run's "data" step; `tokenizer_training_sample` and
`train_sentencepiece` are also used on their own (e.g. by
`recipes/expand_vocabulary.py`).
"""

import dataclasses
import hashlib
import io
import json
import os

import numpy as np

from keras_mhf.data import PreparedCorpus
from keras_mhf.data import list_corpus_files
from keras_mhf.data import prepare_data
from keras_mhf.data import read_documents
from keras_mhf.data import tokenizer_file_sha256
from keras_mhf.data import validation_score
from keras_mhf.data import validation_windows
from keras_mhf.data.prepared_corpus import INDEX_FILE
from keras_mhf.models.multi_hash_former.multi_hash_former_tokenizer import (
    MultiHashFormerTokenizer,
)
from keras_mhf.pretraining.config import is_primary
from keras_mhf.pretraining.config import process_layout
from keras_mhf.pretraining.errors import RunConfigError
from keras_mhf.utils.files import write_atomically

# The tokenizer trained when none is given sees at most this much of the
# training text (its first documents), so memory does not grow with the corpus.
TOKENIZER_SAMPLE_DOCUMENTS = 100_000
TOKENIZER_SAMPLE_CHARACTERS = 20_000_000


def tokenizer_training_sample(
    documents,
    max_documents=TOKENIZER_SAMPLE_DOCUMENTS,
    max_characters=TOKENIZER_SAMPLE_CHARACTERS,
    exclude=None,
):
    """Streams the first documents of `documents` up to a size cap.

    Args:
        documents: iterable of document strings (read lazily).
        max_documents: stop after this many documents.
        max_characters: stop once this many characters were yielded (the
            document that crosses the cap is the last one).
        exclude: optional predicate; documents for which it is true are
            skipped (e.g. the held-out ones).

    Example:

    >>> list(tokenizer_training_sample(["ab", "cd", "ef"], max_characters=3))
    ['ab', 'cd']
    """
    count = characters = 0
    for text in documents:
        if count >= max_documents or characters >= max_characters:
            return
        if exclude is not None and exclude(text):
            continue
        count += 1
        characters += len(text)
        yield text


def train_sentencepiece(documents, vocabulary_size, path):
    """Trains a byte-fallback BPE SentencePiece model (`<unk>`, `<s>`,
    `</s>` at ids 0-2, like Mistral's) and writes it to `path` atomically.

    SentencePiece holds every document it is given in memory: pass a bounded
    sample (`tokenizer_training_sample`) for a large corpus.

    Args:
        documents: iterable of document strings.
        vocabulary_size: number of pieces.
        path: the `.model` file to write.

    Example:

    ```python
    train_sentencepiece(read_documents("corpus.txt"), 4000, "tok.model")
    ```
    """
    import sentencepiece as spm

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(documents),
            model_writer=model,
            vocab_size=vocabulary_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=0.9995,
            max_sentence_length=1 << 16,
            hard_vocab_limit=False,
            minloglevel=2,
        )
    except RuntimeError as error:
        if "required_chars" in str(error):
            raise ValueError(
                f"vocabulary_size={vocabulary_size} is too small for this "
                "text: byte fallback needs 256 byte pieces plus one piece per "
                f"frequent character ({error}). Use a larger vocabulary_size."
            ) from error
        raise
    write_atomically(path, model.getvalue())
    return path


@dataclasses.dataclass
class RunData:
    """What `load_data` produces: the tokenizer, the prepared corpus the
    training windows stream from, and the fixed validation windows.

    Example:

    ```python
    data = load_data(config)
    data.fingerprint  # sha256 of the corpus's token streams
    ```
    """

    tokenizer_path: str
    tokenizer: MultiHashFormerTokenizer
    corpus: PreparedCorpus
    validation_blocks: np.ndarray

    @property
    def fingerprint(self):
        return corpus_fingerprint(self.corpus)


def corpus_fingerprint(corpus):
    """sha256 of what defines a prepared corpus's token streams: the
    tokenizer's sha256, the token dtype and every shard's sha256 and size
    (all read from `index.json`, so nothing is re-hashed).

    Example:

    ```python
    corpus_fingerprint(PreparedCorpus("prepared/openstax"))[:12]
    ```
    """
    index = corpus.index
    identity = {
        "tokenizer": index["tokenizer"]["sha256"],
        "dtype": index["dtype"],
        "splits": {
            split: [
                [shard["sha256"], shard["tokens"]]
                for shard in index["splits"][split]["shards"]
            ]
            for split in ("train", "validation")
        },
    }
    text = json.dumps(identity, sort_keys=True).encode("utf-8")
    return hashlib.sha256(text).hexdigest()


def is_prepared_directory(data):
    """Whether `data` is a directory written by `prepare_data` (it holds
    `index.json`, complete or not) rather than raw text.

    Example:

    ```python
    is_prepared_directory("prepared/openstax")  # True
    ```
    """
    from keras_mhf.data.prepared_corpus import STATE_FILE as PREPARE_STATE

    if not isinstance(data, (str, os.PathLike)) or not os.path.isdir(data):
        return False
    return any(
        os.path.exists(os.path.join(data, name))
        for name in (INDEX_FILE, PREPARE_STATE)
    )


def _open_corpus(directory):
    try:
        return PreparedCorpus(directory)
    except (ValueError, FileNotFoundError) as error:
        raise RunConfigError(str(error)) from error


def _tokenizer_for_prepared(config, corpus):
    """The tokenizer file of a prepared corpus: `config.tokenizer` (checked
    against the corpus) or the file recorded in `index.json`."""
    if config.tokenizer is not None:
        if not os.path.isfile(config.tokenizer):
            raise RunConfigError(f"No such tokenizer file: {config.tokenizer}")
        try:
            corpus.check_tokenizer(config.tokenizer)
        except ValueError as error:
            raise RunConfigError(
                f"--tokenizer {config.tokenizer} is not the tokenizer "
                f"{corpus.directory} was prepared with: {error} Or pass the "
                f"tokenizer it was prepared with ({_recorded(corpus)})."
            ) from error
        return config.tokenizer
    recorded = corpus.index["tokenizer"].get("path")
    if recorded and os.path.isfile(recorded):
        if tokenizer_file_sha256(recorded) == corpus.tokenizer_sha256:
            return recorded
        problem = f"{recorded} has changed since (its sha256 differs)"
    else:
        problem = f"{recorded} no longer exists"
    raise RunConfigError(
        f"{corpus.directory} was prepared with the tokenizer {recorded}, but "
        f"{problem}; pass --tokenizer with the .model file it was prepared "
        f"with (sha256 {corpus.tokenizer_sha256[:16]}...)."
    )


def _verify(config, corpus):
    """Checks every shard's sha256 and token ids once, before the run
    trusts the corpus (`verify_data`; `--no-verify` skips it)."""
    try:
        report = corpus.verify_checksums()
    except ValueError as error:
        raise RunConfigError(
            f"{error} (pass --no-verify only to train on it anyway)"
        ) from error
    if config.verbose:
        seconds = max(report["seconds"], 1e-6)
        print(
            f"Verified {report['shards']} shards of {corpus.directory} "
            f"({report['bytes'] / 1e6:,.1f} MB, sha256 and token ids) in "
            f"{report['seconds']:.2f} s ({report['bytes'] / 1e6 / seconds:,.0f}"
            " MB/s)."
        )


def _recorded(corpus):
    return corpus.index["tokenizer"].get("path") or "path not recorded"


def _check_trained_tokenizer(config, path):
    """A rerun on raw text reuses the tokenizer its first run trained into
    `OUTPUT/tokenizer.model`; one asking for another vocabulary size is
    refused (its run would silently train with the old tokenizer)."""
    import sentencepiece as spm

    pieces = spm.SentencePieceProcessor(model_file=path).get_piece_size()
    if pieces != config.vocabulary_size:
        raise RunConfigError(
            f"{config.output_dir} holds a {pieces}-piece tokenizer trained by "
            f"its first run ({path}), and --vocabulary-size is "
            f"{config.vocabulary_size}; rerun with --vocabulary-size "
            f"{pieces} to resume that run, or use a new --output."
        )


def _prepare_raw_text(config):
    """Prepares raw text into `OUTPUT/data/` (a no-op that only checks the
    inputs when a complete prepared corpus is already there) and returns
    `(tokenizer path, prepared directory)`."""
    try:
        list_corpus_files(config.data)
        if config.validation_data is not None:
            list_corpus_files(config.validation_data)
    except (ValueError, FileNotFoundError) as error:
        raise RunConfigError(str(error)) from error
    if config.tokenizer is not None and not os.path.isfile(config.tokenizer):
        raise RunConfigError(f"No such tokenizer file: {config.tokenizer}")
    prepared = config.path("data")
    if is_primary():
        os.makedirs(config.output_dir, exist_ok=True)
    tokenizer_path = config.tokenizer
    if tokenizer_path is None:
        tokenizer_path = config.path("tokenizer.model")
        if os.path.exists(tokenizer_path):
            _check_trained_tokenizer(config, tokenizer_path)
        else:
            if config.verbose:
                print(
                    f"Training a {config.vocabulary_size}-piece tokenizer on "
                    "at most the first "
                    f"{TOKENIZER_SAMPLE_DOCUMENTS:,} training documents / "
                    f"{TOKENIZER_SAMPLE_CHARACTERS:,} characters."
                )
            exclude = None
            if config.validation_data is None:
                fraction = config.validation_fraction

                def exclude(text):  # held out: the tokenizer never sees it
                    return validation_score(text) < fraction

            sample = tokenizer_training_sample(
                read_documents(
                    config.data,
                    on_error=config.on_error,
                    text_field=config.text_field,
                ),
                exclude=exclude,
            )
            train_sentencepiece(sample, config.vocabulary_size, tokenizer_path)
    if os.path.exists(os.path.join(prepared, INDEX_FILE)):
        if config.verbose:
            print(f"Using the prepared corpus in {prepared}.")
    elif config.verbose:
        print(f"Preparing the training text into {prepared} (resumable).")
    try:
        prepare_data(
            config.data,
            tokenizer_path,
            prepared,
            validation_fraction=config.validation_fraction,
            validation_inputs=config.validation_data,
            workers=config.workers,
            on_error=config.on_error,
            progress=bool(config.verbose),
            text_field=config.text_field,
        )
    except ValueError as error:
        raise RunConfigError(
            f"{error} (preparing --data into {prepared})"
        ) from error
    return tokenizer_path, prepared


def load_data(config):
    """Step "data": the tokenizer, the prepared corpus and the validation
    windows.

    `config.data` is either a prepared directory (`index.json`; nothing is
    written) or raw text (files, directories, glob patterns or a list),
    which is first prepared into `OUTPUT/data/` with
    `keras_mhf.data.prepare_data`; a rerun finds it complete and tokenizes
    nothing again. Without `config.tokenizer`, raw text gets a tokenizer
    trained on a bounded sample of its training documents
    (`OUTPUT/tokenizer.model`), and a prepared directory uses the tokenizer
    file recorded in its index if it still has the recorded sha256.

    With `config.verify_data` (the default), every shard's sha256 is checked
    against `index.json` and every token id against the tokenizer's
    vocabulary before the run trusts the corpus.

    Raises:
        RunConfigError: a damaged shard (it is named), a tokenizer that does
            not match the corpus, a missing tokenizer, `validation_data`
            with a prepared directory,
            or a split shorter than one window of `sequence_length + 1`.

    Example:

    ```python
    data = load_data(RunConfig("prepared/openstax", "runs/mhf"))
    data.corpus.num_tokens("train"), data.validation_blocks.shape
    ```
    """
    if is_prepared_directory(config.data):
        if config.validation_data is not None:
            raise RunConfigError(
                f"--validation-data applies to raw text; {config.data} is a "
                "prepared corpus with its own validation split (set it with "
                "keras-mhf prepare --validation)."
            )
        corpus = _open_corpus(config.data)
        tokenizer_path = _tokenizer_for_prepared(config, corpus)
    else:
        if process_layout()[1] > 1:
            raise RunConfigError(
                "A multi-process run needs a prepared --data directory (the "
                "processes must not prepare raw text at the same time); run "
                "keras-mhf prepare first and pass its output."
            )
        tokenizer_path, prepared = _prepare_raw_text(config)
        corpus = _open_corpus(prepared)
    if config.verify_data:
        _verify(config, corpus)
    for split in ("train", "validation"):
        tokens = corpus.num_tokens(split)
        if tokens < config.sequence_length + 1:
            raise RunConfigError(
                f"The {split} split of {corpus.directory} has {tokens} tokens, "
                "fewer than one window of --sequence-length + 1 = "
                f"{config.sequence_length + 1}; use a shorter "
                "--sequence-length or more data."
            )
    blocks = validation_windows(
        corpus, config.sequence_length, count=config.validation_blocks
    )
    return RunData(
        tokenizer_path,
        MultiHashFormerTokenizer(tokenizer_path),
        corpus,
        blocks,
    )
