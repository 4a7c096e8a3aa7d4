"""The engine's own CPU kernels (cpu_kernels.c): built with the machine's C compiler on first
use, cached per machine and user (cache.py), called through ctypes.

Why C and not a torch extension: the kernels only need raw pointers, so the library builds in
a fraction of a second with no torch headers, the way inductor's CPU kernels are built. It is
compiled for this CPU (-march=native), so the cache key includes the CPU's flags along with
the source, compiler and options. Built by gcc, the library links libgomp by its soname,
which resolves to the copy torch's Linux wheels have already loaded: one OpenMP thread pool
for torch and these kernels (a clang build links its own libomp: two pools, both sized to
torch's thread count).

Nothing here is required: without a working compiler `load()` returns None and `reason()`
says why; callers fall back to torch ops.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.builtin.native.cache import FLAGS, SOURCES, NativeUnavailable, build, cache_dir

__all__ = [
    "FLAGS",
    "SOURCES",
    "Layout",
    "cache_dir",
    "info",
    "layout",
    "load",
    "off_reason",
    "open_library",
    "reason",
]

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


def _args(codes: str) -> list[Any]:
    """ctypes argument types from `struct`-like codes: p a pointer, q an int64, f a float."""
    return [{"p": _PTR, "q": _I64, "f": _F32}[code] for code in codes]


SIGNATURES = {  # function -> argument types (all return void)
    "decode_attention_f32": _args("pqppqpqpqqqqqfqqp"),
    "add_rms_norm_f32": _args("ppppqqfq"),
    "silu_and_mul_f32": _args("ppqqq"),
    "lora_bgmv_f32": _args("pppppqq"),
    "rope_and_cache_f32": _args("pqppppqpqqqqq"),
    "pack_linear_weight_f32": _args("pqqpq"),
    "linear_f32": _args("pppppqqqq"),
    # quant_kernels.c (wrapped by native/quant.py)
    "q4_linear_f32": _args("ppppppqqqqqqq"),
    "q4_linear_q8_f32": _args("ppppppqqqqqqq"),
    "g8_linear_f32": _args("ppppppqqqqqqq"),
    "g8_linear_q8_f32": _args("ppppppqqqqqqq"),
    "b8_linear_f32": _args("pppppqqqqqq"),
    "b8_linear_q8_f32": _args("pppppqqqqqq"),
    "q5_linear_f32": _args("pppppppqqqqqqq"),
    "q8_linear_f32": _args("pppppqqqqqq"),
    "f8_linear_f32": _args("pppppqqqqqq"),
    "prefill_attention_f32": _args("pqpqpqpqqqqfqqp"),
}

log = logging.getLogger(__name__)
_state: dict[str, Any] = {}


@dataclass(frozen=True)
class Layout:
    """What the library was compiled for (cpu_kernels.c picks it per instruction set): the
    packed layout of its GEMM, which `pack_linear_weight` and `linear` follow."""

    isa: str  # "avx512", "avx2", "avx" or "portable"
    panel: int  # weight rows per panel (32 with AVX-512, 16 with AVX2)
    row_block: int  # input rows per packed block (8 with AVX-512, 6 with AVX2)


def open_library(path: str | Path) -> tuple[ctypes.CDLL, Layout]:
    """A built library with its functions' signatures set, and the layout it was built for."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.kernel_isa.argtypes, lib.kernel_isa.restype = [], ctypes.c_char_p
    lib.linear_layout.argtypes, lib.linear_layout.restype = [_PTR], None
    for name in ("quant_paths", "quant_q8_activation_paths", "team_default_spin_ns"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int64
    # decode_layers.c (engines/builtin/decode_program.py): 0, or -1 without scratch memory
    program_args: list[Any] = [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64]
    program_args += [_PTR, _PTR]  # seq_lens, lora_slots
    lib.decode_layers_f32.argtypes = [*program_args, _I64, _I64]
    lib.decode_layers_f32.restype = ctypes.c_int64
    # moe_experts.c (engines/builtin/moe.py): 0, or -1 without scratch memory
    lib.moe_experts_f32.argtypes = _args("ppqpqqppppqq")
    lib.moe_experts_f32.restype = ctypes.c_int64
    sizes = (ctypes.c_int64 * 2)()
    lib.linear_layout(ctypes.addressof(sizes))
    return lib, Layout(lib.kernel_isa().decode(), sizes[0], sizes[1])


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (see `reason()`). Built once per machine, loaded once per
    process, and only after the cached library matched the size and hash of its build."""
    if "lib" in _state:
        return _state["lib"]
    lib, built, kernel_layout = None, None, None
    try:
        built = build()
        lib, kernel_layout = open_library(built.path)
        _state["reason"] = None
    except Exception as e:  # whatever stops the build or the load, the engine runs without it
        lib = None
        _state["reason"] = (
            str(e) if isinstance(e, NativeUnavailable) else (f"{type(e).__name__}: {e}")
        )
        log.warning("the engine's C kernels are off, torch ops instead: %s", _state["reason"])
    _state["lib"] = lib
    _state["built"] = built
    _state["layout"] = kernel_layout
    return lib


def layout() -> Layout:
    """The loaded library's instruction set and GEMM layout (raises where it is not loaded)."""
    _lib()
    return _state["layout"]


def reason() -> str | None:
    """Why `load()` returned None (None when it did not)."""
    load()
    return _state["reason"]


def info(load_now: bool = True) -> dict[str, Any]:
    """Which library was loaded and how it got there, for describe() and provenance;
    `load_now=False`: as things stand, without building or loading anything."""
    if load_now:
        load()
    built, kernel_layout = _state.get("built"), _state.get("layout")
    return {
        "loaded": _state.get("lib") is not None,
        "isa": None if kernel_layout is None else kernel_layout.isa,
        "library": None if built is None else str(built.path),
        "sha256": None if built is None else built.sha256,
        "cache": None if built is None else built.how,
        "reason": _state.get("reason"),
    }


def off_reason(
    enabled: bool, compile: bool, device: torch.device, dtype: torch.dtype | None
) -> str | None:
    """Why an engine with these settings runs without the kernels; None when it uses them.
    `dtype` None: kernels that take any float dtype (the INT8/INT4 linears)."""
    if not enabled:
        return "engine.native_kernels=false"
    if compile:
        return "engine.compile=true (inductor fuses these ops itself)"
    if device.type != "cpu":
        return f"device {device} (the kernels are CPU-only)"
    if dtype is not None and dtype != torch.float32:
        return f"dtype {str(dtype).removeprefix('torch.')} (the kernels are float32-only)"
    return reason()


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {reason()}")
    return lib


def _run(kernel: str, *args: object) -> Any:
    """Call a kernel; while torch.profiler records, inside a range named `inferlab::<kernel>`,
    so that profiles (profile/ops.md) list the C kernels as operators of their own (the range
    costs ~7 us a call, so only then)."""
    fn = getattr(_lib(), kernel)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(f"inferlab::{kernel}"):
            return fn(*args)
    return fn(*args)


#: kernels.h's KV_*: how a KV cache holds its values
KV_FLOAT32, KV_E4M3, KV_E5M2 = 0, 1, 2
_KV_FORMATS = {None: KV_FLOAT32, torch.float8_e4m3fn: KV_E4M3, torch.float8_e5m2: KV_E5M2}


def kv_format(fp8: torch.dtype | None) -> int:
    """The kernels' number for a cache of float32 values (None) or the bytes of `fp8`."""
    return _KV_FORMATS[fp8]


def _kv_cache_dtype(kv_format: int) -> torch.dtype:
    """What the cache tensors of `kv_format` hold: float32, or FP8 values as bytes."""
    if kv_format not in _KV_FORMATS.values():
        raise ValueError(f"kv_format: {kv_format}; allowed: 0 (float32), 1 (e4m3), 2 (e5m2)")
    return torch.float32 if kv_format == KV_FLOAT32 else torch.uint8


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors as they are: float32 on the CPU,
    contiguous (the elementwise kernels' condition; callers use torch ops otherwise)."""
    return all(t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)


def _indices(name: str, t: torch.Tensor, dtype: torch.dtype, length: int) -> None:
    if (
        t.dtype != dtype
        or t.device.type != "cpu"
        or not t.is_contiguous()
        or t.dim() != 1
        or t.shape[0] < length
    ):
        raise ValueError(
            f"{name}: expected a contiguous CPU {dtype} vector of >= {length} "
            f"entries, got {t.dtype} {tuple(t.shape)} on {t.device}"
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension of x [T, N]. With `residual`, normalizes x + residual
    and leaves that sum in `residual` (in place): the residual stream for the next block."""
    others = () if residual is None else (residual,)
    if (
        not takes(x, weight, *others)
        or x.dim() != 2
        or weight.shape != x.shape[1:]
        or any(r.shape != x.shape for r in others)
    ):
        raise ValueError(
            "rms_norm: x [T, N], weight [N] and residual [T, N] must be contiguous CPU float32"
        )
    out = torch.empty_like(x)
    rows, width = x.shape
    _run(
        "add_rms_norm_f32",
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        width,
        eps,
        torch.get_num_threads(),
    )
    return out


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the layout `linear` multiplies by: [ceil(N / P), K, P], panels of P
    rows transposed (panels[p, k, j] = weight[P p + j, k]; the last panel zero-padded), with
    P = `layout().panel`, the panel width this build's kernel takes."""
    if not takes(weight) or weight.dim() != 2:
        raise ValueError(
            "pack_linear_weight: weight must be a contiguous CPU float32 [N, K], "
            f"got {weight.dtype} {tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    panel = layout().panel
    panels = weight.new_empty(-(-out_features // panel), in_features, panel)
    _run(
        "pack_linear_weight_f32",
        weight.data_ptr(),
        out_features,
        in_features,
        panels.data_ptr(),
        torch.get_num_threads(),
    )
    return panels


def linear(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ weight^T (+ bias [out_features]) -> [T, out_features], with the weight as
    `pack_linear_weight` packed it."""
    others = () if bias is None else (bias,)
    sizes = layout()
    panel, row_block = sizes.panel, sizes.row_block
    if (
        not takes(x, panels, *others)
        or x.dim() != 2
        or panels.dim() != 3
        or panels.shape[1:] != (x.shape[1], panel)
        or panels.shape[0] != -(-out_features // panel)
        or any(b.shape != (out_features,) for b in others)
    ):
        raise ValueError(
            f"linear: x [T, K], panels [ceil({out_features} / {panel}), K, "
            f"{panel}] and bias [{out_features}] must be contiguous CPU float32, "
            f"got {tuple(x.shape)} and {tuple(panels.shape)}"
        )
    rows, width = x.shape
    out = x.new_empty(rows, out_features)
    packed_x = x.new_empty(-(-rows // row_block) * row_block * width)
    _run(
        "linear_f32",
        x.data_ptr(),
        panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        packed_x.data_ptr(),
        rows,
        width,
        out_features,
        torch.get_num_threads(),
    )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    if not takes(gate_up) or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError("silu_and_mul: gate_up must be a contiguous CPU float32 [T, 2I]")
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    _run(
        "silu_and_mul_f32",
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        width // 2,
        torch.get_num_threads(),
    )
    return out


class LinearWeights(ctypes.Structure):  # kernels.h
    _fields_ = [
        ("kind", _I64),
        ("weight", _PTR),
        ("scale", _PTR),
        ("minv", _PTR),
        ("bias", _PTR),
        ("in_features", _I64),
        ("out_features", _I64),
        ("group_size", _I64),
        ("rows_max", _I64),
        ("bits", _PTR),
    ]


#: LinearWeights.kind: kernels.h's LINEAR_*
(
    LINEAR_DENSE,
    LINEAR_INT8,
    LINEAR_INT4,
    LINEAR_INT4_A8,
    LINEAR_INT8G,
    LINEAR_INT8G_A8,
    LINEAR_INT8B,
    LINEAR_INT8B_A8,
    LINEAR_INT5B,
    LINEAR_INT5B_A8,
    LINEAR_FP8,
) = range(11)


#: the experts' arrays moe_experts has checked (by id, each held so that its id is not reused)
_CHECKED_EXPERTS: dict[tuple[int, int], tuple[Any, Any]] = {}


def int4_group_fits(group_size: int, in_features: int) -> bool:
    """Whether the INT4 kernels take groups of `group_size` inputs: they find a block's group
    by a shift, so 32 x a power of two (dividing the inputs), or one group a row."""
    if group_size < 32 or group_size % 32 or in_features % group_size:
        return False
    return group_size == in_features or group_size & (group_size - 1) == 0


def _check_linear_weights(layer: LinearWeights) -> None:
    """A ValueError for a struct the kernels would crash on: an unknown kind, a missing
    pointer, INT4 groups that do not divide the inputs."""
    if not 0 <= layer.kind <= LINEAR_FP8:
        raise ValueError(f"LinearWeights.kind: {layer.kind} is invalid; allowed: 0..{LINEAR_FP8}")
    quantized = layer.kind != LINEAR_DENSE
    per_row = (LINEAR_DENSE, LINEAR_INT8, LINEAR_FP8, LINEAR_INT8B, LINEAR_INT8B_A8)
    grouped = layer.kind not in per_row
    blocks = layer.kind in (LINEAR_INT8B, LINEAR_INT8B_A8, LINEAR_INT5B, LINEAR_INT5B_A8)
    if blocks and (layer.group_size != 32 or layer.in_features % 32):
        raise ValueError(f"LinearWeights.group_size: {layer.group_size}; INT8/INT5 blocks: 32")
    if layer.kind in (LINEAR_INT5B, LINEAR_INT5B_A8) and not layer.bits:
        raise ValueError("LinearWeights: INT5 blocks with a NULL bits pointer")
    int8_inputs = layer.kind in (LINEAR_INT4_A8, LINEAR_INT8G_A8, LINEAR_INT8B_A8, LINEAR_INT5B_A8)
    if int8_inputs and layer.in_features % 32:  # rows are quantized in whole blocks of 32
        raise ValueError(
            f"LinearWeights.in_features: {layer.in_features}; INT8 activations: a multiple of 32"
        )
    if layer.kind in (LINEAR_INT8G, LINEAR_INT8G_A8) and layer.group_size not in (16, 32):
        raise ValueError(f"LinearWeights.group_size: {layer.group_size}; grouped INT8: 16|32")
    if not layer.weight or (quantized and not layer.scale) or (grouped and not layer.minv):
        raise ValueError("LinearWeights: a NULL weight, scale or minimum pointer")
    if layer.kind in (LINEAR_INT4, LINEAR_INT4_A8) and not int4_group_fits(
        layer.group_size, layer.in_features
    ):
        raise ValueError(
            f"LinearWeights.group_size: {layer.group_size} is invalid; INT4: 32 x a power of "
            f"two that divides in_features ({layer.in_features}), or in_features"
        )
    unit = 16 if layer.kind in (LINEAR_INT8G, LINEAR_INT8G_A8) else 32
    if grouped and (
        layer.group_size < unit or layer.group_size % unit or layer.in_features % layer.group_size
    ):
        raise ValueError(
            f"LinearWeights.group_size: {layer.group_size} is invalid; allowed: a multiple of "
            f"{unit} that divides in_features ({layer.in_features})"
        )


def moe_experts(
    gate_up: ctypes.Array[LinearWeights],
    down: ctypes.Array[LinearWeights],
    x: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """A mixture-of-experts layer's experts in one call (moe_experts.c): expert e's
    (token, expert) pairs are offsets[e] .. offsets[e + 1] - 1, `rows` their rows of x
    [T, hidden] and `weights` their routing weights; out [T, hidden] += each pair's weight x
    its expert's silu MLP of its row, expert after expert."""
    experts = len(gate_up) if isinstance(gate_up, ctypes.Array) else 0
    if (
        not experts
        or not isinstance(down, ctypes.Array)
        or len(down) != experts
        or not all(isinstance(w, LinearWeights) for w in (gate_up[0], down[0]))
    ):
        raise ValueError("moe_experts: gate_up and down: ctypes arrays of E >= 1 LinearWeights")
    if not takes(x, weights, out) or x.dim() != 2 or out.shape != x.shape or weights.dim() != 1:
        raise ValueError("moe_experts: x and out [T, hidden], weights [pairs]: CPU float32")
    _indices("moe_experts: offsets", offsets, torch.int64, experts + 1)
    bounds = offsets[: experts + 1].tolist()
    pairs = bounds[-1]
    if bounds[0] < 0 or any(b > a for a, b in zip(bounds[1:], bounds, strict=False)):
        raise ValueError(f"moe_experts: offsets {bounds} must be >= 0 and ascending")
    _indices("moe_experts: rows", rows, torch.int64, pairs)
    hidden, inter = x.shape[1], gate_up[0].out_features // 2
    if (
        weights.shape[0] < pairs
        or any(g.in_features != hidden or g.out_features != 2 * inter for g in gate_up)
        or any(d.in_features != inter or d.out_features != hidden for d in down)
        or (pairs and not 0 <= int(rows.min()) <= int(rows.max()) < x.shape[0])
    ):
        raise ValueError("moe_experts: the experts' sizes, rows or weights do not match x")
    if (id(gate_up), id(down)) not in _CHECKED_EXPERTS:  # the structs' fields, once per pair
        for layer in (*gate_up, *down):
            _check_linear_weights(layer)
        _CHECKED_EXPERTS[id(gate_up), id(down)] = (gate_up, down)  # held: the ids stay theirs
    lib = _lib()
    status = _run(
        "moe_experts_f32",
        ctypes.addressof(gate_up), ctypes.addressof(down), experts,
        x.data_ptr(), hidden, inter, offsets.data_ptr(), rows.data_ptr(),
        weights.data_ptr(), out.data_ptr(), torch.get_num_threads(), lib.team_default_spin_ns(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("moe_experts: the kernel's scratch memory could not be allocated")


class LoraWeights(ctypes.Structure):  # kernels.h
    _fields_ = [
        ("a", _PTR),
        ("b", _PTR),
        ("ranks", _PTR),
        ("part_ends", _PTR),
        ("parts", _I64),
        ("R", _I64),
        ("in_features", _I64),
        ("out_features", _I64),
    ]


def lora_weights(
    a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, part_ends: torch.Tensor
) -> LoraWeights:
    """The C view of a layer's LoRA slots: a [S, parts * R, in] and b [S, R, out] (B
    transposed) contiguous CPU float32, ranks [S] int32, part_ends [parts] int64. It points into
    the tensors: they must outlive it and keep their storage (the slots write in place)."""
    parts = part_ends.numel()
    if (
        not takes(a, b)
        or ranks.dtype != torch.int32
        or part_ends.dtype != torch.int64
        or a.shape[1] != parts * b.shape[1]
    ):
        raise ValueError("lora_weights: contiguous CPU float32 a, b; int32 ranks; int64 ends")
    return LoraWeights(
        a.data_ptr(), b.data_ptr(), ranks.data_ptr(), part_ends.data_ptr(), parts,
        b.shape[1], a.shape[2], b.shape[2],
    )  # fmt: skip


def lora_bgmv(
    weights: LoraWeights, x: torch.Tensor, y: torch.Tensor, slot_of_row: torch.Tensor
) -> None:
    """y [T, out] += each row's LoRA delta, in place (cpu_kernels.c lora_bgmv_f32): x [T, in]
    float32, slot_of_row [T] int32 (-1: the base model), `weights` from `lora_weights`."""
    rows, fan_in = x.shape
    if (
        not takes(x, y)
        or slot_of_row.dtype != torch.int32
        or (fan_in, y.shape[1]) != (weights.in_features, weights.out_features)
    ):
        raise ValueError("lora_bgmv: contiguous CPU float32 x, y of the layer's sizes; int32 slots")
    scratch = x.new_empty(rows, weights.parts * weights.R)
    _run(
        "lora_bgmv_f32",
        ctypes.byref(weights),
        x.data_ptr(),
        y.data_ptr(),
        slot_of_row.data_ptr(),
        scratch.data_ptr(),
        rows,
        torch.get_num_threads(),
    )


def rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor | None,
    max_position: int | None = None,
    kv_format: int = KV_FLOAT32,
) -> None:
    """In place on qkv [T, (heads + 2 kv_heads) head_dim]: rotary embedding of the query and
    key heads at `positions` (int64) from `table` [max_positions, head_dim] (cos | sin halves);
    then, with a cache, each token's K and V stored at its flat slot (int64; < 0: not stored)
    of k_cache/v_cache [..., kv_heads, head_dim] (float32, or with an FP8 `kv_format` the
    values' bytes, rounded as torch rounds). `max_position`: the largest position, when the
    caller knows it (else read from `positions`); slots are range-checked only then."""
    tokens = qkv.shape[0]
    caches: tuple[torch.Tensor, ...] = ()
    if k_cache is not None:
        assert v_cache is not None, "rope_and_cache: a K cache without its V cache"
        caches = (k_cache, v_cache)
    stored = _kv_cache_dtype(kv_format)
    if (
        not takes(qkv, table)
        or not all(c.dtype == stored and c.is_cpu and c.is_contiguous() for c in caches)
        or qkv.dim() != 2
        or table.dim() != 2
        or head_dim % 2
        or table.shape[1] != head_dim
        or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim
        or any(
            c.shape[-2:] != (kv_heads, head_dim) or c.shape != k_cache.shape  # type: ignore[union-attr]
            for c in caches
        )
    ):
        raise ValueError(
            "rope_and_cache: unsupported tensors (contiguous CPU float32 qkv "
            f"[T, (h + 2 kvh) d], table [positions, d], {stored} caches [..., kvh, d])"
        )
    _indices("rope_and_cache positions", positions, torch.int64, tokens)
    if tokens == 0:
        return
    if k_cache is not None:
        assert slots is not None
        _indices("rope_and_cache slots", slots, torch.int64, tokens)
    if max_position is None:
        max_position = int(positions.max())
        if int(positions.min()) < 0:
            raise ValueError("rope_and_cache: negative position")
        if k_cache is not None and int(slots[:tokens].max()) >= k_cache.numel() // (  # type: ignore[index]
            kv_heads * head_dim
        ):
            raise ValueError("rope_and_cache: a slot past the cache")
    if max_position >= table.shape[0]:
        raise ValueError(
            f"rope_and_cache: position {max_position} past the rotary table "
            f"({table.shape[0]} positions)"
        )
    _run(
        "rope_and_cache_f32",
        qkv.data_ptr(),
        qkv.stride(0),
        positions.data_ptr(),
        table.data_ptr(),
        None if k_cache is None else k_cache.data_ptr(),
        None if v_cache is None else v_cache.data_ptr(),
        kv_format,
        None if slots is None else slots.data_ptr(),
        tokens,
        heads,
        kv_heads,
        head_dim,
        torch.get_num_threads(),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    max_seq_len: int | None = None,
    kv_format: int = KV_FLOAT32,
) -> torch.Tensor:
    """One query per sequence over its cached keys, read in place from the blocks.

    q [B, h, d] float32 (rows may be strided, heads and d contiguous); k_cache/v_cache
    [num_blocks, block_size, kv_heads, d] contiguous, float32 or with an FP8 `kv_format` the
    values' bytes (widened a row at a time); block_tables [B, >=blocks] int32
    (rows contiguous); seq_lens [B] int32, each sequence's keys (its query is the last
    position); `window`: only the last `window` keys are visible. `max_seq_len`: the longest
    context, when the caller knows it (else read from `seq_lens`, and the block ids are
    range-checked too). Returns [B, h, d]."""
    batch, heads, dim = q.shape
    _, block_size, kv_heads, kdim = k_cache.shape
    stored = _kv_cache_dtype(kv_format)
    if not (q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == stored):
        raise TypeError(f"decode_attention: q must be float32 and the KV cache {stored}")
    if (
        kdim != dim
        or heads % kv_heads
        or q.stride(1) != dim
        or q.stride(2) != 1
        or q.device.type != "cpu"
        or v_cache.shape != k_cache.shape
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or block_tables.dtype != torch.int32
        or block_tables.stride(1) != 1
        or block_tables.shape[0] < batch
    ):
        raise ValueError(
            "decode_attention: unsupported shapes, strides or dtypes: q "
            f"{tuple(q.shape)}/{q.stride()}, cache {tuple(k_cache.shape)}, "
            f"tables {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    _indices("decode_attention seq_lens", seq_lens, torch.int32, batch)
    out = torch.empty(batch, heads, dim, dtype=q.dtype)
    if batch == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens[:batch].max())
        blocks = block_tables[:batch, : -(-max_seq_len // block_size)]
        if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= k_cache.shape[0]):
            raise ValueError("decode_attention: a block id past the cache")
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"decode_attention: a context of {max_seq_len} tokens exceeds the "
            f"block tables ({block_tables.shape[1]} x {block_size})"
        )
    _run(
        "decode_attention_f32",
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        kv_format,
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        block_size,
        scale,
        window or 0,
        torch.get_num_threads(),
        out.data_ptr(),
    )
    return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of whole prompts over their own keys (no cached context).

    q [T, h, d], k/v [T, kvh, d] float32 on the CPU, heads and d contiguous (token strides
    free: views of the fused QKV rows); starts [S + 1] int32, ascending from 0 to T: sequence s
    is rows starts[s]:starts[s + 1]; `window`: query i sees keys i - window + 1 .. i.
    Returns [T, h, d], written into `out` when given (contiguous float32 of that shape)."""
    tokens, heads, dim = q.shape
    if not (q.dtype == k.dtype == v.dtype == torch.float32):
        raise TypeError("prefill_attention: q, k and v must be float32")
    if (
        k.shape != v.shape
        or k.shape[0] != tokens
        or k.shape[2] != dim
        or heads % k.shape[1]
        or any(t.device.type != "cpu" or t.stride(2) != 1 or t.stride(1) != dim for t in (q, k, v))
    ):
        raise ValueError(
            "prefill_attention: unsupported shapes or strides: q "
            f"{tuple(q.shape)}/{q.stride()}, k {tuple(k.shape)}/{k.stride()}, "
            f"v {tuple(v.shape)}/{v.stride()}"
        )
    _indices("prefill_attention starts", starts, torch.int32, 1)
    bounds = starts.tolist()
    if bounds[0] != 0 or bounds[-1] != tokens or any(a > b for a, b in itertools.pairwise(bounds)):
        raise ValueError(
            f"prefill_attention: starts must ascend from 0 to {tokens}, got "
            f"{bounds[:4]}...{bounds[-1:]}"
        )
    if out is None:
        out = torch.empty(tokens, heads, dim, dtype=q.dtype)
    elif not takes(out) or out.shape != q.shape:
        raise ValueError(
            f"prefill_attention: out must be a contiguous CPU float32 "
            f"{tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    _run(
        "prefill_attention_f32",
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        starts.data_ptr(),
        len(bounds) - 1,
        heads,
        k.shape[1],
        dim,
        scale,
        window or 0,
        torch.get_num_threads(),
        out.data_ptr(),
    )
    return out
