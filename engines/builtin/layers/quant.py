"""Weight-only quantized linear methods: INT8 per-output-channel and INT4 group-wise.

Both quantize the full-precision weight once, at load, and keep activations in the compute
dtype. Which kernel multiplies (`describe()` says per layer, and why):
- CPU with the engine's C kernels (native/quant.py, quant_kernels.c; `engine.native_kernels`,
  any float dtype): the weights are packed in the layout those kernels stream; decode rows
  through fused multiply-adds on weights widened in registers (INT4 also with INT8 activations,
  `engine.quantization_activations=int8`, llama.cpp's scheme), prefill through dequantized
  tiles and the float32 GEMM.
- CPU without them: torch's packed kernels (below), which are 3-11x slower than a float32
  linear at one row in float32 and hundreds of times slower at prefill (docs/benchmarks.md).
- elsewhere (or where a kernel does not take the shape): dequantize the weight and multiply
  densely, which gives the same numbers; on CUDA, Triton kernels (quant_triton.py) dequantize
  the weight tile in registers instead.

INT8 (symmetric, per output row):  scale = max|w| / 127,  q = clamp(round(w / scale), -127, 127),
    w ~= q * scale.  Kernel: aten._weight_int8pack_mm(x [M, K], q int8 [N, K], scales [N]),
    scales in x's dtype (float32, bfloat16, float16 on CPU; the 16-bit paths need K % 16 == 0
    -- bfloat16 with other K crashes in torch 2.13 -- so other K take the dequantize path).

INT4 (asymmetric, per group of g input columns, round to nearest), two zero-point schemes
(`engine.quantization_zero_point`):
  float (default; llama.cpp's Q4_1, torchao's tinygemm layout with a FLOAT zero-point domain):
    lo = min(w), hi = max(w) of the group (the range is NOT widened to include 0),
    scale = (hi - lo) / 15,  q = clamp(round((w - lo) / scale), 0, 15),  w ~= q * scale + lo.
  int (an integer zero point, the form AWQ / GPTQ checkpoints store; here the range is
    widened to include 0, so 0 is a grid point):
    scale = (max - min) / 15,  z = clamp(round(-min / scale), 0, 15),
    q = clamp(round(w / scale) + z, 0, 15),  w ~= (q - z) * scale.
  symmetric (llama.cpp's Q4_0: no zero point; the group's value of largest magnitude, p,
    is level 0): scale = p / -8,  q = min(floor(w / scale + 8.5), 15),  w ~= (q - 8) * scale.
torch's int4 kernels dequantize as (q - 8) * scale + zero with a float `zero`, so both store
zero = lo + 8 * scale (float) or zero = (8 - z) * scale (int): the same buffers, kernels and
speed, only the numbers differ. The float scheme rounds q against the scale and zero as
stored (rounded to their dtype), so the grid the kernels dequantize is the one q was fitted to.
Re-quantizing Q4_1 weights (blocks of 32, every block spans its 16 levels) with float / g32 gives
back their q exactly; the grid moves only by the rounding of scale and zero to their dtype.
Kernels: aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], inner_k_tiles)
-> uint8 [N, K/2], and aten._weight_int4pack_mm_for_cpu(x [M, K], packed, group_size,
scales_and_zeros [K/group, N, 2]) with scales_and_zeros in x's dtype (it refuses others, so
they are stored in the compute dtype). The packing needs N % 16 == 0; other shapes keep plain
nibbles (two per byte) and take the dequantize path.

Group size per layer: the largest of 32|64|128 that is <= `quantization_group_size` and divides
the layer's in_features (SmolLM2's 576 with 128 asked -> 64). Where none divides, the layer is
quantized INT8 per channel instead (llama.cpp falls back to another type the same way); both
are reported per layer by `describe()["linear_methods"]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engines.base import ConfigError
from engines.builtin.layers.linear import LINEAR_METHODS, LinearMethod, LinearOptions
from engines.builtin.native import quant as native_quant

if TYPE_CHECKING:
    from engines.builtin.layers.linear import Linear

INT4_GROUP_SIZES = (32, 64, 128)
_INNER_K_TILES = 2
# On CUDA the Triton dequantize-matmul kernels (quant_triton, imported lazily) serve these.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """An all-zero row/group (or an underflowed scale) gets scale 1: it then dequantizes to 0."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


NOT_REQUESTED = "not requested (a method built without the engine's kernel choice)"


class QuantMethod(LinearMethod):
    """What INT8 and INT4 share: which CPU kernel multiplies (`native_reason` None: the
    engine's C kernels, else why not), decided when the engine builds the method."""

    bits = 0
    dense = False

    def __init__(self, native_reason: str | None = NOT_REQUESTED) -> None:
        self.native_reason = native_reason

    @classmethod
    def create(cls, options: LinearOptions) -> LinearMethod:
        return cls(options.native_reason)

    def uses_native(self, weight: torch.Tensor) -> bool:
        return self.native_reason is None and weight.device.type == "cpu"

    def kernel(self, layer: Linear) -> str:
        """The kernel this layer multiplies through, and why, for describe()."""
        if layer.native:
            return native_quant.describe_kernel(self.bits, getattr(self, "activations", "float"))
        if layer.qweight.is_cuda:
            return "Triton dequantize-matmul (quant_triton.py)"
        return f"torch: {self.torch_kernel(layer)} (engine C kernels off: {self.native_reason})"

    def torch_kernel(self, layer: Linear) -> str:
        raise NotImplementedError

    @staticmethod
    def float_bias(layer: Linear) -> torch.Tensor | None:
        return None if layer.bias is None else layer.bias.float().contiguous()


@LINEAR_METHODS.register("int8")
class Int8Method(QuantMethod):
    """Symmetric per-output-channel INT8 weights; scales in the compute dtype (float32 for the
    engine's C kernels)."""

    name = "int8"
    bits = 8

    def describe(self, layer: Linear) -> str:
        return f"int8; kernel {self.kernel(layer)}"

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.load_columns(layer, weight, bias, slice(None))

    def load_columns(
        self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice
    ) -> None:
        # each row's scale is its maximum over ALL inputs, whichever columns this rank keeps
        w = weight.float()
        scale = _nonzero((w.abs().amax(dim=1) / 127).to(weight.dtype))
        q = torch.clamp(torch.round(w[:, columns] / scale.float()[:, None]), -127, 127)
        q = q.to(torch.int8)
        layer.native = self.uses_native(weight)
        layer.register_buffer("qweight", q.contiguous())
        layer.register_buffer("scales", (scale.float() if layer.native else scale).contiguous())
        layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def dequantize(self, layer: Linear) -> torch.Tensor:
        """The weight the stored form represents, [out, in] in float32."""
        return layer.qweight.float() * layer.scales.float()[:, None]

    def use_kernel(self, layer: Linear, x: torch.Tensor) -> bool:
        # torch 2.13's bfloat16 path reads past the row (segfaults) unless in % 16 == 0.
        return (
            x.device.type == "cpu"
            and _has_op("_weight_int8pack_mm")
            and (
                x.dtype == torch.float32
                or (x.dtype in (torch.bfloat16, torch.float16) and layer.in_features % 16 == 0)
            )
        )

    def torch_kernel(self, layer: Linear) -> str:
        return "_weight_int8pack_mm (float32; bf16/fp16 with in_features % 16 == 0)"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.native and x.device.type == "cpu" and not x.requires_grad:
            y = native_quant.int8_linear(
                _flat(x), layer.qweight, layer.scales, self.float_bias(layer)
            )
            return y.reshape(*x.shape[:-1], layer.out_features)
        if x.is_cuda and x.dtype in TRITON_DTYPES:
            from engines.builtin.layers.quant_triton import int8_matmul

            y = int8_matmul(_flat(x), layer.qweight, layer.scales)
            y = y.reshape(*x.shape[:-1], layer.out_features)
            return y if layer.bias is None else y + layer.bias
        if self.use_kernel(layer, x):
            y = torch.ops.aten._weight_int8pack_mm(
                _flat(x), layer.qweight, layer.scales.to(x.dtype)
            )
            y = y.reshape(*x.shape[:-1], layer.out_features)
            return y if layer.bias is None else y + layer.bias
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)


INT4_ZERO_POINTS = ("float", "int", "symmetric")


def int4_group_size(in_features: int, requested: int) -> int | None:
    """The group size a layer of `in_features` inputs gets: the largest allowed one that is at
    most `requested` and divides it (never coarser than asked); None if none divides."""
    fits = [g for g in INT4_GROUP_SIZES if g <= requested and in_features % g == 0]
    return max(fits) if fits else None


def int4_straddle_error(name: str, full_width: int, shard_width: int, group: int) -> ConfigError:
    """The error for a row-parallel layer `name` whose `group`-input INT4 groups would straddle
    its tensor-parallel shards of `shard_width` columns (the engine checks before it starts any
    rank: engines/builtin/distributed/shard.py)."""
    fitting = "|".join(str(g) for g in INT4_GROUP_SIZES if shard_width % g == 0) or "-"
    return ConfigError(
        f"engine.quantization_group_size: groups of {group} inputs straddle the "
        f"tensor-parallel shards of {name} (its {full_width} inputs split into "
        f"{shard_width}-column shards); allowed: a group size that divides {shard_width} "
        f"(engine.quantization_group_size {fitting}), or another engine.tensor_parallel_size"
    )


def quantize_int4(
    w: torch.Tensor, group_size: int, zero_point: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [out, in] in 0..15, scales_and_zeros [in/g, out, 2] in `dtype`) with
    W ~= (q - 8) * scale + zero per group (torch's int4 convention); see the module docstring."""
    out, k = w.shape
    w = w.float().reshape(out, k // group_size, group_size)
    if zero_point == "float":
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = _nonzero(((hi - lo) / 15).to(dtype)).float()  # [out, k/g]
        zero = (lo + 8 * scale).to(dtype).float()  # stored as is: q is fitted to this grid
        q = torch.round((w - (zero - 8 * scale)[..., None]) / scale[..., None])
        q = torch.clamp(q, 0, 15)
    elif zero_point == "symmetric":
        peak = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        scale = _nonzero((peak / -8).to(dtype)).float()  # [out, k/g]; negative when peak > 0
        q = torch.clamp(torch.floor(w / scale[..., None] + 8.5), 0, 15)
        zero = torch.zeros_like(scale)  # torch's convention: w = (q - 8) * scale + 0
    elif zero_point == "int":
        lo = w.amin(dim=-1).clamp(max=0)
        hi = w.amax(dim=-1).clamp(min=0)
        scale = _nonzero(((hi - lo) / 15).to(dtype)).float()  # [out, k/g]
        z = torch.clamp(torch.round(-lo / scale), 0, 15)
        q = torch.clamp(torch.round(w / scale[..., None]) + z[..., None], 0, 15)
        zero = (8 - z) * scale  # torch's convention: w = (q - 8) * scale + zero
    else:
        raise ValueError(
            f"engine.quantization_zero_point: {zero_point!r} is invalid; "
            f"allowed: {'|'.join(INT4_ZERO_POINTS)}"
        )
    scales_and_zeros = torch.stack([scale, zero], dim=-1)  # [out, k/g, 2]
    return (
        q.reshape(out, k).to(torch.int32),
        scales_and_zeros.transpose(0, 1).contiguous().to(dtype),
    )


ACTIVATIONS = native_quant.ACTIVATIONS


@LINEAR_METHODS.register("int4")
class Int4Method(QuantMethod):
    """Asymmetric group-wise INT4 weights (round to nearest), packed two per byte; a float or
    an integer zero point; each layer's group size fitted to its input size. `activations`:
    float, or int8 (the engine's C kernels quantize decode rows per block of 32)."""

    name = "int4"
    bits = 4
    groups_inputs = True
    takes_int8_activations = True

    @classmethod
    def create(cls, options: LinearOptions) -> LinearMethod:
        return cls(
            options.group_size, options.zero_point, options.activations, options.native_reason
        )

    def __init__(
        self,
        group_size: int = 128,
        zero_point: str = "float",
        activations: str = "float",
        native_reason: str | None = NOT_REQUESTED,
    ) -> None:
        super().__init__(native_reason)
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"engine.quantization_group_size: {group_size!r} is invalid; "
                f"allowed: {'|'.join(map(str, INT4_GROUP_SIZES))}"
            )
        if zero_point not in INT4_ZERO_POINTS:
            raise ValueError(
                f"engine.quantization_zero_point: {zero_point!r} is invalid; "
                f"allowed: {'|'.join(INT4_ZERO_POINTS)}"
            )
        if activations not in ACTIVATIONS:
            raise ValueError(
                f"engine.quantization_activations: {activations!r} is invalid; "
                f"allowed: {'|'.join(ACTIVATIONS)}"
            )
        self.group_size = group_size
        self.zero_point = zero_point
        self.activations = activations

    def describe(self, layer: Linear) -> str:
        return f"int4 g{layer.group_size} zero_point={self.zero_point}; kernel {self.kernel(layer)}"

    @staticmethod
    def packable(layer: Linear) -> bool:
        return (
            _has_op("_convert_weight_to_int4pack_for_cpu")
            and _has_op("_weight_int4pack_mm_for_cpu")
            and layer.out_features % 16 == 0
            and layer.in_features % (16 * _INNER_K_TILES) == 0
        )

    def torch_kernel(self, layer: Linear) -> str:
        if layer.int4_packed:
            return "_weight_int4pack_mm_for_cpu"
        return "dequantize + dense matmul (torch's int4 packing needs out_features % 16 == 0)"

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.load_columns(layer, weight, bias, slice(None))

    def load_columns(
        self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice
    ) -> None:
        # Groups run along the inputs and are quantized independently, so a shard's groups
        # are the whole weight's exactly when they are fitted to the full width and none
        # straddles the shard's edges.
        full_width = weight.shape[1]
        group = int4_group_size(full_width, self.group_size)
        if group is None:  # no allowed group divides it: this layer is INT8 (describe() says)
            layer.method = Int8Fallback(
                f"no int4 group size <= {self.group_size} of "
                f"{'|'.join(map(str, INT4_GROUP_SIZES))} divides in_features={full_width}",
                self.native_reason,
            )
            layer.method.load_columns(layer, weight, bias, columns)
            return
        first, last, _ = columns.indices(full_width)
        if first % group or last % group:
            raise int4_straddle_error(
                layer.name or "a row-parallel layer", full_width, last - first, group
            )
        weight = weight[:, columns]
        layer.group_size = group
        q, scales_and_zeros = quantize_int4(weight, group, self.zero_point, weight.dtype)
        layer.native = self.uses_native(weight)
        layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        if layer.native:  # W = q * scale + min, all float32 (native/quant.py's layout)
            sz = scales_and_zeros.float().transpose(0, 1)  # [out, k/g, 2]
            scale = sz[..., 0].contiguous()
            layer.register_buffer("qweight", native_quant.pack_int4(q))
            layer.register_buffer("scales", scale)
            layer.register_buffer("mins", (sz[..., 1] - 8 * scale).contiguous())
            layer.int4_packed = False
            return
        packed = self.packable(layer) and weight.device.type == "cpu"
        if packed:
            qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.contiguous(), _INNER_K_TILES
            )
        else:  # plain nibbles: even column in the low 4 bits, odd column in the high 4 bits
            qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        layer.int4_packed = packed
        layer.register_buffer("qweight", qweight.contiguous())
        layer.register_buffer("scales_and_zeros", scales_and_zeros)

    def _kernel(self, layer: Linear, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2d, layer.qweight, layer.group_size, layer.scales_and_zeros.to(x2d.dtype)
        )

    def dequantize(self, layer: Linear) -> torch.Tensor:
        """The weight the stored form represents, [out, in] in float32."""
        out, k, g = layer.out_features, layer.in_features, layer.group_size
        if layer.native:
            q = native_quant.unpack_int4(layer.qweight).float().reshape(out, k // g, g)
            return (q * layer.scales[..., None] + layer.mins[..., None]).reshape(out, k)
        sz = layer.scales_and_zeros.float()  # [k/g, out, 2]
        if layer.int4_packed:  # torch's tile layout is opaque: read it back through the kernel
            eye = torch.eye(k, dtype=torch.float32, device=layer.qweight.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, layer.qweight, g, sz.contiguous()
            ).T.contiguous()
        q = torch.stack([layer.qweight & 0xF, layer.qweight >> 4], dim=-1).reshape(out, k)
        scale = sz[..., 0].T.repeat_interleave(g, dim=1)  # [out, k]
        zero = sz[..., 1].T.repeat_interleave(g, dim=1)
        return (q.float() - 8) * scale + zero

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.native and x.device.type == "cpu" and not x.requires_grad:
            y = native_quant.int4_linear(
                _flat(x),
                layer.qweight,
                layer.scales,
                layer.mins,
                layer.group_size,
                self.float_bias(layer),
                self.activations,
            )
            return y.reshape(*x.shape[:-1], layer.out_features)
        if (
            layer.int4_packed
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        ):
            y = self._kernel(layer, _flat(x)).reshape(*x.shape[:-1], layer.out_features)
            return y if layer.bias is None else y + layer.bias
        if x.is_cuda and not layer.int4_packed and x.dtype in TRITON_DTYPES:
            from engines.builtin.layers.quant_triton import int4_matmul

            y = int4_matmul(_flat(x), layer.qweight, layer.scales_and_zeros, layer.group_size)
            y = y.reshape(*x.shape[:-1], layer.out_features)
            return y if layer.bias is None else y + layer.bias
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)


class Int8Fallback(Int8Method):
    """INT8 per channel for a layer `engine.quantization=int4` cannot group; says why."""

    def __init__(self, reason: str, native_reason: str | None = NOT_REQUESTED) -> None:
        super().__init__(native_reason)
        self.reason = reason

    def describe(self, layer: Linear) -> str:
        return f"int8 (int4 fallback: {self.reason}); kernel {self.kernel(layer)}"
