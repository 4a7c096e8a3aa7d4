"""The engine's INT8 and INT4 linear kernels (quant_kernels.c) from Python: the weight layouts
they stream, and y = x W^T (+ bias) for float32, bfloat16 or float16 inputs.

Layouts (made once, at load, by engines/builtin/layers/quant.py):
- INT8: q int8 [N, K], scales float32 [N]: W = q * scale per row.
- FP8: q float8_e4m3fn [N, K] (read as its bytes), scales float32 [N]: W = value * scale per
  row (vLLM's FP8 weights: per channel, or per tensor with the scale on every row).
- INT5 blocks: the INT4 layout's nibbles [N, K / 2], each level's fifth bit as an int32 word
  per block of 32 [N, K / 32] (bit i: weight i's), d and m float16 [N, K / 32]:
  W = (nibble + 16 bit) * d + m (llama.cpp's Q5_0 with m = -16 d, its Q5_1 as it is).
- INT8 blocks: q int8 [N, K], d float16 [N, K / 32]: W = q * d per block of 32 inputs
  (llama.cpp's Q8_0 as it is; its Q5_0 as q - 16), as few bytes as the file's Q8_0.
- grouped INT8: q uint8 [N, K], scales and mins float32 [N, K / g]: W = q * scale + min per
  group of g inputs (16 or 32): every GGUF type of 5 to 8 bits, exactly
  (models/gguf_blocks.py, engines/builtin/layers/checkpoint_quant.py).
- INT4: nibbles uint8 [N, K / 2] (`pack_int4`: per block of 32 inputs, byte j holds input j in
  its low 4 bits and input 16 + j in its high ones, llama.cpp's order), scales and mins float32
  [N, K / g]: W = q * scale + min per group of g inputs (g a multiple of 32).

Which kernel runs (quant_kernels.c says how each works):
- up to `rows_max(bits, activations)` input rows (decode, small batches): the rows kernels, at
  the widest vector width this build has (`widest_path()`), or the one `path` forces (tests run
  each);
- more rows (prefill, larger batches): a weight tile dequantized to float32 and the float32
  GEMM's panel kernel.
INT4 takes `activations="int8"` too: each input row quantized per block of 32 values and integer
dot products (llama.cpp's Q4_1 x Q8_1 scheme) in the rows kernels; the float tile kernel above
its crossover either way.

Other input dtypes are converted to float32 on the way in and back on the way out: the kernels
read weights, which dominate, and compute in float32 whatever the activations' dtype.
"""

from __future__ import annotations

import torch

from engines.builtin import native

# Rows up to which the rows kernels beat dequantize-tile + GEMM, per (bits, activations): the
# rows kernels widen the weights once per pair of input rows, the tile kernel once per call, so
# the cheaper the widening (INT8 < INT4 with INT8 activations < INT4 nibbles to floats) the
# later the tile wins. SmolLM2-135M's four block linears on a 2-core Zen 3, 1 and 2 threads
# (scripts/bench_quant_crossover.py), rows / tile time: INT4 0.95 / 0.80 at 4 rows, 1.44 / 1.12
# at 6; INT4 + INT8 activations 0.87 / 0.86 at 8, 1.06 / 1.14 at 12; INT8 1.03 / 0.97 at 12,
# 1.37 / 0.96 at 16.
#: `bits` of the grouped INT8 and INT8-blocks layouts in ROWS_MAX and describe_kernel (8 is
#: per-channel INT8)
GROUPED_INT8, INT8_BLOCKS, INT5_BLOCKS, FP8 = 9, 10, 11, 12
ROWS_MAX = {
    (8, "float"): 12,
    (FP8, "float"): 12,
    (4, "float"): 4,
    (4, "int8"): 8,
    (GROUPED_INT8, "float"): 8,
    (GROUPED_INT8, "int8"): 8,
    (INT8_BLOCKS, "float"): 12,
    (INT8_BLOCKS, "int8"): 8,
    (INT5_BLOCKS, "float"): 4,
    (INT5_BLOCKS, "int8"): 8,
}

# quant_kernels.c's QUANT_PATH_*: the rows kernels' vector width
PATHS = {"auto": 0, "portable": 1, "vec4": 2, "vec8": 3, "vec16": 4}
ACTIVATIONS = ("float", "int8")
_WIDTH_NAMES = {"vec4": "4 floats", "vec8": "8 floats, AVX2", "vec16": "16 floats, AVX-512"}


def _available(mask: int) -> list[str]:
    return [name for name, bit in PATHS.items() if bit and mask & (1 << bit)]


def paths(activations: str = "float") -> list[str]:
    """The rows-kernel paths this build can run, narrowest first (for `path`)."""
    lib = native._lib()
    if activations == "int8":
        return _available(lib.quant_q8_activation_paths())
    return _available(lib.quant_paths())


def widest_path(activations: str = "float") -> str:
    """The path `path="auto"` runs."""
    return paths(activations)[-1]


def rows_max(bits: int, activations: str = "float") -> int:
    """The most input rows an INT`bits` layer multiplies through the rows kernels."""
    return ROWS_MAX[bits, activations]


def describe_kernel(bits: int, activations: str = "float") -> str:
    """How this build multiplies by an INT`bits` layer (GROUPED_INT8: grouped INT8), for
    describe()["linear_methods"]."""
    path = widest_path(activations)
    if bits in (4, GROUPED_INT8, INT8_BLOCKS, INT5_BLOCKS) and activations == "int8":
        kind = {"portable": "portable", "vec16": "AVX-512 VNNI"}.get(path, "AVX2")
        rows = f"int8 activations, integer dot products ({kind})"
    else:
        rows = f"float FMA ({_WIDTH_NAMES.get(path, path)})"
    return (
        f"native: <= {rows_max(bits, activations)} rows {rows}; "
        "more rows dequantized tiles + the float32 GEMM"
    )


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers 0..15 (K a multiple of 32) -> the kernels' nibbles [N, K / 2]."""
    out_features, in_features = q.shape
    if in_features % 32:
        raise ValueError(f"pack_int4: in_features={in_features} is not a multiple of 32")
    halves = q.to(torch.uint8).reshape(out_features, in_features // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out_features, -1).contiguous()


def unpack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [N, K / 2] -> q [N, K] (uint8)."""
    out_features = nibbles.shape[0]
    blocks = nibbles.reshape(out_features, -1, 1, 16)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).reshape(out_features, -1)


def _float_input(x: torch.Tensor, in_features: int, name: str) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != in_features or x.device.type != "cpu":
        raise ValueError(
            f"{name}: x must be a CPU [rows, {in_features}] tensor, got "
            f"{tuple(x.shape)} on {x.device}"
        )
    return x.to(torch.float32).contiguous()


def _path(path: str, activations: str = "float") -> int:
    if path == "auto":  # every call in the engine: no lookup
        return 0
    if path not in paths(activations):
        raise ValueError(
            f"path: {path!r} is not available in this build; allowed: "
            f"auto|{'|'.join(paths(activations))}"
        )
    return PATHS[path]


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(
            f"{name}: expected a contiguous CPU {dtype} {shape}, got {t.dtype} {tuple(t.shape)}"
        )


def _multiply(
    name: str,
    kernel: str,
    x: torch.Tensor,
    in_features: int,
    out_features: int,
    weights: list[int | None],
    options: list[int],
) -> torch.Tensor:
    """y = x W^T by the C entry point `kernel` (the weight's pointers, then the output, the
    sizes, its `options` and the threads), in x's dtype."""
    x32 = _float_input(x, in_features, name)
    y = torch.empty(x32.shape[0], out_features, dtype=torch.float32)
    native._run(
        kernel,
        x32.data_ptr(),
        *weights,
        y.data_ptr(),
        x32.shape[0],
        in_features,
        out_features,
        *options,
        torch.get_num_threads(),
    )
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def int4_linear(
    x: torch.Tensor,
    nibbles: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    activations: str = "float",
    path: str = "auto",
    max_rows: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias [N]) -> [M, N] in x's dtype, W as the INT4 layout above.
    `max_rows`: the most rows the rows kernels take (0: always the tile kernel; None: the
    measured crossover, `rows_max`)."""
    out_features, half = nibbles.shape
    in_features = 2 * half
    if not native.int4_group_fits(group_size, in_features):
        raise ValueError(
            f"int4_linear: group_size={group_size} must be 32 x a power of two that divides "
            f"in_features={in_features}, or in_features itself"
        )
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: {activations!r}; allowed: {'|'.join(ACTIVATIONS)}")
    groups = in_features // group_size
    _check("int4_linear nibbles", nibbles, torch.uint8, (out_features, half))
    _check("int4_linear scales", scales, torch.float32, (out_features, groups))
    _check("int4_linear mins", mins, torch.float32, (out_features, groups))
    if bias is not None:
        _check("int4_linear bias", bias, torch.float32, (out_features,))
    return _multiply(
        "int4_linear",
        "q4_linear_q8_f32" if activations == "int8" else "q4_linear_f32",
        x,
        in_features,
        out_features,
        [
            nibbles.data_ptr(),
            scales.data_ptr(),
            mins.data_ptr(),
            None if bias is None else bias.data_ptr(),
        ],
        [
            group_size,
            rows_max(4, activations) if max_rows is None else max_rows,
            _path(path, activations),
        ],
    )


def int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    path: str = "auto",
    max_rows: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias [N]) -> [M, N] in x's dtype, W as the INT8 layout above
    (`max_rows` as for `int4_linear`)."""
    return _per_row("int8_linear", "q8_linear_f32", 8, x, q, scales, bias, path, max_rows)


def fp8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    path: str = "auto",
    max_rows: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias [N]) -> [M, N] in x's dtype, W as the FP8 layout above
    (`max_rows` as for `int4_linear`)."""
    return _per_row("fp8_linear", "f8_linear_f32", FP8, x, q, scales, bias, path, max_rows)


def _per_row(
    name: str, kernel: str, bits: int, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
    bias: torch.Tensor | None, path: str, max_rows: int | None,
) -> torch.Tensor:  # fmt: skip
    """The layouts of a byte a weight and a scale a row: INT8 (`bits` 8) and FP8."""
    out_features, in_features = q.shape
    _check(f"{name} q", q, torch.float8_e4m3fn if bits == FP8 else torch.int8, q.shape)
    _check(f"{name} scales", scales, torch.float32, (out_features,))
    if bias is not None:
        _check(f"{name} bias", bias, torch.float32, (out_features,))
    return _multiply(
        name,
        kernel,
        x,
        in_features,
        out_features,
        [q.data_ptr(), scales.data_ptr(), None if bias is None else bias.data_ptr()],
        [rows_max(bits) if max_rows is None else max_rows, _path(path)],
    )


def int8g_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    activations: str = "float",
    path: str = "auto",
    max_rows: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias [N]) -> [M, N] in x's dtype, W as the grouped INT8 layout above
    (`activations` int8 needs K a multiple of 32; `max_rows` as for `int4_linear`)."""
    out_features, in_features = q.shape
    if group_size not in (16, 32) or in_features % group_size:
        raise ValueError(
            f"int8g_linear: group_size={group_size} must be 16 or 32 and divide "
            f"in_features={in_features}"
        )
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: {activations!r}; allowed: {'|'.join(ACTIVATIONS)}")
    if activations == "int8" and in_features % 32:
        raise ValueError(
            f"int8g_linear: int8 activations need in_features % 32 == 0, got {in_features}"
        )
    groups = in_features // group_size
    _check("int8g_linear q", q, torch.uint8, (out_features, in_features))
    _check("int8g_linear scales", scales, torch.float32, (out_features, groups))
    _check("int8g_linear mins", mins, torch.float32, (out_features, groups))
    if bias is not None:
        _check("int8g_linear bias", bias, torch.float32, (out_features,))
    return _multiply(
        "int8g_linear",
        "g8_linear_q8_f32" if activations == "int8" else "g8_linear_f32",
        x,
        in_features,
        out_features,
        [
            q.data_ptr(),
            scales.data_ptr(),
            mins.data_ptr(),
            None if bias is None else bias.data_ptr(),
        ],
        [
            group_size,
            rows_max(GROUPED_INT8, activations) if max_rows is None else max_rows,
            _path(path, activations),
        ],
    )


def int8b_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    d: torch.Tensor,
    bias: torch.Tensor | None = None,
    activations: str = "float",
    path: str = "auto",
    max_rows: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias [N]) -> [M, N] in x's dtype, W as the INT8-blocks layout above
    (K a multiple of 32; `max_rows` as for `int4_linear`)."""
    out_features, in_features = q.shape
    if in_features % 32:
        raise ValueError(f"int8b_linear: in_features={in_features} is not a multiple of 32")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: {activations!r}; allowed: {'|'.join(ACTIVATIONS)}")
    _check("int8b_linear q", q, torch.int8, (out_features, in_features))
    _check("int8b_linear d", d, torch.float16, (out_features, in_features // 32))
    if bias is not None:
        _check("int8b_linear bias", bias, torch.float32, (out_features,))
    return _multiply(
        "int8b_linear",
        "b8_linear_q8_f32" if activations == "int8" else "b8_linear_f32",
        x,
        in_features,
        out_features,
        [
            q.data_ptr(),
            d.data_ptr(),
            None if bias is None else bias.data_ptr(),
        ],
        [
            rows_max(INT8_BLOCKS, activations) if max_rows is None else max_rows,
            _path(path, activations),
        ],
    )


def pack_int5(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] integers 0..31 (K a multiple of 32) -> INT5 blocks' (nibbles [N, K / 2],
    fifth bits int32 [N, K / 32])."""
    out_features, in_features = q.shape
    nibbles = pack_int4(q & 15)
    fifth = ((q.to(torch.int64) >> 4) & 1).reshape(out_features, in_features // 32, 32)
    words = (fifth << torch.arange(32, device=q.device)).sum(-1)  # < 2**32: one block's bits
    return nibbles, words.to(torch.uint32).view(torch.int32).contiguous()


def unpack_int5(nibbles: torch.Tensor, fifth: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int5`: -> q [N, K] (uint8)."""
    shifts = torch.arange(32, device=fifth.device)
    bits = (fifth.view(torch.uint32).to(torch.int64)[..., None] >> shifts) & 1
    return unpack_int4(nibbles) | (bits.reshape(nibbles.shape[0], -1) << 4).to(torch.uint8)


def int5_linear(
    x: torch.Tensor,
    nibbles: torch.Tensor,
    fifth: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,
    bias: torch.Tensor | None = None,
    activations: str = "float",
    path: str = "auto",
    max_rows: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias [N]) -> [M, N] in x's dtype, W as the INT5-blocks layout above
    (`max_rows` as for `int4_linear`)."""
    out_features, half = nibbles.shape
    in_features, blocks = 2 * half, 2 * half // 32
    if in_features % 32:
        raise ValueError(f"int5_linear: in_features={in_features} is not a multiple of 32")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: {activations!r}; allowed: {'|'.join(ACTIVATIONS)}")
    _check("int5_linear nibbles", nibbles, torch.uint8, (out_features, half))
    _check("int5_linear fifth bits", fifth, torch.int32, (out_features, blocks))
    _check("int5_linear d", d, torch.float16, (out_features, blocks))
    _check("int5_linear m", m, torch.float16, (out_features, blocks))
    if bias is not None:
        _check("int5_linear bias", bias, torch.float32, (out_features,))
    return _multiply(
        "int5_linear",
        "q5_linear_f32",
        x,
        in_features,
        out_features,
        [
            nibbles.data_ptr(),
            fifth.data_ptr(),
            d.data_ptr(),
            m.data_ptr(),
            None if bias is None else bias.data_ptr(),
        ],
        [
            rows_max(INT5_BLOCKS, activations) if max_rows is None else max_rows,
            _path(path, activations),
            int(activations == "int8"),
        ],
    )
