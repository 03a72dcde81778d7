"""A MultiHashFormer for stock Hugging Face `transformers` (PyTorch).

`export_to_transformers` copies this file into every MultiHashFormer export
and names it in `config.json`'s `auto_map`, so that with `transformers`
alone (no keras_mhf, no authors' repository):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = tokenizer("The cell", return_tensors="pt").input_ids
model(ids).logits  # [b, s, V] vocabulary log-probs, the paper's rule
model.generate(ids, max_new_tokens=8)  # greedy, sampling, KV cache
```

`logits` are the log-probs of the real vocabulary under the paper's rule
(`log_softmax_V(sum_i log p_i(h_i(w)))`, Sec. 3.3-3.4), equal to the Keras
model's `score()` at `scoring_temperature=1`. A model calibrated in
keras_mhf records its temperature in `config.scoring_temperature`; load with
`apply_scoring_temperature=True` (a `from_pretrained` keyword) to get the
calibrated log-probs `log_softmax_V(s(w) / T)` instead.

Written here from the paper's equations and keras_mhf's layers (not copied
from the authors' code); the tensor names and config fields are the
authors' format (`model.hash_map`, `model.embed_tokens.weight` = the H
stacked bucket tables, `model.combiner.*`, `hash_head.cascade_mixer.*`),
so their code loads the same folder. This one file holds the config and
the model classes, so the folder needs no other code.

It runs on transformers `MIN_TRANSFORMERS` and later (4.x and 5.x), finding
what changed between releases from their classes, and refuses an older
release at import with an `ImportError` that names both versions.
"""

import copy
import dataclasses
import inspect

import torch
import transformers
from packaging.version import Version
from torch import nn

# The oldest transformers release this file is checked on (keras_mhf's
# benchmarks/check_transformers_versions.py): Qwen3 arrived in 4.51.0, whose
# `from_pretrained` fails without accelerate installed (fixed in 4.51.1).
MIN_TRANSFORMERS = "4.51.1"


def check_transformers_version(installed=None):
    """Raises `ImportError` naming the installed version and the minimum
    when `transformers` is older than `MIN_TRANSFORMERS`."""
    installed = transformers.__version__ if installed is None else installed
    if Version(installed) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            "This MultiHashFormer export (modeling_multi_hash_former.py) "
            f"needs transformers >= {MIN_TRANSFORMERS}; transformers "
            f"{installed} is installed. Upgrade with: pip install "
            f"'transformers>={MIN_TRANSFORMERS}'"
        )


check_transformers_version()

from transformers import GenerationMixin  # noqa: E402
from transformers import Qwen3Config  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3Model  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel  # noqa: E402

# What differs between the supported releases, found from the classes
# themselves rather than from version numbers:
# - the KV cache's name, as the trunk's `forward` argument and as the output
#   field (`past_key_values` until it became `cache` in 5.x);
# - how RoPE is configured: one `rope_parameters` dict (5.x), or
#   `rope_theta` and `rope_scaling` (4.x).
TRUNK_CACHE_ARGUMENT = (
    "cache"
    if "cache" in inspect.signature(Qwen3Model.forward).parameters
    else "past_key_values"
)
OUTPUT_CACHE_FIELD = (
    "cache"
    if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    else "past_key_values"
)
HAS_ROPE_PARAMETERS = (
    "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters
)


def output_cache(outputs):
    """The KV cache of the trunk's output, under whichever name its class
    gives it (`None` when it holds none)."""
    for name in ("cache", "past_key_values"):
        if name in {f.name for f in dataclasses.fields(outputs)}:
            return getattr(outputs, name)
    return None


def legacy_rope_fields(rope_parameters):
    """A `rope_parameters` dict (the format of the export's `config.json`)
    -> the `rope_theta` and `rope_scaling` of a 4.x `Qwen3Config`."""
    parameters = dict(rope_parameters)
    fields = {}
    if "rope_theta" in parameters:
        fields["rope_theta"] = parameters.pop("rope_theta")
    if parameters.get("rope_type", "default") != "default":
        fields["rope_scaling"] = parameters
    return fields


class MultiHashFormerConfig(Qwen3Config):
    """Qwen3's configuration plus the MultiHashFormer fields: `num_hashes`
    (H), `num_buckets` (B, bucket 0 included), `bottle_neck_dim` (the gate
    scorer's and the mixers' width), `num_lsh`, `signature_rule`,
    `scoring_temperature` (keras_mhf's calibration) and
    `apply_scoring_temperature` (whether `logits` use it; default: the
    paper's rule). `use_conditional_prob`, `lsh_only_embed` and
    `fused_decoding` are the authors' fields, kept for their code."""

    model_type = "multi_hash_former"

    def __init__(
        self,
        num_hashes=4,
        num_buckets=16384,
        bottle_neck_dim=64,
        num_lsh=0,
        use_conditional_prob=True,
        lsh_only_embed=False,
        fused_decoding=False,
        signature_rule="unique",
        scoring_temperature=1.0,
        apply_scoring_temperature=False,
        **kwargs,
    ):
        self.num_hashes = num_hashes
        self.num_buckets = num_buckets
        self.bottle_neck_dim = bottle_neck_dim
        self.num_lsh = num_lsh
        self.use_conditional_prob = use_conditional_prob
        self.lsh_only_embed = lsh_only_embed
        self.fused_decoding = fused_decoding
        self.signature_rule = signature_rule
        self.scoring_temperature = scoring_temperature
        self.apply_scoring_temperature = apply_scoring_temperature
        rope_parameters = kwargs.get("rope_parameters")
        if not HAS_ROPE_PARAMETERS and isinstance(rope_parameters, dict):
            kwargs.pop("rope_parameters")
            kwargs.update(legacy_rope_fields(rope_parameters))
        super().__init__(**kwargs)


class MultiHashCombiner(nn.Module):
    """The gated compositional embedding (paper Sec. 3.1, eq. 2-3): for a
    token's H bucket vectors `u_i`, `a_i = w2 . silu(W1 u_i + b1) + b2`,
    `alpha = softmax_i(a_i)` (float32) and `e = Ws (sum_i alpha_i u_i) +
    bs`."""

    def __init__(self, config):
        super().__init__()
        d, g = config.hidden_size, config.bottle_neck_dim
        self.scorer = nn.Sequential(nn.Linear(d, g), nn.SiLU(), nn.Linear(g, 1))
        self.output_proj = nn.Sequential(nn.Linear(d, d))

    def forward(self, vectors):
        scores = self.scorer(vectors).squeeze(-1)
        alpha = torch.softmax(scores.float(), dim=-1).to(vectors.dtype)
        mixed = (vectors * alpha.unsqueeze(-1)).sum(dim=-2)
        return self.output_proj(mixed)


class CascadeHashHead(nn.Module):
    """The cascaded hash decoder (paper Sec. 3.3), tied to the bucket
    tables: with `c_1 = h`, head i's logits are `o_i = c_i E(i)^T`; for
    `i < H`, `s_i = softmax(o_i) E(i)` and `c_{i+1} = c_i + mixer_i([c_i ;
    s_i])`, a mixer being `Linear(2d, m), SiLU, Linear(m, d)`."""

    def __init__(self, config):
        super().__init__()
        d, m = config.hidden_size, config.bottle_neck_dim
        self.cascade_mixer = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * d, m), nn.SiLU(), nn.Linear(m, d))
            for _ in range(config.num_hashes - 1)
        )

    def forward(self, hidden_states, tables):
        """`[..., d]` and the tables `[H, B, d]` -> the H heads' bucket
        log-probs, each `[..., B]` (float32)."""
        state = hidden_states
        log_probs = []
        for i, table in enumerate(tables):
            logits = state @ table.T
            log_probs.append(torch.log_softmax(logits.float(), dim=-1))
            if i == len(tables) - 1:
                break
            probs = torch.softmax(logits.float(), dim=-1).to(state.dtype)
            soft = probs @ table
            state = state + self.cascade_mixer[i](torch.cat([state, soft], -1))
        return log_probs


class MultiHashFormerForCausalLM(Qwen3PreTrainedModel, GenerationMixin):
    """A MultiHashFormer causal LM: the Qwen3 trunk (`model`), whose
    `embed_tokens` holds the H stacked bucket tables `[H * B, d]` and which
    also holds the signature table `hash_map [V, H]` and the `combiner`,
    and the cascaded head (`hash_head`). `forward` returns vocabulary
    log-probs as `logits` (see the module docstring); `labels` give the
    mean next-token negative log-likelihood as `loss`."""

    config_class = MultiHashFormerConfig
    _tied_weights_keys = {}

    def __init__(self, config):
        super().__init__(config)
        trunk = copy.deepcopy(config)
        # The trunk's embedding is the stacked bucket tables.
        trunk.vocab_size = config.num_hashes * config.num_buckets
        trunk.pad_token_id = None
        self.model = Qwen3Model(trunk)
        self.model.register_buffer(
            "hash_map",
            torch.zeros(
                (config.vocab_size, config.num_hashes), dtype=torch.long
            ),
            persistent=True,
        )
        self.model.combiner = MultiHashCombiner(config)
        self.hash_head = CascadeHashHead(config)
        self.vocab_size = config.vocab_size
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def bucket_tables(self):
        """The H bucket tables `[H, B, d]` (a view of `embed_tokens`)."""
        weight = self.model.embed_tokens.weight
        return weight.view(self.config.num_hashes, self.config.num_buckets, -1)

    def embed(self, input_ids):
        """Token ids `[b, s]` -> input embeddings `[b, s, d]` (Sec. 3.1)."""
        signatures = self.model.hash_map[input_ids]
        offsets = (
            torch.arange(self.config.num_hashes, device=signatures.device)
            * self.config.num_buckets
        )
        return self.model.combiner(
            self.model.embed_tokens(signatures + offsets)
        )

    def vocabulary_log_probs(self, hidden_states):
        """Final hidden states `[..., d]` -> `[..., V]` float32 log-probs:
        `log_softmax_V(s(w) / T)`, `s(w) = sum_i log p_i(h_i(w))` (T = 1,
        the paper's rule, unless `config.apply_scoring_temperature`)."""
        log_probs = self.hash_head(hidden_states, self.bucket_tables())
        scores = sum(
            head.index_select(-1, self.model.hash_map[:, i])
            for i, head in enumerate(log_probs)
        )
        if self.config.apply_scoring_temperature:
            scores = scores / float(self.config.scoring_temperature)
        return torch.log_softmax(scores, dim=-1)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        # `generate` passes the KV cache as `cache` or `past_key_values`
        # (by release); the trunk takes it under its own name.
        legacy_cache = kwargs.pop("past_key_values", None)
        if cache is None:
            cache = legacy_cache
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        outputs = self.model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **{TRUNK_CACHE_ARGUMENT: cache},
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:]
        elif not isinstance(logits_to_keep, int):
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.vocabulary_log_probs(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits,
                labels=labels,
                vocab_size=self.config.vocab_size,
                **kwargs,
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{OUTPUT_CACHE_FIELD: output_cache(outputs)},
        )
