"""Quantized Hugging Face folders written from a float one, in the layouts AWQ, GPTQ and
compressed-tensors checkpoints use (models/hf_quantized.py reads them back): what a lab needs to
run "the AWQ / GPTQ / FP8 file" of a model it only has in float. Built once into the cache from
a packaged model (`derived_folder`: `model=smollm2-135m-awq-g64`...).

The levels are round-to-nearest with min-max scales, as every quantizer starts: AWQ's
activation-aware scaling and GPTQ's error compensation need calibration data and change which
levels are stored, not how they are stored, so the files exercise the formats and kernels
exactly, and their quality is a lower bound of what those quantizers reach.
- AWQ (AutoAWQ's GEMM layout): 4 bits, asymmetric, an integer zero point per group; the
  eight levels of an int32 in AWQ's interleaved order.
- GPTQ (AutoGPTQ's `gptq` format: zeros stored minus one): 4 or 8 bits, symmetric, g_idx; with
  act-order, each input group's inputs taken in descending order of their weights' column norm
  (GPTQ orders by its Hessian's diagonal, which calibration gives; the norm is the
  calibration-free stand-in), so the groups are not contiguous runs of inputs.
- compressed-tensors (llm-compressor's formats): written by the compressed-tensors library
  itself (the dev extra), from its presets W4A16, W8A16 and FP8_DYNAMIC.
- vLLM's `fp8` (AutoFP8's layout): e4m3 values and a scale a tensor, or a scale per block of
  128 x 128 (DeepSeek's `weight_scale_inv`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from models import gguf_convert, gguf_reencode
from models.cache import build_folder_once, cache_dir, code_key, file_key
from models.gguf_convert import convert_to_hf
from models.gguf_quantize import derived_gguf
from models.weights import iter_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # models/hf_quantized.py's


def quantized_linears(state: dict[str, torch.Tensor]) -> list[str]:
    """The decoder's projections (the quantizers leave embeddings, norms, routers and the LM
    head in float)."""
    return [
        n[: -len(".weight")]
        for n, t in state.items()
        if n.startswith("model.layers.") and n.endswith("_proj.weight") and t.dim() == 2
    ]


def _pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """uint levels [..., n] -> int32 words [..., n * bits / 32], lowest bits first."""
    assert int(levels.max()) < 2**bits, "a level past the bits would spill into the next one"
    per = 32 // bits
    words = levels.to(torch.int64).reshape(*levels.shape[:-1], -1, per)
    packed = (words << (torch.arange(per, dtype=torch.int64) * bits)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _awq_interleaved(t: torch.Tensor) -> torch.Tensor:
    """[rows, cols], each run of eight columns in AWQ's order (word nibble j: column
    AWQ_ORDER[j])."""
    return t.reshape(t.shape[0], -1, 8)[..., list(AWQ_ORDER)].reshape(t.shape).contiguous()


def round_to_nearest(
    w: torch.Tensor, groups: torch.Tensor, count: int, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Levels of w [out, in] with a float16 scale and an integer zero per (output, group),
    `groups` the group of each input: (q uint8 [out, in], scales and zeros [out, count])."""
    top, out = 2**bits - 1, w.shape[0]
    index = groups.expand(out, -1)
    lo = torch.full((out, count), float("inf")).scatter_reduce(1, index, w, "amin")
    hi = torch.full((out, count), -float("inf")).scatter_reduce(1, index, w, "amax")
    if symmetric:
        half = 2 ** (bits - 1)
        scales = (torch.maximum(hi.abs(), lo.abs()) / (half - 1)).clamp(min=1e-5).half().float()
        zeros = torch.full_like(scales, float(half))
    else:
        scales = ((hi - lo) / top).clamp(min=1e-5).half().float()
        zeros = (-lo / scales).round().clamp(0, top)
    q = (w / scales[:, groups]).round().add(zeros[:, groups]).clamp(0, top)
    return q.to(torch.uint8), scales, zeros


def _act_order_groups(
    state: dict[str, torch.Tensor], module: str, group: int, orders: dict[str, torch.Tensor]
) -> torch.Tensor:
    """g_idx of act-order: the inputs in descending column norm, `group` at a time; one order
    for the projections that read the same input (q/k/v; gate/up)."""
    shared = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
    shared = shared.replace("up_proj", "gate_proj")
    if shared not in orders:
        norms = state.get(shared + ".weight", state[module + ".weight"]).float().norm(dim=0)
        orders[shared] = torch.argsort(norms, descending=True, stable=True)
    order = orders[shared]
    g_idx = torch.empty(len(order), dtype=torch.long)
    g_idx[order] = torch.arange(len(order)) // group
    return g_idx


def _float_state(src: Path) -> dict[str, torch.Tensor]:
    return {n: t for n, t in iter_checkpoint(src) if isinstance(t, torch.Tensor)}


def _save(src: Path, dst: Path, state: dict[str, torch.Tensor], tensors: dict, qc: dict) -> None:
    """The quantized tensors beside the float ones the quantizer leaves; src's config.json with
    `qc` as its quantization_config; src's tokenizer and generation files."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    quantized = {n.rsplit(".", 1)[0] for n in tensors}
    kept = {n: t.contiguous() for n, t in state.items() if n.rsplit(".", 1)[0] not in quantized}
    save_file({**kept, **tensors}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}, indent=2))
    _copy_tokenizer(src, dst)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())


def write_awq(src: Path, dst: Path, group_size: int = 128) -> dict[str, torch.Tensor]:
    """The float folder `src` as AutoAWQ's GEMM layout at `dst`; the float weights it stands
    for, by module."""
    state, tensors, reference = _float_state(src), {}, {}
    for name in quantized_linears(state):
        w = state[name + ".weight"].float()
        groups = torch.arange(w.shape[1]) // group_size
        q, s, z = round_to_nearest(w, groups, w.shape[1] // group_size, 4, symmetric=False)
        reference[name] = (q.float() - z[:, groups]) * s[:, groups]
        tensors[f"{name}.qweight"] = _pack(_awq_interleaved(q.T), 4)
        tensors[f"{name}.qzeros"] = _pack(_awq_interleaved(z.T), 4)
        tensors[f"{name}.scales"] = s.T.half().contiguous()
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
          "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    _save(src, dst, state, tensors, qc)
    return reference


def write_gptq(
    src: Path, dst: Path, bits: int = 4, group_size: int = 128, act_order: bool = False,
    checkpoint_format: str = "gptq", symmetric: bool = True,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The float folder `src` as a GPTQ checkpoint at `dst` (AutoGPTQ's `gptq` format, zeros
    stored minus one, or GPTQModel's `gptq_v2`; group_size -1: a group a row); the float
    weights it stands for, by module. Asymmetric levels need `gptq_v2`: the `gptq` format
    cannot store a zero point of 0."""
    if not symmetric and checkpoint_format == "gptq":
        raise ValueError(
            "write_gptq: symmetric=False with checkpoint_format='gptq' (zeros stored minus "
            "one: a zero of 0 does not fit); allowed: checkpoint_format='gptq_v2'"
        )
    state, tensors, reference = _float_state(src), {}, {}
    orders: dict[str, torch.Tensor] = {}
    for name in quantized_linears(state):
        w = state[name + ".weight"].float()
        k = w.shape[1]
        g = k if group_size == -1 else group_size
        g_idx = _act_order_groups(state, name, g, orders) if act_order else torch.arange(k) // g
        q, s, z = round_to_nearest(w, g_idx, -(-k // g), bits, symmetric)  # a last short group
        reference[name] = (q.float() - z[:, g_idx]) * s[:, g_idx]
        stored_zeros = z - (1 if checkpoint_format == "gptq" else 0)
        tensors[f"{name}.qweight"] = _pack(q, bits).T.contiguous()
        tensors[f"{name}.qzeros"] = _pack(stored_zeros.T.to(torch.uint8).contiguous(), bits)
        tensors[f"{name}.scales"] = s.T.half().contiguous()
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
          "sym": symmetric, "checkpoint_format": checkpoint_format}  # fmt: skip
    _save(src, dst, state, tensors, qc)
    return reference


def write_fp8(src: Path, dst: Path, block: tuple[int, int] | None = None) -> None:
    """The float folder `src` as vLLM's own `fp8` checkpoint at `dst` (AutoFP8's layout): e4m3
    values with a float32 scale a tensor (max|w| / 448), or with `block` [rows, columns] one a
    block (`weight_scale_inv`, as DeepSeek's checkpoints store them)."""
    state, tensors = _float_state(src), {}
    for name in quantized_linears(state):
        w = state[name + ".weight"].float()
        if block is None:
            scale = (w.abs().amax() / 448).clamp(min=1e-12)
            tensors[f"{name}.weight_scale"] = scale.reshape(())
            values = w / scale
        else:
            rows, cols = block
            out, k = w.shape
            tiles = torch.nn.functional.pad(w, (0, 0, 0, -out % rows)).reshape(
                -(-out // rows), rows, k // cols, cols
            )
            scale = (tiles.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
            tensors[f"{name}.weight_scale_inv"] = scale
            full = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)
            values = w / full
        tensors[f"{name}.weight"] = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    qc: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block is not None:
        qc["weight_block_size"] = list(block)
    _save(src, dst, state, tensors, qc)


def write_compressed_tensors(
    src: Path, dst: Path, scheme: str, group_size: int | None = None
) -> None:
    """The float folder `src` quantized and saved by compressed-tensors at `dst`: its preset
    `scheme` (W4A16, W4A16_ASYM, W8A16, W8A8, FP8, FP8_DYNAMIC...) on the decoder's linears,
    min-max scales (`group_size`: the groups' width where the preset has groups)."""
    try:
        import transformers
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import (
            QuantizationConfig,
            apply_quantization_config,
            preset_name_to_scheme,
        )
        from compressed_tensors.quantization.utils import calculate_qparams
    except ImportError as exc:
        raise ValueError(
            f"writing a compressed-tensors {scheme} folder needs compressed-tensors and "
            "transformers (the dev extra): make setup-dev"
        ) from exc
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    preset = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None and preset.weights.group_size is not None:
        preset.weights.group_size = group_size
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": preset}, ignore=["lm_head"])
    )
    modules: list[Any] = list(model.modules())  # with compressed-tensors' attributes
    for module in modules:
        if not hasattr(module, "weight_scale"):
            continue
        args, w = module.quantization_scheme.weights, module.weight.data.float()
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
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    _copy_tokenizer(src, dst)


#: derived folder formats -> how each is written from the float folder
FOLDER_FORMATS: dict[str, Callable[[Path, Path], Any]] = {
    "awq-g64": lambda src, dst: write_awq(src, dst, 64),
    "gptq-w4-g64": lambda src, dst: write_gptq(src, dst, 4, 64),
    "gptq-w4-g64-act-order": lambda src, dst: write_gptq(src, dst, 4, 64, act_order=True),
    "w4a16": lambda src, dst: write_compressed_tensors(src, dst, "W4A16", group_size=64),
    "w8a16": lambda src, dst: write_compressed_tensors(src, dst, "W8A16", group_size=64),
    "fp8": lambda src, dst: write_compressed_tensors(src, dst, "FP8_DYNAMIC"),
    "fp8-vllm": lambda src, dst: write_fp8(src, dst),
}


def derived_folder(gguf: str | Path, kind: str) -> Path:
    """The packaged GGUF `gguf` as a Hugging Face folder: `f32` (its F16 re-encoding's
    weights in float32: the float model people quantize) or a FOLDER_FORMATS quantization of
    that; each built once into the cache, keyed by the source file."""
    if kind != "f32" and kind not in FOLDER_FORMATS:
        raise ValueError(f"kind: {kind!r}; allowed: f32|{'|'.join(FOLDER_FORMATS)}")
    source = Path(gguf)
    # keyed by the file's content and the code that makes each folder
    key = f"{source.stem}-{file_key(source)}"
    floats_code = code_key(gguf_convert, gguf_reencode)
    floats = build_folder_once(
        cache_dir() / "hf-converted" / f"{key}-f32-{floats_code}",
        "config.json",
        lambda staging: convert_to_hf(derived_gguf(source, "f16"), staging, "float32"),
        "converted checkpoint cache",
    )
    if kind == "f32":
        return floats
    return build_folder_once(
        cache_dir()
        / "hf-quantized"
        / f"{key}-{kind}-{code_key(gguf_convert, gguf_reencode, sys.modules[__name__])}",
        "config.json",
        lambda staging: FOLDER_FORMATS[kind](floats, staging),
        "quantized checkpoint cache",
    )
