"""Random LoRA adapters for speed measurements, as `load_format=dummy` is random weights: N
adapters at one rank on every module of every block, written once in the PEFT layout to the
lab's cache (models/cache.py) and then read like any adapter, so that loading them is timed as
a real adapter's is. Named dummy-0, dummy-1, ... (engine.lora_dummy_adapters)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engines.builtin.lora.adapter import TARGETABLE
from models.cache import build_folder_once, cache_dir, write_text_atomic
from models.config import ModelConfig
from models.weights import hf_parameter_shapes

_MARKER = "adapter_model.safetensors"


def dummy_adapter_folders(config: ModelConfig, count: int, rank: int, seed: int) -> dict[str, str]:
    """name -> folder of each of `count` random adapters of rank `rank` for `config`."""
    shape = json.dumps(
        {"layers": config.num_layers, "shapes": hf_parameter_shapes(config)}, sort_keys=True
    )
    key = hashlib.sha256(f"{shape}:{rank}:{seed}".encode()).hexdigest()[:16]
    root = cache_dir() / "lora_dummy" / f"{key}-r{rank}"
    folders = {}
    for index in range(count):
        folder = root / f"dummy-{index}"
        build_folder_once(
            folder,
            _MARKER,
            functools.partial(_write, config=config, rank=rank, seed=seed + index),
            "a dummy LoRA adapter",
        )
        folders[f"dummy-{index}"] = str(folder)
    return folders


def _write(folder: Path, config: ModelConfig, rank: int, seed: int) -> None:
    shapes = hf_parameter_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in TARGETABLE:
            parent = (
                "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            out, fan_in = shapes[f"model.layers.{layer}.{parent}.{module}.weight"]
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            # PEFT's scale: A kaiming-like, B small, so the delta is a perturbation
            tensors[f"{key}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            )
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.01
    config_json = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": list(TARGETABLE),
    }
    write_text_atomic(folder / "adapter_config.json", json.dumps(config_json))
    save_file(tensors, str(folder / _MARKER))
