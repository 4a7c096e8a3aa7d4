"""Model architecture: the built-in presets and Hugging Face `config.json` parsing.

Every shape the engine runs is a `ModelConfig`. Presets give the shapes of real models (for
dummy-weight performance work) and small ones for tests; `from_hf_config` reads a local
checkpoint's config and refuses, by name, anything the engine does not implement.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from models.files import SETTINGS, UserFileError, read_input_text
from models.hf_quantized import QuantizedCheckpointError, parse_quantization_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
#: config.json's model_type -> its architecture, for a config without `architectures`
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
#: the MLP's activation, under Hugging Face's names: SiLU, and GELU's tanh approximation (GeGLU)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: q/k norms before RoPE: none; per head over head_dim (Qwen3); over all heads (OLMoE)
QK_NORMS = ("none", "head", "full")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn")
#: The largest value each size may take: past every released model (vocabularies to ~256K,
#: hidden sizes to ~25K, ~126 layers, contexts to ~10M positions), and small enough that a
#: slip (max_position_embeddings 1e12) is refused before the engine sizes a buffer by it.
SIZE_LIMITS = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_layers": 1 << 12,
    "num_heads": 1 << 12,
    "num_kv_heads": 1 << 12,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 24,
}
#: the mixture-of-experts sizes (0: none) and their largest values
MOE_LIMITS = {
    "num_experts": 1 << 12,
    "num_experts_per_tok": 1 << 12,
    "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20,
}
#: The rope_scaling parameters the rotary embedding reads, per rope_type.
ROPE_PARAMETERS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    # dynamic NTK: the original context is the checkpoint's max_position_embeddings, which
    # the reader copies here (positions go on to factor x it)
    "dynamic": ("factor", "original_max_position_embeddings"),
}
#: yarn's optional parameters (Hugging Face's defaults when absent)
YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


#: the defaults of the fields only some families set
_FAMILY_DEFAULTS: dict[str, Any] = {
    "qk_norm": "none",
    **dict.fromkeys(MOE_LIMITS, 0),
    "norm_topk_prob": False,
    "dense_layers": (),
    "hidden_act": "silu",
    "norm_weight_offset": 0.0,
    "sandwich_norms": False,
    "embedding_multiplier": 1.0,
    "query_pre_attn_scalar": None,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "full_attention_layers": (),
    "local_rope_theta": None,
}


class ModelFieldError(ValueError):
    """A ModelConfig field's value the engine cannot run; `field`, `value` and `reason` let a
    caller say it in the terms of the file the value came from."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"model.{field}: {self.shown} is invalid; {reason}")

    @property
    def shown(self) -> str:
        """The value as the error shows it: its repr, cut short (a 400-digit rope_theta)."""
        try:
            text = repr(self.value)
        except ValueError:  # an integer past Python's limit for printing one
            return "an integer of more than 4300 digits"
        return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range
        return False


def check_size(name: str, value: Any) -> int:
    """`value` of the size field `name`: an integer in [1, SIZE_LIMITS[name]]."""
    limit = SIZE_LIMITS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ModelFieldError(name, value, f"allowed: an integer in [1, {limit}]")
    return value


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_model_fields(values: Mapping[str, Any]) -> None:
    """Every rule a ModelConfig's values must meet (ModelFieldError names the first field that
    breaks one): sizes are integers in [1, SIZE_LIMITS], that divide where the model splits
    them; the norm's epsilon and rope's parameters finite numbers > 0; flags booleans."""
    if values["architecture"] not in SUPPORTED_ARCHITECTURES:
        raise ModelFieldError(
            "architecture", values["architecture"], f"allowed: {'|'.join(SUPPORTED_ARCHITECTURES)}"
        )
    for name in SIZE_LIMITS:
        check_size(name, values[name])
    if values["num_heads"] % values["num_kv_heads"]:
        raise ModelFieldError(
            "num_kv_heads",
            values["num_kv_heads"],
            f"it must divide the number of attention heads ({values['num_heads']})",
        )
    _check_moe_fields(values)
    _check_gemma_fields(values)
    if values["head_dim"] % 2:
        raise ModelFieldError("head_dim", values["head_dim"], "rotary embeddings need an even one")
    for name in ("rms_norm_eps", "rope_theta"):
        if not _is_number(values[name]) or values[name] <= 0:
            raise ModelFieldError(name, values[name], "allowed: a finite number > 0")
    for name in ("attention_bias", "tie_word_embeddings"):
        if not isinstance(values[name], bool):
            raise ModelFieldError(name, values[name], "allowed: true|false")
    window, longest = values["sliding_window"], SIZE_LIMITS["max_position_embeddings"]
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= longest
    ):
        raise ModelFieldError(
            "sliding_window", window, f"allowed: null or an integer in [1, {longest}]"
        )
    if values["bos_token_id"] is not None and not _is_token_id(values["bos_token_id"]):
        raise ModelFieldError(
            "bos_token_id", values["bos_token_id"], "allowed: null or an integer >= 0"
        )
    eos = values["eos_token_ids"]
    if not isinstance(eos, tuple) or not all(_is_token_id(i) for i in eos):
        raise ModelFieldError("eos_token_ids", eos, "allowed: integers >= 0")
    _check_rope_scaling(values["rope_scaling"])


def _check_moe_fields(given: Mapping[str, Any]) -> None:
    values = {**_FAMILY_DEFAULTS, **given}  # a dense model's config.json has none of them
    if values["qk_norm"] not in QK_NORMS:
        raise ModelFieldError("qk_norm", values["qk_norm"], f"allowed: {'|'.join(QK_NORMS)}")
    for name, limit in MOE_LIMITS.items():
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise ModelFieldError(name, value, f"allowed: an integer in [0, {limit}]")
    experts, chosen = values["num_experts"], values["num_experts_per_tok"]
    if experts and not 1 <= chosen <= experts:
        raise ModelFieldError(
            "num_experts_per_tok", chosen, f"allowed: an integer in [1, num_experts={experts}]"
        )
    if not isinstance(values["norm_topk_prob"], bool):
        raise ModelFieldError("norm_topk_prob", values["norm_topk_prob"], "allowed: true|false")
    dense = values["dense_layers"]
    layers = values["num_layers"]
    if not isinstance(dense, tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense
    ):
        raise ModelFieldError("dense_layers", dense, f"allowed: layer indices in [0, {layers})")


def _check_gemma_fields(given: Mapping[str, Any]) -> None:
    """The fields Gemma 2/3 brought (any family may set them): activation, norm offset,
    sandwich norms, embedding scale, attention scale, soft caps, per-layer windows."""
    values = {**_FAMILY_DEFAULTS, **given}
    if values["hidden_act"] not in ACTIVATIONS:
        raise ModelFieldError(
            "hidden_act", values["hidden_act"], f"allowed: {'|'.join(ACTIVATIONS)}"
        )
    if values["norm_weight_offset"] not in (0.0, 1.0) or isinstance(
        values["norm_weight_offset"], bool
    ):
        raise ModelFieldError("norm_weight_offset", values["norm_weight_offset"], "allowed: 0|1")
    if not isinstance(values["sandwich_norms"], bool):
        raise ModelFieldError("sandwich_norms", values["sandwich_norms"], "allowed: true|false")
    positive = ("embedding_multiplier",)
    optional = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "local_rope_theta")  # fmt: skip
    for name in (*positive, *optional):
        value = values[name]
        if (value is None and name in optional) or (_is_number(value) and value > 0):
            continue
        allowed = "null or a finite number > 0" if name in optional else "a finite number > 0"
        raise ModelFieldError(name, value, f"allowed: {allowed}")
    scalar = values["query_pre_attn_scalar"]
    if scalar is not None and scalar < 1:  # its 1/sqrt scales the scores: 1e-320 makes them inf
        raise ModelFieldError(
            "query_pre_attn_scalar", scalar, "allowed: null or a number >= 1 (Gemma's: 144-256)"
        )
    full, layers = values["full_attention_layers"], values["num_layers"]
    if not isinstance(full, tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in full
    ):
        raise ModelFieldError(
            "full_attention_layers", full, f"allowed: layer indices in [0, {layers})"
        )
    if len(set(full)) != len(full):
        raise ModelFieldError("full_attention_layers", full, "allowed: distinct layer indices")
    if full and values["sliding_window"] is None:
        raise ModelFieldError(
            "full_attention_layers", full, "it needs a sliding_window for the other layers"
        )


def _check_rope_scaling(scaling: Any) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ModelFieldError("rope_scaling", scaling, "allowed: null or a mapping")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelFieldError(
            "rope_scaling",
            scaling,
            f"rope_type {rope_type!r} is not one of {'|'.join(SUPPORTED_ROPE_TYPES)}",
        )
    for key in ROPE_PARAMETERS.get(rope_type, ()):
        if not _is_number(scaling.get(key)) or scaling[key] <= 0:
            raise ModelFieldError(
                f"rope_scaling.{key}",
                scaling.get(key),
                f"allowed: a finite number > 0 ({rope_type} scaling needs it)",
            )
    for key in YARN_OPTIONAL if rope_type == "yarn" else ():
        value = scaling.get(key)
        if value is not None and (not _is_number(value) or value <= 0):
            raise ModelFieldError(
                f"rope_scaling.{key}", value, "allowed: null or a finite number > 0"
            )
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelFieldError(
            "rope_scaling.high_freq_factor",
            scaling["high_freq_factor"],
            f"it must be greater than low_freq_factor ({scaling['low_freq_factor']})",
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # Mistral semantics: attend to the last `window` keys
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    qk_norm: str = "none"  # RMSNorm of q and k before RoPE: one of QK_NORMS
    # mixture of experts: each MoE layer's MLP is `num_experts` MLPs of `moe_intermediate_size`
    # (0: intermediate_size), each token through the `num_experts_per_tok` its router scores
    # highest, weighted by the softmax of its scores over all experts (renormalized over the
    # chosen ones with `norm_topk_prob`), plus Qwen2-MoE's sigmoid-gated shared expert
    num_experts: int = 0  # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()  # the layers of an MoE model with a dense MLP
    # Gemma 2/3's additions (any family may use them)
    hidden_act: str = "silu"  # one of ACTIVATIONS: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma's 1
    sandwich_norms: bool = False  # also a norm after attention and after the MLP, before adds
    embedding_multiplier: float = 1.0  # embeddings x this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) (None: head_dim)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # the same on the LM head's logits
    # with a sliding_window, the layers that attend to the whole context (Gemma: every 2nd/6th)
    full_attention_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # the windowed layers' RoPE base (Gemma 3), unscaled

    def __post_init__(self) -> None:
        check_model_fields({f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def layer_window(self, index: int) -> int | None:
        """The sliding window layer `index` attends within (None: the whole context)."""
        return None if index in self.full_attention_layers else self.sliding_window

    @property
    def max_positions(self) -> int:
        """The positions the model can take: max_position_embeddings, which dynamic NTK
        scaling stretches by its factor (as vLLM derives its longest context)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "dynamic":
            return int(scaling["original_max_position_embeddings"] * float(scaling["factor"]))
        return self.max_position_embeddings

    @property
    def kv_sliding_window(self) -> int | None:
        """The window every layer keeps to, so that the KV cache may drop keys older than it
        (None where any layer attends to the whole context)."""
        return None if self.full_attention_layers else self.sliding_window

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index not in self.dense_layers

    def moe_mlp_parameters(self, active: bool = False) -> int:
        """One mixture-of-experts layer's MLP weights (all matmuls): its experts (`active`:
        those one token goes through), the router, the shared expert and its gate."""
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = self.shared_expert_intermediate_size
        return (
            experts * 3 * self.hidden_size * self.expert_intermediate_size
            + self.num_experts * self.hidden_size
            + 3 * self.hidden_size * shared
            + (self.hidden_size if shared else 0)
        )

    def num_parameters(self, active: bool = False) -> int:
        """Every weight; `active`: those one token's forward reads (its experts only)."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        attn += {"none": 0, "head": 2 * self.head_dim, "full": self.q_size + self.kv_size}[
            self.qk_norm
        ]
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        moe_mlp = self.moe_mlp_parameters(active)
        mlps = sum(moe_mlp if self.is_moe_layer(i) else dense_mlp for i in range(self.num_layers))
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        per_layer = attn + (4 if self.sandwich_norms else 2) * self.hidden_size
        return self.num_layers * per_layer + mlps + embed + head + self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, overrides: dict[str, Any] | None) -> ModelConfig:
        if not overrides:
            return self
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"model.overrides: unknown field(s) {unknown}; allowed: {sorted(known)}"
            )
        values = dict(overrides)
        for name in ("eos_token_ids", "dense_layers", "full_attention_layers"):
            if isinstance(values.get(name), list):  # other types: refused by the checks
                values[name] = tuple(values[name])
        return replace(self, **values)


def _llama(**kw: Any) -> ModelConfig:
    return ModelConfig(**kw)


_GEMMA2_FIELDS: dict[str, Any] = {
    "hidden_act": "gelu_pytorch_tanh",
    "norm_weight_offset": 1.0,
    "sandwich_norms": True,
    "query_pre_attn_scalar": 256.0,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}

PRESETS: dict[str, ModelConfig] = {
    # Tests: a few thousand parameters per layer; vocab covers the default tokenizer.
    "tiny": _llama(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
    ),
    # CPU experiments: ~110M parameters; the LM head is ~22% of the weights read per token.
    "small": _llama(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        head_dim=64,
        max_position_embeddings=2048,
    ),
    "tinyllama-1.1b": _llama(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama3-8b": _llama(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    # Llama 3 70B's shape (~70.6B parameters): the tensor-parallel planning preset (`inferlab
    # kv-calc`, docs/parallelism.md); in bf16 its weights alone (~131 GiB) exceed one 80 GB GPU.
    "llama3-70b": _llama(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    # Mixture of experts, for CPU runs: Qwen3-MoE's layout (per-head q/k norms, 8 experts, 2
    # per token, renormalized) at the tiny preset's size
    "tiny-moe": ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        qk_norm="head",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    # `small` with each MLP cut into 8 experts of half its width, 2 per token: the same active
    # parameters (the router's aside) in 4x the MLP weights; experiment=moe runs the two
    "small-moe": ModelConfig(
        architecture="MixtralForCausalLM",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=1024,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        head_dim=64,
        max_position_embeddings=2048,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    # Mixtral 8x7B's shape (~46.7B parameters, ~12.9B active): kv-calc and the roofline
    "mixtral-8x7b": ModelConfig(
        architecture="MixtralForCausalLM",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        bos_token_id=1,
        eos_token_ids=(2,),
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    # Qwen3-30B-A3B's shape (~30.5B parameters, ~3.3B active)
    "qwen3-30b-a3b": ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        eos_token_ids=(151645,),
        qk_norm="head",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # Gemma 2's layer on CPU: windowed layers 0 and 2, global 1 and 3, soft caps, sandwich norms
    "tiny-gemma2": ModelConfig(
        architecture="Gemma2ForCausalLM",
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=176,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        sliding_window=64,
        full_attention_layers=(1, 3),
        tie_word_embeddings=True,
        **_GEMMA2_FIELDS,
        embedding_multiplier=8.0,
    ),
    # Gemma-2-9B's shape (~9.2B parameters; windows of 4096 in every other layer)
    "gemma2-9b": ModelConfig(
        architecture="Gemma2ForCausalLM",
        vocab_size=256000,
        hidden_size=3584,
        intermediate_size=14336,
        num_layers=42,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        max_position_embeddings=8192,
        sliding_window=4096,
        full_attention_layers=tuple(range(1, 42, 2)),
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_ids=(1, 107),
        **_GEMMA2_FIELDS,
        embedding_multiplier=3584**0.5,
    ),
    # Gemma-3-12B's text shape (~11.8B parameters; five layers of 1024-token windows per global)
    "gemma3-12b": ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_layers=48,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=131072,
        sliding_window=1024,
        full_attention_layers=tuple(range(5, 48, 6)),
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_ids=(1, 106),
        qk_norm="head",
        hidden_act="gelu_pytorch_tanh",
        norm_weight_offset=1.0,
        sandwich_norms=True,
        query_pre_attn_scalar=256.0,
        local_rope_theta=10000.0,
        embedding_multiplier=3840**0.5,
    ),
    "mistral-7b": ModelConfig(
        architecture="MistralForCausalLM",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        sliding_window=4096,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}


class UnsupportedCheckpointError(ValueError):
    """The checkpoint asks for something the engine does not implement."""


#: ModelConfig fields under another name in config.json (the others keep theirs).
HF_KEYS = {
    "local_rope_theta": "rope_local_base_freq",
    "full_attention_layers": "layer_types",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "eos_token_ids": "eos_token_id",
}


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older versions write
    # `rope_theta` and `rope_scaling` side by side.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3): the global layers'
    if params is None:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
    elif not isinstance(params, dict):
        raise ModelFieldError("rope_parameters", params, "allowed: a mapping")
    else:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    partial = cfg.get("partial_rotary_factor", 1.0)
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        partial = scaling.pop("partial_rotary_factor", partial)
    if partial != 1.0:  # rotary embeddings over a part of each head only
        raise UnsupportedCheckpointError(
            f"config.json: partial_rotary_factor {partial!r} is not supported; allowed: 1.0"
        )
    if isinstance(scaling, dict):
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedCheckpointError(
                f"config.json: rope scaling type {rope_type!r} is not supported; "
                f"supported: {'|'.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "dynamic":  # transformers stretches max_position_embeddings
            scaling["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **scaling}
    return theta, scaling


def non_finite_number(value: Any, path: str = "") -> tuple[str, float] | None:
    """(where, value) of the first NaN or infinity in a JSON-like value (Python's json reads
    NaN and Infinity, and turns 1e999 into inf), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items: Any = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list | tuple)
        else ()
    )
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        if (found := non_finite_number(item, where)) is not None:
            return found
    return None


def from_hf_config(path: str | Path) -> ModelConfig:
    """Parse `path/config.json` (or a config.json file) of a Llama-family checkpoint."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.exists():
        raise FileNotFoundError(f"model.path: no config.json at {config_file}")
    where = str(config_file)
    try:
        cfg = json.loads(read_input_text(config_file, SETTINGS))
    except UserFileError as exc:  # not UTF-8, or larger than a config.json can be
        raise UnsupportedCheckpointError(str(exc)) from None
    except ValueError as exc:  # not JSON; also an integer of more digits than Python reads
        raise UnsupportedCheckpointError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:  # arrays or objects nested past Python's recursion limit
        raise UnsupportedCheckpointError(f"{where}: not valid JSON (nested too deeply)") from None
    if not isinstance(cfg, dict):
        raise UnsupportedCheckpointError(
            f"{where}: expected a JSON object, got {type(cfg).__name__}"
        )
    return from_hf_dict(cfg, where)


def from_hf_dict(
    cfg: dict[str, Any], where: str, source_keys: Mapping[str, str] | None = None
) -> ModelConfig:
    """A Llama-family ModelConfig from config.json's fields (`where` names the source in
    errors): a checkpoint folder's, or a GGUF file's metadata in those terms (models.gguf;
    `source_keys`: config.json's key -> the key the source holds it under, for the errors).

    A value the engine cannot run (NaN or infinity anywhere, a wrong type, a size out of
    range or one that does not divide) is refused with `where`, the key and what is allowed."""

    def key(name: str) -> str:
        hf = HF_KEYS.get(name, name)
        return (source_keys or {}).get(hf, hf)

    if (found := non_finite_number(cfg)) is not None:
        path, value = found
        head, dot, rest = path.partition(".")
        raise UnsupportedCheckpointError(
            f"{where}: {key(head)}{dot}{rest}: {value!r} is invalid; allowed: a finite number"
        )
    try:
        return _from_hf_dict(cfg, where, key)
    except ModelFieldError as exc:
        raise UnsupportedCheckpointError(
            f"{where}: {key(exc.field)}: {exc.shown} is invalid; {exc.reason}"
        ) from None


#: Gemma's keys a config.json may leave out, as transformers' config classes default them
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
    },
    "Gemma3ForCausalLM": {
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
    },
}


def _architecture(cfg: dict[str, Any]) -> str:
    """config.json's architecture: the first of `architectures`, else by its `model_type`."""
    archs = cfg.get("architectures")
    if archs is not None and not (
        isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)
    ):
        raise ModelFieldError("architectures", archs, "allowed: a list of architecture names")
    model_type = cfg.get("model_type", "")
    if not isinstance(model_type, str):
        raise ModelFieldError("model_type", model_type, "allowed: a string")
    return archs[0] if archs else MODEL_TYPES.get(model_type, "")


def _from_hf_dict(cfg: dict[str, Any], where: str, key: Callable[[str], str]) -> ModelConfig:
    arch = _architecture(cfg)
    cfg = {**_GEMMA_DEFAULTS.get(arch, {}), **cfg}
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"{where}: architecture {arch or cfg.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    gemma = arch in _GEMMA
    act = (
        _or(cfg.get("hidden_activation"), cfg.get("hidden_act", "silu"))
        if gemma
        else (cfg.get("hidden_act", "silu"))
    )
    if act not in (ACTIVATIONS if gemma else ("silu",)):
        allowed = "|".join(ACTIVATIONS) if gemma else "silu"
        raise UnsupportedCheckpointError(
            f"{where}: hidden_act {act!r} is not supported; allowed: {allowed}"
        )
    if cfg.get("mlp_bias"):
        raise UnsupportedCheckpointError(f"{where}: mlp_bias=true is not supported")
    if cfg.get("quantization_config"):  # AWQ, GPTQ, compressed-tensors (models/weights.py)
        try:
            parse_quantization_config(cfg["quantization_config"], where)
        except QuantizedCheckpointError as exc:
            raise UnsupportedCheckpointError(str(exc)) from None
    if cfg.get("pretraining_tp", 1) != 1:
        raise UnsupportedCheckpointError(f"{where}: pretraining_tp != 1 is not supported")
    if arch not in _QKV_BIAS and cfg.get("attention_bias"):
        # their attention_bias also puts a bias on o_proj, which the engine does not have
        raise UnsupportedCheckpointError(
            f"{where}: attention_bias=true on a {arch} (biased q/k/v/o projections) is "
            "not supported"
        )
    if cfg.get("clip_qkv") is not None:
        raise UnsupportedCheckpointError(f"{where}: clip_qkv (OLMoE's clamp) is not supported")

    sliding_window = None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        sliding_window = cfg.get("sliding_window")
    elif arch == "LlamaForCausalLM" and cfg.get("sliding_window"):
        raise UnsupportedCheckpointError(f"{where}: sliding_window on a Llama model is unexpected")

    theta, scaling = _rope_from_hf(cfg)
    family = _gemma_from_hf(cfg, arch, where) if gemma else {}
    if arch.startswith("Qwen"):
        family = _qwen_windows(cfg)
    try:
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        values = {
            "architecture": arch,
            "vocab_size": cfg["vocab_size"],
            "hidden_size": hidden,
            "intermediate_size": cfg["intermediate_size"],
            "num_layers": cfg["num_hidden_layers"],
            "num_heads": heads,
            "num_kv_heads": _or(cfg.get("num_key_value_heads"), heads),
            "head_dim": cfg.get("head_dim"),
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
            "attention_bias": _qkv_bias(cfg, arch),
            "sliding_window": sliding_window,
            "tie_word_embeddings": _flag(cfg, "tie_word_embeddings", gemma),
            "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_ids": _eos_ids(cfg.get("eos_token_id")),
            "qk_norm": _QK_NORM.get(arch, "none"),
            **_moe_from_hf(cfg, arch),
            **family,
        }
        if gemma:
            values["hidden_act"] = act
            values["embedding_multiplier"] = float(hidden) ** 0.5 if _is_number(hidden) else 1.0
    except KeyError as missing:
        raise UnsupportedCheckpointError(f"{where}: required field {missing} is missing") from None
    if values["head_dim"] is None:  # the heads split the hidden size
        if check_size("hidden_size", hidden) % check_size("num_heads", heads):
            raise UnsupportedCheckpointError(
                f"{where}: {key('hidden_size')}: {hidden} is invalid; it must be a multiple of "
                f"{key('num_heads')} ({heads})"
            )
        values["head_dim"] = hidden // heads
    check_model_fields(values)
    return ModelConfig(
        **{**values, "rms_norm_eps": float(values["rms_norm_eps"]), "rope_theta": float(theta)}
    )


#: architectures whose q/k/v projections may carry a bias (config key, default), o_proj none
_QKV_BIAS = {
    "Qwen2ForCausalLM": ("attention_bias", True),
    "Qwen2MoeForCausalLM": ("qkv_bias", True),
}
_QK_NORM = {
    "Qwen3ForCausalLM": "head",
    "Qwen3MoeForCausalLM": "head",
    "OlmoeForCausalLM": "full",
    "Gemma3ForCausalLM": "head",
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _gemma_from_hf(cfg: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """Gemma 2/3's fields: (1 + weight) norms, a norm after attention and after the MLP,
    scaled embeddings, 1/sqrt(query_pre_attn_scalar), soft caps, and sliding-window layers
    interleaved with global ones (`layer_types`; older configs: every second layer global
    in Gemma 2, every `sliding_window_pattern`-th in Gemma 3), whose RoPE base Gemma 3 sets
    apart (`rope_local_base_freq`, or `rope_parameters.sliding_attention`)."""
    gemma2 = arch == "Gemma2ForCausalLM"  # an absent key takes transformers' class default
    bidirectional = _flag(cfg, "use_bidirectional_attention", False)
    if not isinstance(bidirectional, bool):
        raise ModelFieldError("use_bidirectional_attention", bidirectional, "allowed: true|false")
    if bidirectional:
        raise UnsupportedCheckpointError(
            f"{where}: use_bidirectional_attention=true (an encoder) is not supported"
        )
    count = _layer_count(cfg)
    if gemma2:
        global_layers = [i % 2 == 1 for i in range(count)]
    else:
        pattern = _or(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern")), 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelFieldError("sliding_window_pattern", pattern, "allowed: an integer >= 1")
        global_layers = [(i + 1) % pattern == 0 for i in range(count)]
    windows = _window_layers(cfg, cfg.get("sliding_window", 4096), global_layers)
    local_theta = cfg.get("rope_local_base_freq", 10000.0)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        local = params["sliding_attention"]
        if local.get("rope_type", "default") != "default":
            raise ModelFieldError(
                "rope_parameters.sliding_attention.rope_type",
                local.get("rope_type"),
                "allowed: default",
            )
        local_theta = local.get("rope_theta", local_theta)
    if gemma2:
        local_theta = None  # one RoPE for every layer
    return {
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None),
        "final_logit_softcapping": cfg.get("final_logit_softcapping", 30.0 if gemma2 else None),
        **windows,
        "local_rope_theta": float(local_theta) if _is_number(local_theta) else local_theta,
    }


def _layer_count(cfg: dict[str, Any]) -> int:
    """num_hidden_layers, checked before anything is built per layer (10**12 would not fit)."""
    return check_size("num_layers", cfg.get("num_hidden_layers"))


def _window_layers(
    cfg: dict[str, Any], window: Any, global_by_default: list[bool]
) -> dict[str, Any]:
    """sliding_window and full_attention_layers from config.json's `layer_types` (absent: the
    family's rule, `global_by_default`); no window where no layer is windowed."""
    count = len(global_by_default)
    kinds = ("sliding_attention", "full_attention")
    types = cfg.get("layer_types")
    if types is None:
        types = [kinds[1] if full else kinds[0] for full in global_by_default]
    if not isinstance(types, list) or len(types) != count or any(t not in kinds for t in types):
        raise ModelFieldError(
            "layer_types", types, f"allowed: a list of {count} of {'|'.join(kinds)}"
        )
    full = tuple(i for i, kind in enumerate(types) if kind == kinds[1])
    if window is None or len(full) == count:
        return {"sliding_window": None, "full_attention_layers": ()}
    return {"sliding_window": window, "full_attention_layers": full}


def _qwen_windows(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen's `use_sliding_window`: the layers from `max_window_layers` on attend within the
    window, those before it globally (transformers' rule, unless `layer_types` says)."""
    if not cfg.get("use_sliding_window"):
        return {}
    start = _or(cfg.get("max_window_layers"), 28)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ModelFieldError("max_window_layers", start, "allowed: an integer >= 0")
    count = _layer_count(cfg)
    return _window_layers(cfg, cfg.get("sliding_window"), [i < start for i in range(count)])


def _qkv_bias(cfg: dict[str, Any], arch: str) -> Any:
    name, default = _QKV_BIAS.get(arch, ("attention_bias", False))
    return _flag(cfg, name, default)


def _moe_from_hf(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of config.json, as each family names them."""
    if arch not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                    "OlmoeForCausalLM"):  # fmt: skip
        return {}
    experts = _or(cfg.get("num_experts"), cfg.get("num_local_experts"))
    layers = _layer_count(cfg)
    step = _or(cfg.get("decoder_sparse_step"), 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ModelFieldError("decoder_sparse_step", step, "allowed: an integer >= 1")
    only = _or(cfg.get("mlp_only_layers"), [])
    if not isinstance(only, list):
        raise ModelFieldError("mlp_only_layers", only, "allowed: a list of layer indices")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg.get("num_experts_per_tok"),
        "moe_intermediate_size": _or(cfg.get("moe_intermediate_size"), 0),
        # Mixtral always renormalizes the chosen experts' weights
        "norm_topk_prob": arch == "MixtralForCausalLM" or _flag(cfg, "norm_topk_prob", False),
        "shared_expert_intermediate_size": _or(cfg.get("shared_expert_intermediate_size"), 0),
        "dense_layers": dense,
    }


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _flag(cfg: dict[str, Any], name: str, default: bool) -> Any:
    """A boolean key (absent: `default`; null: false, as transformers reads it)."""
    value = cfg.get(name, default)
    return False if value is None else value


def _eos_ids(eos: Any) -> Any:
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def kv_bytes_per_token(model: ModelConfig, bytes_per_element: float) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes: the seeds' formula (per-element
    bytes may be fractional: an INT8 cache's scale plane spread over head_dim)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * bytes_per_element


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
