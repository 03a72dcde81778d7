"""Converts a Hugging Face checkpoint of the authors' MultiHashFormer code
(GitHub HUIYINXUE/MHF) into a `MultiHashFormerCausalLM`.

Format (the authors' `Qwen3HashFormer`): `config.json` with the Qwen3 fields plus `num_hashes`,
`num_buckets`, `num_lsh` (LSH heads of their ablation, default 0),
`bottle_neck_dim`, `pad_token_id`; and
`model.safetensors` (or a sharded `model.safetensors.index.json`). Only
safetensors are read, never pickle. The stock Qwen3 blocks are ported with
KerasHub's own converter (`keras_hub.src.utils.transformers.convert_qwen3`).
"""

import json
import os

import numpy as np
import safetensors

from keras_mhf.export.transformers import weight_names
from keras_mhf.export.transformers.sentencepiece_tokenizer_files import (
    checkpoint_tokenizer,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_vocabulary import (
    tokenization_fingerprint,
)
from keras_mhf.signatures.signature_table import SignatureTable
from keras_mhf.signatures.signature_table import check_bucket_ids
from keras_mhf.utils.keras_private import SafetensorLoader
from keras_mhf.utils.keras_private import convert_qwen3

_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rms_norm_eps",
    "vocab_size",
    "num_hashes",
    "num_buckets",
    "bottle_neck_dim",
)


def checkpoint_config(preset):
    """`(config, readable)` of a local directory's `config.json`: the parsed
    JSON (or `None`: no such file, or not JSON) and whether it parsed."""
    path = os.path.join(str(preset), "config.json")
    if not os.path.isdir(str(preset)) or not os.path.exists(path):
        return None, False
    try:
        with open(path) as f:
            return json.load(f), True
    except (OSError, ValueError):
        return None, False


# Top-level `config.json` fields that only a MultiHashFormer checkpoint has
# (a KerasHub preset nests its arguments under "config").
_MULTI_HASH_FORMER_FIELDS = ("num_hashes", "num_buckets", "bottle_neck_dim")
_MULTI_HASH_FORMER_TYPES = ("multi_hash_former",)


def is_multi_hash_former_config(config):
    """True for a Hugging Face `config.json` (a dict) of a MultiHashFormer:
    one of its own fields, its `model_type` or an architecture named
    `*HashFormer*`, so that one with a field removed is reported by
    `read_config` as missing that field."""
    if not isinstance(config, dict):
        return False
    architectures = config.get("architectures") or []
    return (
        any(key in config for key in _MULTI_HASH_FORMER_FIELDS)
        or config.get("model_type") in _MULTI_HASH_FORMER_TYPES
        or any("HashFormer" in str(name) for name in architectures)
    )


def is_authors_checkpoint(preset):
    """True for a local directory whose `config.json` is a MultiHashFormer's
    (`is_multi_hash_former_config`)."""
    config, readable = checkpoint_config(preset)
    if config is None and not readable:
        if not os.path.exists(os.path.join(str(preset), "config.json")):
            return False
        # A KerasHub preset's config.json is valid JSON; anything else that
        # names itself like an HF checkpoint is reported by `read_config`.
        return os.path.exists(
            os.path.join(str(preset), "model.safetensors")
        ) or (os.path.exists(os.path.join(str(preset), "pytorch_model.bin")))
    return is_multi_hash_former_config(config)


def read_config(directory):
    """Reads and validates `config.json`; returns the backbone kwargs."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    missing = [key for key in _REQUIRED if key not in config]
    if missing:
        raise ValueError(
            f"{path} is a MultiHashFormer checkpoint's config but is missing "
            f"required field(s): {missing}. Restore them (a keras_mhf export "
            "writes them all), or export the preset again."
        )
    num_lsh = config.get("num_lsh") or 0
    if (
        isinstance(num_lsh, bool)
        or not isinstance(num_lsh, int)
        or not 0 <= num_lsh <= config["num_hashes"]
    ):
        raise ValueError(
            f"{path}: num_lsh must be an integer from 0 to num_hashes="
            f"{config['num_hashes']}; got {num_lsh!r}."
        )
    if config.get("lsh_only_embed"):
        raise ValueError(
            f"{path} has lsh_only_embed=true (the encoder reads only the LSH "
            "heads), which no released model uses and keras_mhf does not "
            "implement."
        )
    rope = config.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 1_000_000))
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "linear"):
        raise ValueError(
            f"{path}: rope_parameters.rope_type={rope_type!r} is not "
            "supported; only 'default' and 'linear'."
        )
    # keras_mhf's own exports record the rule their table was built with;
    # the authors' checkpoints use theirs ("reference").
    signature_rule = config.get("signature_rule", "reference")
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kwargs = dict(
        vocabulary_size=config["vocab_size"],
        num_hashes=config["num_hashes"],
        num_buckets=config["num_buckets"],
        num_layers=config["num_hidden_layers"],
        num_query_heads=heads,
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or hidden // heads,
        hidden_dim=hidden,
        intermediate_dim=config["intermediate_size"],
        gate_dim=config["bottle_neck_dim"],
        mixer_dim=config["bottle_neck_dim"],
        rope_max_wavelength=rope_theta,
        rope_scaling_factor=float(rope.get("factor", 1.0))
        if rope_type == "linear"
        else 1.0,
        layer_norm_epsilon=config["rms_norm_eps"],
        pad_token_id=config.get("pad_token_id"),
        signature_rule=signature_rule,
        num_lsh=num_lsh,
    )
    for key, value in kwargs.items():
        if key not in (
            "pad_token_id",
            "signature_rule",
            "rope_max_wavelength",
            "rope_scaling_factor",
            "layer_norm_epsilon",
            "num_lsh",
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{path}: {key} must be a positive integer; got {value!r}."
                )
    return kwargs


class _CheckedLoader(SafetensorLoader):
    """SafetensorLoader that is strict about what it reads.

    Errors name the file, the key and the expected shape; a corrupt or
    truncated file is reported as such (not as a missing key); weights must be
    floating point (the signature table `hash_map` an integer); and
    `check_all_used` refuses tensors that the config does not account for
    (e.g. a `config.json` with fewer layers than the file holds).
    """

    def __init__(self, preset, prefix=None, fname=None):
        super().__init__(preset, prefix=prefix, fname=fname)
        self.used = set()  # (file name, key) of every tensor read

    def _open(self, fname):
        if fname not in self.safetensor_files:
            path = os.path.join(self.preset, fname)
            if not os.path.exists(path):
                raise ValueError(
                    f"The checkpoint in {self.preset} lists {fname}, which "
                    "does not exist."
                )
            try:
                handle = safetensors.safe_open(path, framework="np")
                handle = self.enter_context(handle)
                keys = list(handle.keys())
            except Exception as error:  # safetensors raises its own types
                raise ValueError(
                    f"{path} is corrupt or truncated: it cannot be read as "
                    f"safetensors ({type(error).__name__}: {error}). "
                    "Download or convert the checkpoint again."
                ) from error
            self.safetensor_files[fname] = handle
            self._keys = getattr(self, "_keys", {})
            self._keys[fname] = keys
        return self.safetensor_files[fname]

    def _file_names(self):
        if self.safetensor_config is None:
            return [self.fname or "model.safetensors"]
        return sorted(set(self.safetensor_config["weight_map"].values()))

    def get_tensor(self, hf_weight_key):
        for fname in self._file_names():
            handle = self._open(fname)
            full_key = self.get_prefixed_key(hf_weight_key, handle)
            if full_key in self._keys[fname]:
                try:
                    tensor = handle.get_tensor(full_key)
                except Exception as error:
                    raise ValueError(
                        f"{os.path.join(self.preset, fname)} is corrupt or "
                        f"truncated: tensor '{full_key}' cannot be read "
                        f"({type(error).__name__}: {error})."
                    ) from error
                self.used.add((fname, full_key))
                return tensor
        raise ValueError(
            f"The checkpoint in {self.preset} has no tensor "
            f"'{hf_weight_key}' (with or without the 'model.' prefix)."
        )

    def float_tensor(self, hf_weight_key):
        """A weight: must hold floating-point values."""
        tensor = self.get_tensor(hf_weight_key)
        # bfloat16 (ml_dtypes; the authors train and release in bf16) is not
        # a numpy floating type.
        if not (
            np.issubdtype(tensor.dtype, np.floating)
            or str(tensor.dtype) == "bfloat16"
        ):
            raise ValueError(
                f"Tensor '{hf_weight_key}' has dtype {tensor.dtype}; weights "
                "must be floating point. The checkpoint is not a "
                "MultiHashFormer checkpoint of the authors' code."
            )
        return tensor

    def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
        tensor = self.float_tensor(hf_weight_key)
        expected = tuple(keras_variable.shape)
        try:
            converted = hook_fn(tensor, list(expected)) if hook_fn else tensor
        except ValueError as error:
            converted = None
            reason = str(error)
        if converted is None or tuple(converted.shape) != expected:
            got = (
                f"which cannot be converted ({reason})"
                if converted is None
                else f"which converts to {tuple(converted.shape)}"
            )
            raise ValueError(
                f"Tensor '{hf_weight_key}' has shape {tuple(tensor.shape)}, "
                f"{got}, not the Keras variable's {expected}: the tensor is "
                "stored transposed or with other sizes than config.json "
                "says. The checkpoint does not match its config.json."
            )
        keras_variable.assign(np.asarray(converted, dtype="float32"))

    def read(self, hf_weight_key, expected_shape):
        tensor = self.get_tensor(hf_weight_key)
        if tuple(tensor.shape) != tuple(expected_shape):
            raise ValueError(
                f"Tensor '{hf_weight_key}' has shape {tuple(tensor.shape)}; "
                f"expected {tuple(expected_shape)} from config.json."
            )
        return tensor

    def check_all_used(self):
        """Refuses tensors that were not read: the config does not describe
        the file (e.g. it names fewer layers than the file holds)."""
        unused = []
        for fname in self._file_names():
            self._open(fname)
            unused += [
                key
                for key in self._keys[fname]
                if (fname, key) not in self.used and not _ignorable(key)
            ]
        unused.sort()
        if unused:
            raise ValueError(
                f"The checkpoint in {self.preset} holds {len(unused)} "
                "tensor(s) that its config.json does not account for, e.g. "
                f"{unused[:5]}. config.json and model.safetensors do not "
                "belong together (a different number of layers or heads?)."
            )


def _ignorable(key):
    """Tensors of the authors' files that carry no weight of their own:
    `lm_head.weight` is tied to `embed_tokens.weight`, rotary caches are
    recomputed."""
    return key.endswith(("lm_head.weight", "rotary_emb.inv_freq"))


class _Sink:
    """Stands in for Qwen3's token embedding, which MHF does not have."""

    def __init__(self, shape):
        self.shape = shape

    def assign(self, value):
        pass


class _TrunkView:
    """What KerasHub's Qwen3 converter expects of a backbone."""

    def __init__(self, backbone):
        self._backbone = backbone
        self.num_layers = backbone.num_layers
        self.tie_word_embeddings = True
        self._embedding = type(
            "Embedding",
            (),
            {
                "embeddings": _Sink(
                    (
                        backbone.num_hashes * backbone.num_buckets,
                        backbone.hidden_dim,
                    )
                )
            },
        )()

    def get_layer(self, name):
        if name == "token_embedding":
            return self._embedding
        return self._backbone.get_layer(name)


def _check_weight_files(directory):
    names = set(os.listdir(directory))
    if "model.safetensors" in names or "model.safetensors.index.json" in names:
        return
    pickles = sorted(
        n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt"))
    )
    if pickles:
        raise ValueError(
            f"{directory} holds only pickle weights ({pickles}); keras_mhf "
            "reads safetensors only, since unpickling can run arbitrary code. "
            "Convert once, in a trusted PyTorch environment: `from "
            "transformers import AutoModelForCausalLM; "
            "AutoModelForCausalLM.from_pretrained(dir, "
            "trust_remote_code=True).save_pretrained(dir, "
            "safe_serialization=True)` (or "
            "`safetensors.torch.save_file(torch.load(f), "
            "'model.safetensors')`)."
        )
    raise ValueError(f"{directory} has no model.safetensors.")


def load_authors_checkpoint(
    task_cls,
    directory,
    load_weights=True,
    tokenizer=None,
    dtype=None,
    sequence_length=1024,
):
    """Builds a `task_cls` (`MultiHashFormerCausalLM`) from the authors' HF
    checkpoint, with `task_cls.backbone_cls` and `task_cls.preprocessor_cls`
    (the way KerasHub's converters build from the task's classes).

    Args:
        task_cls: the causal-LM class to build.
        directory: local checkpoint directory.
        load_weights: whether to read the weights.
        tokenizer: a `MultiHashFormerTokenizer`, or a path to a SentencePiece
            `.model`; defaults to `tokenizer.model` in the directory if there
            is one. It is checked against the checkpoint's `hash_map`.
        dtype: dtype policy.
        sequence_length: the preprocessor's packed length.
    """
    preprocessor_cls = task_cls.preprocessor_cls
    tokenizer_cls = preprocessor_cls.tokenizer_cls
    directory = str(directory)
    kwargs = read_config(directory)
    _check_weight_files(directory)
    vocabulary_size, num_hashes = (
        kwargs["vocabulary_size"],
        kwargs["num_hashes"],
    )
    num_buckets, hidden = kwargs["num_buckets"], kwargs["hidden_dim"]
    with _CheckedLoader(directory) as loader:
        hash_map = loader.read(
            weight_names.HASH_MAP, (vocabulary_size, num_hashes)
        )
        if not np.issubdtype(hash_map.dtype, np.integer):
            raise ValueError(
                f"Tensor 'model.hash_map' has dtype {hash_map.dtype}; the "
                "signature table must hold integer bucket ids."
            )
        check_bucket_ids(
            "Tensor 'model.hash_map' (num_buckets in config.json)",
            hash_map,
            num_buckets,
        )
        table = SignatureTable(
            hash_map,
            num_buckets,
            kwargs["pad_token_id"],
            kwargs["signature_rule"],
            num_lsh=kwargs["num_lsh"],
        )

        tokenizer = checkpoint_tokenizer(directory, tokenizer, tokenizer_cls)

        backbone = task_cls.backbone_cls(
            signatures=table,
            dtype=dtype,
            # The tokenizer used here becomes the model's (check_tokenizer).
            tokenization_fingerprint=(
                None
                if tokenizer is None
                else tokenization_fingerprint(tokenizer)
            ),
            **kwargs,
        )
        preprocessor = (
            preprocessor_cls(tokenizer, sequence_length=sequence_length)
            if tokenizer is not None
            else None
        )
        model = task_cls(backbone, preprocessor, **_task_kwargs(directory))
        if load_weights:
            _port_weights(loader, model, num_hashes, num_buckets, hidden)
            loader.check_all_used()
    model.check_tokenizer(force=True)
    return model


def _task_kwargs(directory):
    """The task settings a keras_mhf export records in `config.json`
    (`scoring_temperature`); the authors' checkpoints have none."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    kwargs = {}
    if "scoring_temperature" in config:
        kwargs["scoring_temperature"] = config["scoring_temperature"]
    return kwargs


def _port_weights(loader, model, num_hashes, num_buckets, hidden):
    backbone = model.backbone
    encoder = backbone.hash_encoder

    def transpose(tensor, _):
        return np.transpose(tensor)

    # `embed_tokens.weight` is [H * B, d] (or [H, B, d]): rows i*B..(i+1)*B-1
    # are E(i). Read once, split over the per-head variables.
    shape = (num_hashes * num_buckets, hidden)
    stacked = loader.float_tensor(weight_names.EMBED_TOKENS)
    if tuple(stacked.shape) not in (shape, (num_hashes, num_buckets, hidden)):
        loader.read(
            "embed_tokens.weight", shape
        )  # raises, naming the expected shape
    stacked = np.reshape(stacked, (num_hashes, num_buckets, hidden))
    for i, table in enumerate(encoder.embeddings):
        table.assign(np.asarray(stacked[i], dtype="float32"))
    for dense, key in weight_names.encoder_denses(
        encoder
    ) + weight_names.mixer_denses(model.hash_decoder):
        loader.port_weight(dense.kernel, f"{key}.weight", transpose)
        loader.port_weight(dense.bias, f"{key}.bias")
    # Stock Qwen3 blocks and the final norm, with KerasHub's converter.
    convert_qwen3.convert_weights(_TrunkView(backbone), loader, None)


# Public names for the other Hugging Face readers
# (`keras_mhf.export.transformers.convert_qwen3`).
CheckedLoader = _CheckedLoader
check_weight_files = _check_weight_files
