"""The transformers model for a built-in preset or a checkpoint: the very same weights the
built-in engine runs (its dummy state dict is already under Hugging Face names)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from models.config import ModelConfig
from models.gguf import is_gguf
from models.location import resolve_model
from models.weights import dummy_state_dict

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What AutoModelForCausalLM loads: a PreTrainedModel with `generate`."""


ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def hf_config(cfg: ModelConfig):  # -> transformers.PretrainedConfig
    """The transformers config describing the same network as `cfg`."""
    import transformers

    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(
            f"model.architecture: {cfg.architecture!r} has no transformers "
            f"counterpart here; allowed: {'|'.join(ARCHITECTURES)}"
        )
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            **(cfg.rope_scaling or {}),
        },
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids) or None,
    )
    if cfg.architecture == "LlamaForCausalLM":
        return transformers.LlamaConfig(attention_bias=cfg.attention_bias, **common)
    if cfg.architecture == "MistralForCausalLM":
        return transformers.MistralConfig(sliding_window=cfg.sliding_window, **common)
    return transformers.Qwen2Config(
        use_sliding_window=cfg.sliding_window is not None,
        sliding_window=cfg.sliding_window,
        **common,
    )


def load_hf_model(
    model: str,
    overrides: dict,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    attn_implementation: str,
) -> tuple[CausalLM, ModelConfig]:
    """A checkpoint folder or a GGUF file through `from_pretrained` (local files only; a GGUF
    file by transformers' own loader, which dequantizes it), or a preset with the built-in
    engine's seeded dummy weights loaded strictly."""
    import transformers

    cfg = resolve_model(model, overrides)
    if Path(model).is_dir():
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation
        )
    elif is_gguf(model):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(Path(model).parent),
            gguf_file=Path(model).name,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=attn_implementation,
        )
    else:
        config = hf_config(cfg)
        config._attn_implementation = attn_implementation
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        hf.load_state_dict(dummy_state_dict(cfg, seed, dtype), strict=True)
    # PreTrainedModel.to is wrapped with functools.wraps, whose stub (typeshed's _Wrapped)
    # does not bind `self` for a method, so mypy takes `device` for `self`
    return hf.to(device).eval(), cfg  # type: ignore[arg-type]
