"""Quantized Hugging Face folders as their quantizers write them, made from a float transformers
model: compressed-tensors by compressed-tensors itself (its `ModelCompressor`, the library
llm-compressor saves with), AWQ (AutoAWQ's GEMM layout) and GPTQ (AutoGPTQ's and GPTQModel's
layouts, act-order included) by the packing their projects document, each with a word-level
tokenizer over the vocabulary. The AWQ and GPTQ writers also return the float weights the file
stands for, W = (q - zero) * scale computed from the levels before packing, as the reference
the engine's loader must reproduce."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from checkpoints import write_word_tokenizer
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def linears(model: Any) -> dict[str, torch.nn.Linear]:
    """The decoder's linear layers (the LM head stays float, as the quantizers leave it)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.")
    }


def _pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """uint levels [..., n] -> int32 words [..., n * bits / 32], lowest bits first."""
    per = 32 // bits
    words = levels.to(torch.int64).reshape(*levels.shape[:-1], -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (words << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _minmax_levels(
    w: torch.Tensor, groups: torch.Tensor, count: int, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest levels of w [out, in] with a float16 scale and an integer zero per
    (output, group), `groups` the group of each input: (q [out, in], scales and zeros
    [out, count])."""
    top = 2**bits - 1
    out = w.shape[0]
    lo = torch.full((out, count), float("inf")).scatter_reduce(1, groups.expand(out, -1), w, "amin")
    hi = torch.full((out, count), -float("inf")).scatter_reduce(
        1, groups.expand(out, -1), w, "amax"
    )
    if symmetric:
        half = 2 ** (bits - 1)
        scales = (torch.maximum(hi.abs(), lo.abs()) / (half - 1)).clamp(min=1e-5).half().float()
        zeros = torch.full_like(scales, float(half))
    else:
        scales = ((hi - lo) / top).clamp(min=1e-5).half().float()
        zeros = (-lo / scales).round().clamp(0, top)
    s, z = scales[:, groups], zeros[:, groups]
    q = (w / s).round().add(z).clamp(0, top)
    return q.to(torch.uint8), scales, zeros


def _save(model: Any, folder: Path, tensors: dict[str, torch.Tensor], qc: dict) -> Path:
    """The model's other tensors, float, beside the quantized ones; config.json names `qc`."""
    quantized = {n.rsplit(".", 1)[0] for n in tensors}
    state = {
        n: p.detach().contiguous()
        for n, p in model.state_dict().items()
        if n.rsplit(".", 1)[0] not in quantized or n.endswith(".bias")
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file({**state, **tensors}, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    write_word_tokenizer(folder, model.config.vocab_size)
    return folder


def _awq_interleaved(t: torch.Tensor) -> torch.Tensor:
    """[rows, cols] with each run of eight columns in AWQ's order (word nibble j: column
    AWQ_ORDER[j])."""
    return t.reshape(t.shape[0], -1, 8)[..., list(AWQ_ORDER)].reshape(t.shape).contiguous()


def write_awq(model: Any, folder: Path, group_size: int = 128) -> tuple[Path, dict]:
    """AutoAWQ's GEMM layout, 4 bits with zero points; (folder, {module: float weight})."""
    tensors, reference = {}, {}
    for name, layer in linears(model).items():
        w = layer.weight.detach().float()
        k = w.shape[1]
        groups = torch.arange(k) // group_size
        q, s, z = _minmax_levels(w, groups, k // group_size, 4, symmetric=False)
        reference[name] = (q.float() - z[:, groups]) * s[:, groups]
        tensors[f"{name}.qweight"] = _pack(_awq_interleaved(q.T), 4)
        tensors[f"{name}.qzeros"] = _pack(_awq_interleaved(z.T), 4)
        tensors[f"{name}.scales"] = s.T.half().contiguous()
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
          "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    return _save(model, folder, tensors, qc), reference


def write_gptq(
    model: Any, folder: Path, bits: int = 4, group_size: int = 32, act_order: bool = False,
    checkpoint_format: str = "gptq", symmetric: bool = True, seed: int = 0,
) -> tuple[Path, dict]:  # fmt: skip
    """AutoGPTQ's layout (`gptq`: zeros stored minus one) or GPTQModel's (`gptq_v2`); with
    `act_order`, each layer's groups are runs of a random permutation of its inputs (`g_idx`),
    as desc_act leaves them. (folder, {module: float weight})."""
    gen = torch.Generator().manual_seed(seed)
    tensors, reference, orders = {}, {}, {}
    for name, layer in linears(model).items():
        w = layer.weight.detach().float()
        k = w.shape[1]
        g = k if group_size == -1 else group_size
        g_idx = torch.arange(k) // g
        if act_order:  # one order per input: q/k/v (and gate/up) see the same Hessian
            shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            shared = shared.replace("up_proj", "gate_proj")
            if shared not in orders:
                orders[shared] = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[orders[shared]] = torch.arange(k) // g
        q, s, z = _minmax_levels(w, g_idx, k // g, bits, symmetric)
        reference[name] = (q.float() - z[:, g_idx]) * s[:, g_idx]
        stored_zeros = z - (1 if checkpoint_format == "gptq" else 0)
        tensors[f"{name}.qweight"] = _pack(q, bits).T.contiguous()
        tensors[f"{name}.qzeros"] = _pack(stored_zeros.T.to(torch.uint8).contiguous(), bits)
        tensors[f"{name}.scales"] = s.T.half().contiguous()
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
          "sym": symmetric, "checkpoint_format": checkpoint_format}  # fmt: skip
    return _save(model, folder, tensors, qc), reference


def write_compressed_tensors(
    model: Any, folder: Path, scheme: str, group_size: int | None = None
) -> Path:
    """`scheme` (compressed-tensors' presets: W4A16, W4A16_ASYM, W8A16, FP8, FP8_DYNAMIC...)
    applied to the decoder's linears with min-max scales, compressed and saved by
    compressed-tensors."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    preset = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None:
        preset.weights.group_size = group_size
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": preset}, ignore=["lm_head"])
    )
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        args = module.quantization_scheme.weights
        w = module.weight.data.float()
        if args.strategy == "group":
            by_group = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = by_group.amin(-1), by_group.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape_as(
            module.weight_scale
        )
        if hasattr(module, "weight_zero_point"):
            zp = module.weight_zero_point
            zp.data = zero.to(zp.dtype).reshape_as(zp)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    write_word_tokenizer(folder, model.config.vocab_size)
    return folder
