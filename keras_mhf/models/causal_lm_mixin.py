"""What both causal LMs (MultiHashFormer and the Standard baseline) share on
top of KerasHub's `CausalLM`: checked `fit` and `generate`
(`keras_mhf.models.causal_lm_inputs`), the SavedModel export with text
endpoints, the Hugging Face export, and a compile config that `.keras`
loading restores."""

import os

import keras
import keras_hub

from keras_mhf.models import causal_lm_inputs
from keras_mhf.models import generation
from keras_mhf.models import generation_stream
from keras_mhf.utils.concurrent_inference import serialized
from keras_mhf.utils.files import fsync_directory
from keras_mhf.utils.files import fsync_file
from keras_mhf.utils.keras_private import flatten_layers
from keras_mhf.utils.keras_utils import in_memory_fit


class CausalLMMixin:
    """Mixed in before the KerasHub task class:
    `class StandardCausalLM(CausalLMMixin, Qwen3CausalLM)`."""

    def check_tokenizer(self, force=False):
        """Checks the attached tokenizer against the model (nothing to check
        by default; MultiHashFormer checks its signature table)."""

    def fit(self, x=None, y=None, *args, **kwargs):
        """`keras.Model.fit`, after checking the tokenizer and the data
        (`keras_mhf.models.causal_lm_inputs.checked_fit_inputs`) before any
        state changes: with a preprocessor, `x` must be strings (an empty
        list, a non-string entry or a dict is refused with one clear error);
        without one, every token id must be in the vocabulary (streamed
        datasets are checked batch by batch, the first one before training
        starts).

        Example:

        ```python
        lm.fit(["The cell is the basic unit of life."] * 8, batch_size=4)
        ```
        """
        self.check_tokenizer()
        x = causal_lm_inputs.checked_fit_inputs(self, x, y)
        with in_memory_fit(x, args, kwargs):  # KerasHub's batching, quietly
            return super().fit(x, y, *args, **kwargs)

    def save(self, filepath, overwrite=True, **kwargs):
        """`keras.Model.save`; a `.keras` file is written under a temporary
        name in the same folder and renamed into place, so a killed or
        failed save (a full disk) never leaves a cut-short file, and an
        older file stays whole until the new one is complete.

        Example:

        ```python
        lm.save("model.keras")  # keras.saving.load_model reads it back
        ```
        """
        local = isinstance(filepath, (str, os.PathLike))
        path = os.fspath(filepath) if local else None
        plain = (
            path is None
            or not path.endswith(".keras")
            or "://" in path  # a remote file system
            or kwargs.get("zipped") is False  # a folder
            or (os.path.exists(path) and not overwrite)  # Keras asks
        )
        if plain:
            return super().save(filepath, overwrite=overwrite, **kwargs)
        folder, name = os.path.split(os.path.abspath(path))
        temporary = os.path.join(folder, f".{name}.tmp-{os.getpid()}.keras")
        try:
            super().save(temporary, overwrite=True, **kwargs)
            fsync_file(temporary)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
        fsync_directory(folder)

    @serialized
    def generate(
        self,
        inputs,
        max_length=None,
        stop_token_ids="auto",
        strip_prompt=False,
        *,
        max_new_tokens=None,
        truncate=None,
    ):
        """KerasHub's `generate` with checked lengths (after checking the
        tokenizer); see `keras_mhf.models.generation.generate`.

        Args:
            inputs: strings (with a preprocessor) or token ids
                `{"token_ids", "padding_mask"}`, or a `tf.data.Dataset`.
            max_length: the total length (prompt, start token included, and
                new tokens); no prompt may be longer, and not all may fill
                it. Default: the preprocessor's `sequence_length` (token
                ids: their width).
            stop_token_ids: `"auto"`, `None` or a tuple of ids.
            strip_prompt: return only the generated part.
            max_new_tokens: instead of `max_length`: at most this many new
                tokens per prompt; total length (and KV cache) = longest
                prompt + `max_new_tokens`.
            truncate: `None` refuses a prompt that does not fit; `"left"`
                keeps its start token and last tokens.

        Example:

        ```python
        lm.generate("The cell", max_new_tokens=8)
        ```
        """
        self.check_tokenizer()
        return generation.generate(
            self,
            inputs,
            max_length=max_length,
            stop_token_ids=stop_token_ids,
            strip_prompt=strip_prompt,
            max_new_tokens=max_new_tokens,
            truncate=truncate,
        )

    def generate_stream(
        self,
        inputs,
        max_length=None,
        stop_token_ids="auto",
        *,
        max_new_tokens=None,
        truncate=None,
        stop=None,
        sampler=None,
        chunk_size=generation_stream.DEFAULT_CHUNK_SIZE,
    ):
        """`generate`, streamed: yields text pieces as they are made (after
        checking the tokenizer); see
        `keras_mhf.models.generation_stream.generate_stream`.

        Args:
            inputs: a string (pieces are strings), a list of strings (each
                item is a list of pieces, one per prompt) or, without a
                preprocessor, token ids `{"token_ids", "padding_mask"}`
                (each item is a list of new-id arrays).
            max_length, stop_token_ids, max_new_tokens, truncate: as in
                `generate`.
            stop: strings that end the text before them.
            sampler: a KerasHub sampler (or name) for this call.
            chunk_size: decoding steps per compiled call.

        Example:

        ```python
        for piece in lm.generate_stream("The cell", max_new_tokens=16):
            print(piece, end="", flush=True)
        ```
        """
        self.check_tokenizer()
        return generation_stream.generate_stream(
            self,
            inputs,
            max_length=max_length,
            stop_token_ids=stop_token_ids,
            max_new_tokens=max_new_tokens,
            truncate=truncate,
            stop=stop,
            sampler=sampler,
            chunk_size=chunk_size,
        )

    def export(
        self,
        filepath,
        format="tf_saved_model",
        verbose=None,
        overwrite=False,
        include_text_endpoints=None,
        **kwargs,
    ):
        """Exports a TF SavedModel with `serve`, `score` and `generate`
        endpoints on token ids and, with a tokenizer, `generate_text` and
        `score_text` on strings; works from every backend. See
        `keras_mhf.export`. Other formats go to `keras.Model.export`."""
        if format != "tf_saved_model" or kwargs:
            return super().export(
                filepath, format=format, verbose=verbose, **kwargs
            )
        from keras_mhf.export import export_causal_lm

        return export_causal_lm(
            self,
            filepath,
            overwrite=overwrite,
            include_text_endpoints=include_text_endpoints,
            verbose=bool(verbose),
        )

    def export_to_transformers(
        self, path, overwrite=False, max_position_embeddings=32768
    ):
        """Writes a Hugging Face checkpoint directory (atomic; a quantized
        model, or an existing `path` without `overwrite`, is refused):
        MultiHashFormer in the authors' format (their code and
        `MultiHashFormerCausalLM.from_preset(path)` load it), Standard as a
        stock `Qwen3ForCausalLM`; `config.json`, `model.safetensors`,
        `generation_config.json` and the tokenizer's files. See
        `keras_mhf.export.transformers.hf_exporter`.

        Example:

        ```python
        lm.export_to_transformers("exported_hf")
        ```
        """
        from keras_mhf.export.transformers import hf_exporter

        return hf_exporter.export_causal_lm(
            self, path, overwrite, max_position_embeddings
        )

    def get_compile_config(self):
        """Keras' compile config plus the sampler, so `.keras` loading
        restores the compile state (and the optimizer's variables) instead
        of warning and recompiling with defaults."""
        config = super().get_compile_config()
        if config and getattr(self, "sampler", None) is not None:
            config["sampler"] = keras_hub.samplers.serialize(self.sampler)
        if config and getattr(self, "optimizer", None) is not None:
            # Build the restored optimizer only if this one was built, so its
            # saved variables (none, or all of them) load without a warning.
            config["optimizer_built"] = bool(self.optimizer.built)
        return config

    def build_default_objectives(self, y_true, y_pred):
        """Builds the compiled loss and metrics for targets and predictions
        shaped like the `keras.KerasTensor`s `y_true` and `y_pred`; called by
        `compile` with the default loss and metrics. Otherwise Keras builds
        them at the first training step by running the model on the whole
        first batch with `training=False`: on PyTorch, whose
        `compute_output_spec` falls back to real tensors for KerasHub's
        attention, that is a full forward pass with the unfused head
        (MultiHashFormer's `[b, s, H, B]` logits, 2 GiB at 8,192 tokens with
        H4 B16384, kept by reference cycles until Python's collector runs)."""
        if not all(layer.built for layer in flatten_layers(self)):
            return  # Keras builds the model and its objectives on a batch
        for objective in (self._compile_loss, self._compile_metrics):
            if objective is not None and not objective.built:
                objective.build(y_true, y_pred)

    def compile_from_config(self, config):
        """Recompiles from `get_compile_config` (used by `.keras` loading)."""
        config = dict(config)
        sampler = config.pop("sampler", "top_k")
        optimizer_built = config.pop("optimizer_built", True)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(sampler=keras_hub.samplers.get(sampler), **config)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and optimizer_built and self.built:
            optimizer.build(self.trainable_variables)
