"""Quantized Hugging Face folders of a float transformers model, for the tests: the model saved
as a float folder (with a word-level tokenizer over its vocabulary), then written by
models/hf_quantize.py in AWQ's, GPTQ's or compressed-tensors' layout (the last by
compressed-tensors itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from checkpoints import write_word_tokenizer

from models import hf_quantize


def linears(model: Any) -> dict[str, torch.nn.Linear]:
    """The decoder's linear layers (the LM head stays float, as the quantizers leave it)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.")
    }


def small_llama(seed: int = 0) -> Any:
    """A Llama whose rows hold whole groups of 128 (hidden 256, intermediate 512), weights far
    from transformers' init, eager attention (the plain reference path)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.08 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    return model


def float_folder(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    write_word_tokenizer(folder, model.config.vocab_size)
    return folder


def _beside(folder: Path, model: Any) -> Path:
    return float_folder(model, folder.with_name(folder.name + "-float"))


def write_awq(model: Any, folder: Path, group_size: int = 128) -> tuple[Path, dict]:
    """(folder, {module: the float weight its levels stand for})."""
    return folder, hf_quantize.write_awq(_beside(folder, model), folder, group_size)


def write_gptq(model: Any, folder: Path, *args: Any, **kwargs: Any) -> tuple[Path, dict]:
    """hf_quantize.write_gptq's arguments after the folders; (folder, reference weights)."""
    return folder, hf_quantize.write_gptq(_beside(folder, model), folder, *args, **kwargs)


def write_compressed_tensors(
    model: Any, folder: Path, scheme: str, group_size: int | None = None
) -> Path:
    hf_quantize.write_compressed_tensors(_beside(folder, model), folder, scheme, group_size)
    return folder


def write_fp8(model: Any, folder: Path, block: tuple[int, int] | None = None) -> Path:
    hf_quantize.write_fp8(_beside(folder, model), folder, block)
    return folder
