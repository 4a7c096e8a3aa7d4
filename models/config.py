"""Model architecture: the built-in presets and Hugging Face `config.json` parsing.

Every shape the engine runs is a `ModelConfig`. Presets give the shapes of real models (for
dummy-weight performance work) and small ones for tests; `from_hf_config` reads a local
checkpoint's config and refuses, by name, anything the engine does not implement.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from models.files import SETTINGS, UserFileError, read_input_text
from models.gguf import gguf_hf_config
from models.packaged import PACKAGED_MODELS, packaged_model_path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


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

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"model.{name}: {getattr(self, name)!r} is invalid; {allowed}")

        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "allowed: an integer >= 1")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_kv_heads", f"it must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise bad("head_dim", "rotary embeddings need an even head_dim")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise bad("sliding_window", "allowed: null or an integer >= 1")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise bad(
                "rope_scaling",
                f"rope_type {rope_type!r} is not one of {'|'.join(SUPPORTED_ROPE_TYPES)}",
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size

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
        if "eos_token_ids" in values:
            values["eos_token_ids"] = tuple(values["eos_token_ids"])
        return replace(self, **values)


def _llama(**kw: Any) -> ModelConfig:
    return ModelConfig(**kw)


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


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older versions write
    # `rope_theta` and `rope_scaling` side by side.
    params = cfg.get("rope_parameters")
    if params is None:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
    else:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedCheckpointError(
                f"config.json: rope scaling type {rope_type!r} is not supported; "
                f"supported: {'|'.join(SUPPORTED_ROPE_TYPES)}"
            )
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **scaling}
    return theta, scaling


def from_hf_config(path: str | Path) -> ModelConfig:
    """Parse `path/config.json` (or a config.json file) of a Llama-family checkpoint."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise FileNotFoundError(f"model.path: no config.json at {config_file}")
    where = str(config_file)
    try:
        cfg = json.loads(read_input_text(config_file, SETTINGS))
    except UserFileError as exc:  # not UTF-8, or larger than a config.json can be
        raise UnsupportedCheckpointError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise UnsupportedCheckpointError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise UnsupportedCheckpointError(
            f"{where}: expected a JSON object, got {type(cfg).__name__}"
        )
    return from_hf_dict(cfg, where)


def from_hf_dict(cfg: dict[str, Any], where: str) -> ModelConfig:
    """A Llama-family ModelConfig from config.json's fields (`where` names the source in
    errors): a checkpoint folder's, or a GGUF file's metadata in those terms (models.gguf)."""
    archs = cfg.get("architectures") or []
    arch = (
        archs[0]
        if archs
        else {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
        }.get(cfg.get("model_type", ""), "")
    )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"{where}: architecture {arch or cfg.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedCheckpointError(f"{where}: hidden_act {act!r} is not supported; only silu")
    if cfg.get("mlp_bias"):
        raise UnsupportedCheckpointError(f"{where}: mlp_bias=true is not supported")
    if cfg.get("quantization_config"):
        raise UnsupportedCheckpointError(
            f"{where}: pre-quantized checkpoints (quantization_config) are not supported; "
            "load an fp16/bf16/fp32 checkpoint and set engine.quantization instead"
        )
    if cfg.get("pretraining_tp", 1) != 1:
        raise UnsupportedCheckpointError(f"{where}: pretraining_tp != 1 is not supported")
    if arch == "LlamaForCausalLM" and cfg.get("attention_bias"):
        # Llama's attention_bias also puts a bias on o_proj, which the engine does not have.
        raise UnsupportedCheckpointError(
            f"{where}: attention_bias=true on a Llama model (biased q/k/v/o projections) is "
            "not supported"
        )

    sliding_window = None
    if arch == "MistralForCausalLM":
        sliding_window = cfg.get("sliding_window")
    elif arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
        raise UnsupportedCheckpointError(
            f"{where}: Qwen2 use_sliding_window=true (per-layer windows) is not supported"
        )
    elif arch == "LlamaForCausalLM" and cfg.get("sliding_window"):
        raise UnsupportedCheckpointError(f"{where}: sliding_window on a Llama model is unexpected")

    theta, scaling = _rope_from_hf(cfg)
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=sliding_window,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as missing:
        raise UnsupportedCheckpointError(f"{where}: required field {missing} is missing") from None


def resolve_model(model: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """A preset name, a packaged model, a checkpoint folder or a GGUF file -> ModelConfig."""
    name = str(model)
    if name in PRESETS:
        return PRESETS[name].with_overrides(overrides)
    if name in PACKAGED_MODELS:
        name = str(packaged_model_path(name))
    if name.endswith(".gguf") and Path(name).is_file():
        return from_hf_dict(gguf_hf_config(name), name).with_overrides(overrides)
    if Path(name).exists():
        return from_hf_config(name).with_overrides(overrides)
    raise ValueError(
        f"model: {name!r} is neither a preset ({'|'.join([*PRESETS, *PACKAGED_MODELS])}), "
        "an existing checkpoint folder nor a .gguf file"
    )


def kv_bytes_per_token(model: ModelConfig, bytes_per_element: float) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes: the seeds' formula (per-element
    bytes may be fractional: an INT8 cache's scale plane spread over head_dim)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * bytes_per_element


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
