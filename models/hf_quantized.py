"""Hugging Face folders a quantizer wrote: AWQ (AutoAWQ's GEMM layout), GPTQ (AutoGPTQ's and
GPTQModel's, act-order included) and compressed-tensors (llm-compressor's pack-quantized,
int-quantized and float-quantized formats), and vLLM's own `fp8` checkpoints (AutoFP8's, and
DeepSeek's blocks of 128 x 128). Each quantized linear's stored tensors are put
together into the QuantizedWeight it stands for (models/quantized_weight.py), W = q * scale +
min with the file's own integer levels, or FP8 values, and scales, so the engine multiplies the
weight as stored.

The layouts, as the quantizers write them (the tests write them with compressed-tensors itself
and check the weights against its decompression):
- AWQ GEMM: `qweight` int32 [in, out / 8], eight 4-bit levels an int32 in the interleaved
  order 0 2 4 6 1 3 5 7 of eight outputs; `qzeros` int32 [in / g, out / 8] the same way;
  `scales` float16 [in / g, out]; W = (q - z) s.
- GPTQ: `qweight` int32 [in * bits / 32, out], 32 / bits levels an int32 along the inputs,
  lowest bits first; `qzeros` int32 [groups, out * bits / 32] along the outputs; `scales`
  float16 [groups, out]; `g_idx` int32 [in], each input's group. W = (q - z) s, where the
  stored zero is z - 1 in AutoGPTQ's format (`checkpoint_format: gptq`) and z in GPTQModel's
  `gptq_v2`. With act-order (`desc_act`) the groups are not contiguous runs of inputs: the
  inputs are sorted by group once at load, and the layer gathers its input in that order.
- compressed-tensors: `weight_packed` int32 [out, in * bits / 32] (levels + 2**(bits-1), along
  the inputs), `weight_scale` [out, groups], `weight_zero_point` (asymmetric: packed along the
  outputs), `weight_shape`, `weight_g_idx` (act-order); int-quantized stores `weight` int8,
  float-quantized `weight` float8_e4m3fn, both with `weight_scale` per tensor, channel or
  group. W = (q - zero) scale.
- fp8 (`quant_method: fp8`): `weight` float8_e4m3fn with `weight_scale` per tensor, or with
  `weight_block_size` [bo, bi] `weight_scale_inv` [out / bo, in / bi] (DeepSeek's name: it
  multiplies, as vLLM reads it). W = value x scale.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from models.quantized_weight import QuantizedWeight

METHODS = ("awq", "gptq", "compressed-tensors", "fp8")
#: compressed-tensors formats whose weights the engine reads
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
#: AWQ's order of eight outputs in an int32, lowest nibble first
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class QuantizedCheckpointError(ValueError):
    """A quantized checkpoint the engine cannot read; the message names the key or tensor."""


@dataclass(frozen=True)
class WeightArgs:
    """How one group of a checkpoint's linears is quantized."""

    bits: int
    kind: str = "int"  # or "float" (FP8)
    symmetric: bool = True
    group_size: int | None = None  # None: one scale a row (or a tensor)


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's `quantization_config`, validated: which quantizer, its weight arguments
    and which modules each applies to."""

    method: str
    args: WeightArgs
    #: compressed-tensors: (targets, arguments) per config group (the modules left float, its
    #: `ignore`, have no scales: the tensors say which linears are quantized)
    groups: tuple[tuple[tuple[str, ...], WeightArgs], ...] = ()
    zero_offset: int = 0  # GPTQ v1 stores each zero minus one
    block: tuple[int, int] | None = None  # fp8's weight_block_size

    @property
    def components(self) -> tuple[str, ...]:
        """The tensor name suffixes of a quantized linear."""
        if self.method == "compressed-tensors":
            return (
                "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                "weight_g_idx", "input_scale", "weight_global_scale", "weight",
            )  # fmt: skip
        if self.method == "fp8":
            return ("weight_scale", "weight_scale_inv", "input_scale", "weight")
        return ("qweight", "qzeros", "scales", "g_idx")

    @property
    def markers(self) -> tuple[str, ...]:
        """The components only a quantized linear has (any of them makes one: a missing
        other is then named)."""
        if self.method in ("compressed-tensors", "fp8"):
            return self.components[:-1]  # a float linear has a `weight` too
        return self.components

    def args_for(self, module: str) -> WeightArgs:
        for targets, args in self.groups:
            if any(_matches(t, module) for t in targets):
                return args
        return self.args


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' targets: a class name (every linear here is one), a module name, or
    `re:` and a pattern."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module) or module.endswith("." + target)


def _field(
    qc: Mapping[str, Any], key: str, where: str, allowed: Iterable[Any], default: Any,
    prefix: str = "quantization_config",
) -> Any:  # fmt: skip
    value = qc.get(key, default)
    allowed = tuple(allowed)
    if value not in allowed:
        raise QuantizedCheckpointError(
            f"{where}: {prefix}.{key}={value!r} is not supported; allowed: "
            + "|".join(str(a) for a in allowed)
        )
    return value


def parse_quantization_config(qc: Any, where: str) -> CheckpointQuantization:
    """config.json's `quantization_config`; an error naming the key and the allowed values."""
    if not isinstance(qc, dict):
        raise QuantizedCheckpointError(f"{where}: quantization_config must be an object")
    method = qc.get("quant_method")
    method = _field({"quant_method": method.lower() if isinstance(method, str) else method},
                    "quant_method", where, METHODS, None)  # fmt: skip
    if method == "awq":
        bits = _field(qc, "bits", where, (4,), qc.get("w_bit", 4))
        group = qc.get("group_size", qc.get("q_group_size", 128))
        _group_size(group, where, allow_row=False)
        version = qc.get("version", "gemm")
        if not (isinstance(version, str) and version.lower() == "gemm"):  # GEMM, gemm
            raise QuantizedCheckpointError(
                f"{where}: quantization_config.version={version!r} is not supported; allowed: gemm"
            )
        _field(qc, "zero_point", where, (True,), True)
        return CheckpointQuantization("awq", WeightArgs(bits, "int", False, group))
    if method == "gptq":
        bits = _field(qc, "bits", where, (4, 8), 4)
        group = _group_size(qc.get("group_size", 128), where, allow_row=True)
        fmt = _field(qc, "checkpoint_format", where, ("gptq", "gptq_v2"), "gptq")
        sym = _field(qc, "sym", where, (True, False), True)
        _field(qc, "desc_act", where, (True, False), False)  # g_idx says which inputs
        return CheckpointQuantization(
            "gptq",
            WeightArgs(bits, "int", sym, group),
            zero_offset=1 if fmt == "gptq" else 0,
        )
    if method == "fp8":
        _field(qc, "activation_scheme", where, ("dynamic", "static"), "dynamic")
        block = qc.get("weight_block_size")
        if block is not None and not (
            isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):  # fmt: skip
            raise QuantizedCheckpointError(
                f"{where}: quantization_config.weight_block_size={block!r}; allowed: null or "
                "[rows, columns] (positive integers)"
            )
        blocks = None if block is None else (block[0], block[1])
        return CheckpointQuantization("fp8", WeightArgs(8, "float"), block=blocks)
    return _compressed_tensors(qc, where)


def _targets(targets: Any, where: str, key: str) -> tuple[str, ...]:
    """A config group's `targets`: names, or `re:` and a pattern that compiles."""
    problem = not isinstance(targets, list) or not all(isinstance(t, str) for t in targets)
    for pattern in [] if problem else [t[3:] for t in targets if t.startswith("re:")]:
        try:
            re.compile(pattern)
        except re.error:
            problem = True
    if problem:
        raise QuantizedCheckpointError(
            f"{where}: quantization_config.{key}.targets={targets!r}; allowed: a list of "
            "module or class names, or 're:' and a regular expression"
        )
    return tuple(targets) or ("Linear",)


def _group_size(
    group: Any, where: str, allow_row: bool, prefix: str = "quantization_config"
) -> int | None:
    if allow_row and group in (-1, None):
        return None
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        allowed = "a positive integer" + (" or -1 (one group a row)" if allow_row else "")
        raise QuantizedCheckpointError(
            f"{where}: {prefix}.group_size={group!r}; allowed: {allowed}"
        )
    return group


def _compressed_tensors(qc: Mapping[str, Any], where: str) -> CheckpointQuantization:
    groups_cfg = qc.get("config_groups")
    if not isinstance(groups_cfg, dict) or not groups_cfg:
        raise QuantizedCheckpointError(
            f"{where}: quantization_config.config_groups must be a non-empty object"
        )
    groups, formats = [], [qc.get("format")]
    for name, group in groups_cfg.items():
        key = f"config_groups.{name}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise QuantizedCheckpointError(f"{where}: quantization_config.{key}.weights missing")
        w, at = group["weights"], f"quantization_config.{key}.weights"
        kind = _field(w, "type", where, ("int", "float"), "int", at)
        bits = _field(w, "num_bits", where, (4, 8) if kind == "int" else (8,), 8, at)
        strategy = _field(w, "strategy", where, ("tensor", "channel", "group"), "tensor", at)
        group_size = None
        if strategy == "group":
            group_size = _group_size(w.get("group_size"), where, allow_row=True, prefix=at)
        # FP8 weights are symmetric (vLLM reads no FP8 zero point either)
        sym = _field(w, "symmetric", where, (True, False) if kind == "int" else (True,), True, at)
        targets = _targets(group.get("targets", ["Linear"]), where, key)
        groups.append((tuple(targets), WeightArgs(bits, kind, sym, group_size)))
        formats.append(group.get("format"))
    for fmt in formats:
        if fmt is not None:
            _field({"format": fmt}, "format", where, CT_FORMATS, None)
    return CheckpointQuantization(
        "compressed-tensors",
        groups[0][1],
        groups=tuple(groups),
    )


# --- unpacking -----------------------------------------------------------------------------


def _unpack(
    packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """int32 words of 32 / bits levels each (lowest bits first) -> uint8 levels, the words'
    levels side by side along `dim` (in AWQ's `order`: level j of a word is element order[j])."""
    per_word = 32 // bits
    words = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    levels = (words[..., None] >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    if order is not None:
        levels = levels[..., torch.tensor(order).argsort()]
    return levels.reshape(*words.shape[:-1], -1).movedim(-1, dim).to(torch.uint8)


def _weight(
    module: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | float,
    source: str, bits: int, g_idx: torch.Tensor | None = None,
) -> QuantizedWeight:  # fmt: skip
    """W = (q - zeros) scales, q [out, in], scales and zeros [out, groups], as a QuantizedWeight
    (min = -zero x scale, exact in float32: a float16 or float32 scale times a small integer);
    `g_idx` the group of each input, where not the contiguous runs of in / groups."""
    out, k = q.shape
    scales = scales.float()
    if not torch.isfinite(scales).all():
        raise QuantizedCheckpointError(f"{module}: its scales hold NaN or infinity ({source})")
    groups = scales.shape[1]
    if k % groups:
        raise QuantizedCheckpointError(
            f"{module} ({source}): {groups} groups of scales for {k} inputs; allowed: a "
            f"divisor of {k}"
        )
    g = k // groups
    order = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // g):
        order = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[order], torch.arange(k) // g):
            raise QuantizedCheckpointError(
                f"{module} ({source}): g_idx does not put {g} inputs in each of {groups} groups"
            )
        q, source = q[:, order], source + " act-order"
    mins = -(torch.as_tensor(zeros, dtype=torch.float32) * scales)
    return QuantizedWeight(
        q.contiguous(), scales.contiguous(), mins.expand(out, groups).contiguous(), g, bits,
        source, input_order=order,
    )  # fmt: skip


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != shape:
        raise QuantizedCheckpointError(f"{name}: shape {tuple(tensor.shape)}, {what} wants {shape}")


def assemble(
    scheme: CheckpointQuantization, module: str, parts: Mapping[str, torch.Tensor]
) -> QuantizedWeight:
    """One linear's stored tensors (`parts`: suffix -> tensor) as its QuantizedWeight."""
    args = scheme.args_for(module)
    if scheme.method == "awq":
        return _awq(module, parts, args)
    if scheme.method == "gptq":
        return _gptq(module, parts, args, scheme.zero_offset)
    if scheme.method == "fp8":
        return _vllm_fp8(module, parts, scheme.block)
    return _ct(module, parts, args)


def _need(module: str, parts: Mapping[str, torch.Tensor], *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in parts]
    if missing:
        raise QuantizedCheckpointError(
            f"{module}: quantized tensors {', '.join(module + '.' + n for n in missing)} missing"
        )
    return [parts[n] for n in names]


def _dtypes(module: str, parts: Mapping[str, torch.Tensor], **wanted: str) -> None:
    """Each part's dtype: "int32" exactly, or "float" (any floating dtype)."""
    for name, kind in wanted.items():
        t = parts.get(name)
        ok = t is None or (t.is_floating_point() if kind == "float" else t.dtype == torch.int32)
        if not ok:
            assert t is not None
            raise QuantizedCheckpointError(f"{module}.{name}: {t.dtype}; allowed: {kind}")


def _awq(module: str, parts: Mapping[str, torch.Tensor], args: WeightArgs) -> QuantizedWeight:
    _dtypes(module, parts, qweight="int32", qzeros="int32", scales="float")
    qweight, qzeros, scales = _need(module, parts, "qweight", "qzeros", "scales")
    k, out = qweight.shape[0], qweight.shape[1] * 8
    groups, group = scales.shape[0], args.group_size or k  # AWQ's config always names one
    _check(f"{module}.scales", scales, (k // group, out), f"AWQ g{group}")
    _check(f"{module}.qzeros", qzeros, (groups, out // 8), "AWQ")
    q = _unpack(qweight, 4, 1, AWQ_ORDER).T
    z = _unpack(qzeros, 4, 1, AWQ_ORDER).T.float()
    return _weight(module, q, scales.T, z, f"AWQ W4 g{group}", 4)


def _gptq(
    module: str, parts: Mapping[str, torch.Tensor], args: WeightArgs, zero_offset: int
) -> QuantizedWeight:
    _dtypes(module, parts, qweight="int32", qzeros="int32", scales="float")
    qweight, qzeros, scales = _need(module, parts, "qweight", "qzeros", "scales")
    per_word = 32 // args.bits
    k, out = qweight.shape[0] * per_word, qweight.shape[1]
    g = args.group_size or k
    groups = -(-k // g)  # a last group shorter than g where g does not divide k (576 / 128)
    label = "g" + str(args.group_size) if args.group_size else "per-channel"
    _check(f"{module}.scales", scales, (groups, out), f"GPTQ W{args.bits} {label}")
    _check(f"{module}.qzeros", qzeros, (groups, out // per_word), f"GPTQ W{args.bits}")
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        _check(f"{module}.g_idx", g_idx, (k,), "GPTQ")
    q = _unpack(qweight, args.bits, 0).T
    s, z = scales.T.float(), _unpack(qzeros, args.bits, 1).T.float() + zero_offset
    if k % g:  # contiguous groups of g and a shorter last one: groups of gcd(k, g), exactly
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // g):
            raise QuantizedCheckpointError(
                f"{module}.g_idx: act-order with a last group shorter than {g} ({k} inputs) "
                "is not supported"
            )
        runs = torch.arange(0, k, math.gcd(k, g)) // g
        s, z, g_idx = s[:, runs], z[:, runs], None
    return _weight(module, q, s, z, f"GPTQ W{args.bits} {label}", args.bits, g_idx)


def _ct(module: str, parts: Mapping[str, torch.Tensor], args: WeightArgs) -> QuantizedWeight:
    _dtypes(module, parts, weight_packed="int32", weight_scale="float")
    (scale,) = _need(module, parts, "weight_scale")
    offset = 1 << (args.bits - 1)
    if "weight_packed" in parts:
        (shape,) = _need(module, parts, "weight_shape")
        if shape.numel() != 2 or shape.is_floating_point():
            raise QuantizedCheckpointError(
                f"{module}.weight_shape: {shape.tolist()}; allowed: [out, in]"
            )
        out, k = (int(v) for v in shape.tolist())
        words = -(-k * args.bits // 32)
        _check(f"{module}.weight_packed", parts["weight_packed"], (out, words),
               f"compressed-tensors W{args.bits} of [{out}, {k}]")  # fmt: skip
        q = _unpack(parts["weight_packed"], args.bits, 1)[:, :k]
    else:
        (stored,) = _need(module, parts, "weight")
        out, k = stored.shape
        if args.kind == "float":
            if "weight_g_idx" in parts:
                raise QuantizedCheckpointError(
                    f"{module}.weight_g_idx: FP8 with act-order is not supported"
                )
            return _fp8(module, stored, scale)
        if stored.dtype != torch.int8:
            raise QuantizedCheckpointError(
                f"{module}.weight: {stored.dtype}; compressed-tensors INT{args.bits} wants int8"
            )
        q = (stored.to(torch.int16) + offset).to(torch.uint8)
    scales = _row_scales(f"{module}.weight_scale", scale, out, k)
    zeros: torch.Tensor | float = float(offset)
    if not args.symmetric:
        (zp,) = _need(module, parts, "weight_zero_point")
        packed = "weight_packed" in parts
        zeros = offset + _zero_points(module, zp, args.bits, out, scales.shape[1], packed)
    label = f"g{k // scales.shape[1]}" if scales.shape[1] > 1 else "per-channel"
    order = parts.get("weight_g_idx")
    source = f"compressed-tensors W{args.bits} {label}"
    return _weight(module, q, scales, zeros, source, args.bits, order)


def _zero_points(
    module: str, zp: torch.Tensor, bits: int, out: int, groups: int, packed: bool
) -> torch.Tensor:
    """compressed-tensors' signed zero points as float [out, groups]: packed along the outputs
    beside packed weights (per group or channel), else as they are (int8, or one a tensor)."""
    per_word = 32 // bits
    if packed and zp.dtype == torch.int32 and zp.shape[0] == -(-out // per_word):
        zp = _unpack(zp, bits, 0)[:out].to(torch.int16) - (1 << (bits - 1))
    if zp.numel() == 1:
        return zp.float().reshape(1, 1).expand(out, groups)
    if zp.numel() == out * groups:
        return zp.float().reshape(out, groups)
    raise QuantizedCheckpointError(
        f"{module}.weight_zero_point: shape {tuple(zp.shape)} {zp.dtype}; allowed: one a "
        f"tensor, or [{out}, {groups}] (packed along the outputs beside packed weights)"
    )


def _row_scales(name: str, scale: torch.Tensor, out: int, k: int) -> torch.Tensor:
    """A per-tensor, per-channel or per-group scale as [out, groups]."""
    if scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(out, 1)
    if scale.dim() == 2 and scale.shape[0] == out and k % scale.shape[1] == 0:
        return scale.float()
    if scale.dim() == 1 and scale.shape[0] == out:
        return scale.float()[:, None]
    raise QuantizedCheckpointError(
        f"{name}: shape {tuple(scale.shape)}; allowed: [1], [{out}, 1] or [{out}, groups] for a "
        f"[{out}, {k}] weight"
    )


def _vllm_fp8(
    module: str, parts: Mapping[str, torch.Tensor], block: tuple[int, int] | None
) -> QuantizedWeight:
    """vLLM's fp8 checkpoint: a scale a tensor, or per block of [bo, bi] (`weight_scale_inv`):
    each block's scale on its rows, groups of bi inputs."""
    _dtypes(module, parts, weight_scale="float", weight_scale_inv="float")
    (stored,) = _need(module, parts, "weight")
    if block is None:
        (scale,) = _need(module, parts, "weight_scale")
        return _fp8(module, stored, scale)
    (scale,) = _need(module, parts, "weight_scale_inv")
    out, k = stored.shape
    rows, cols = block
    if k % cols or scale.dim() != 2 or tuple(scale.shape) != (-(-out // rows), -(-k // cols)):
        raise QuantizedCheckpointError(
            f"{module}.weight_scale_inv: shape {tuple(scale.shape)}; blocks of {list(block)} "
            f"over a [{out}, {k}] weight want ({-(-out // rows)}, {k // cols}), and whole "
            "blocks of inputs"
        )
    return _fp8(module, stored, scale.float().repeat_interleave(rows, dim=0)[:out])


def _fp8(module: str, stored: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    if stored.dtype != torch.float8_e4m3fn:
        raise QuantizedCheckpointError(
            f"{module}.weight: {stored.dtype}; compressed-tensors FP8 wants float8_e4m3fn"
        )
    out, k = stored.shape
    if torch.isnan(stored.float()).any():  # a NaN byte: the kernels would read it as 480
        raise QuantizedCheckpointError(f"{module}.weight: FP8 values hold NaN")
    scales = _row_scales(f"{module}.weight_scale", scale, out, k)
    label = (
        "per-tensor"
        if scale.numel() == 1
        else ("per-channel" if scales.shape[1] == 1 else f"g{k // scales.shape[1]}")
    )
    g = k // scales.shape[1]
    return QuantizedWeight(
        stored.contiguous(), scales.contiguous(), torch.zeros_like(scales), g, 8,
        f"FP8 e4m3 {label}",
    )  # fmt: skip


# --- the stream of a folder's tensors ------------------------------------------------------


def quantized_tensors(
    scheme: CheckpointQuantization,
    names: Iterable[str],
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """`tensors` with each quantized linear's stored tensors put together into one
    `<module>.weight` QuantizedWeight, as soon as the last of them has come (`names`: every
    tensor the folder holds, to know which those are); the others as they are."""
    suffixes = scheme.components
    expected: dict[str, set[str]] = {}
    all_names = list(names)
    markers = tuple("." + m for m in scheme.markers)
    quantized = {n.rsplit(".", 1)[0] for n in all_names if n.endswith(markers)}
    for name in all_names:
        module, _, suffix = name.rpartition(".")
        if module in quantized and suffix in suffixes:
            expected.setdefault(module, set()).add(suffix)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, suffix = name.rpartition(".")
        if module not in expected or suffix not in expected[module]:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[suffix] = tensor
        if set(parts) == expected[module]:
            del pending[module]
            yield module + ".weight", assemble(scheme, module, parts)
