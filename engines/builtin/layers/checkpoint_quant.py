"""Weights a checkpoint stores quantized, multiplied as stored: `engine.quantization=auto` (the
default) keeps each `QuantizedWeight` the loader hands a layer (models/quantized_weight.py: a
GGUF file's Q4_0 ... Q8_0 and K-quants, decoded exactly by models/gguf_blocks.py; an AWQ, GPTQ
or compressed-tensors folder's integer or FP8 weights, models/hf_quantized.py) in the layout
of one of the engine's C kernels, and every float weight as `none` would.

- 4-bit levels in groups of 32 (Q4_0, Q4_1, Q4_K): the INT4 layout (native/quant.py), exactly
  the file's bytes of levels, float32 scales and minima;
- symmetric groups of 32 with float16 scales (Q8_0, and Q5_0 as q - 16): INT8 blocks, a byte
  a level and a float16 scale per 32 (Q8_0's own bytes);
- 5-bit levels with float16 scales and minima (Q5_1), beside INT8 activations: INT5 blocks,
  the INT4 nibbles and a bit plane (the file's own bits);
- other levels of 5 to 8 bits (Q5_1 with float activations, Q5_K, Q6_K, Q2_K / Q3_K): the
  grouped INT8 layout, a byte a level, float32 scales and minima per 16 or 32;
- FP8 e4m3 values with a scale a row: the FP8 layout, the values' bytes and a float32 scale
  (on CUDA, the Triton FP8 kernel multiplies them).
AWQ / GPTQ / compressed-tensors groups of 64 or 128 take INT4 as they are, 8-bit ones split
into groups of 32 (the same scale repeated, exact). GPTQ's act-order keeps the inputs sorted by
group and gathers the layer's input in that order.
The order is the measured speed (scripts/bench_checkpoint_layouts.py, 1 and 2 threads): INT8
blocks stream Q5_0 as fast as INT5 blocks with INT8 activations and 1.4x faster with float
ones, where widening the bit plane costs more than the bytes it saves.

Each weight is the file's to float32 rounding: the kernels compute q * scale + min in float32
as gguf's dequantization does (tests/engines/builtin/layers/test_checkpoint_quant.py).
`engine.quantization_activations=int8` quantizes the decode rows per block of 32 as llama.cpp
does for its quantized matmuls (integer dot products; a layer whose inputs are not a multiple
of 32 keeps float rows). Without the C kernels (another device, native_kernels=false) a layer
is dequantized once at load to the compute dtype, as `none` keeps it, and `describe()` says
so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engines.builtin import native
from engines.builtin.layers.linear import LINEAR_METHODS, LinearMethod, LinearOptions
from engines.builtin.layers.quant import NOT_REQUESTED, TRITON_DTYPES, QuantMethod, _flat
from engines.builtin.native import quant as native_quant
from models.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from engines.builtin.layers.linear import Linear


def symmetric_blocks(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`weight` as INT8 blocks, (int8 levels [out, in], float16 scales [out, in / 32]), where
    that is exact: groups of 32 whose scales are float16 numbers and whose minima are an integer
    times the scale below zero (Q8_0: -128 d, Q5_0: -16 d), levels q - that integer within
    int8; None otherwise (a float minimum, a K-quant's scale)."""
    if weight.group_size != 32 or weight.q.shape[1] % 32:
        return None
    scales, mins = weight.scales, weight.mins
    halves = scales.half()
    if not torch.equal(halves.float(), scales):
        return None
    zero = torch.where(scales != 0, -mins / torch.where(scales != 0, scales, 1), 0)
    if not torch.equal(zero, zero.round()) or not torch.equal(-(zero * scales), mins):
        return None  # (an all-zero group has scale 0 and minimum 0: levels 0 below)
    out, k = weight.shape
    levels = weight.q.to(torch.int16).reshape(out, k // 32, 32) - zero.to(torch.int16)[..., None]
    levels = torch.where((scales != 0)[..., None], levels, 0)
    if levels.min() < -128 or levels.max() > 127:
        return None
    return levels.reshape(out, k).to(torch.int8).contiguous(), halves.contiguous()


def _input_order(layer: Linear) -> torch.Tensor | None:
    """The act-order permutation the layer gathers its inputs by (None: inputs as they come)."""
    return layer._buffers.get("input_order")


def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t` in memory of its own (float32 where it is float)."""
    return (t.float() if t.is_floating_point() else t).clone(memory_format=torch.contiguous_format)


def five_bit_blocks(weight: QuantizedWeight) -> tuple[torch.Tensor, ...] | None:
    """`weight` as INT5 blocks (nibbles, fifth bits, float16 scales and minima), where that is
    exact: groups of 32, levels below 32, scales and minima float16 numbers (Q5_0, Q5_1)."""
    if weight.group_size != 32 or weight.q.shape[1] % 32 or int(weight.q.max()) >= 32:
        return None
    d, m = weight.scales.half(), weight.mins.half()
    if not (torch.equal(d.float(), weight.scales) and torch.equal(m.float(), weight.mins)):
        return None
    nibbles, fifth = native_quant.pack_int5(weight.q)
    return nibbles, fifth, d.contiguous(), m.contiguous()


#: the engine's layouts a checkpoint's weight takes -> native/quant.py's format number
LAYOUT_BITS = {
    "fp8": native_quant.FP8,
    "int4": 4,
    "int5 blocks": native_quant.INT5_BLOCKS,
    "int8 blocks": native_quant.INT8_BLOCKS,
    "grouped int8": native_quant.GROUPED_INT8,
}


class CheckpointQuantMethod(QuantMethod):
    """One layer's weight as its checkpoint quantized it (made by `AutoMethod.load`), in the
    first layout of these that holds it exactly: INT4 (4-bit levels in groups of 32), INT8
    blocks (symmetric groups of 32 with float16 scales: the file's own bytes for Q8_0), INT5
    blocks (5-bit levels, float16 scales and minima per 32; with INT8 activations), grouped
    INT8 (any 8-bit levels, float32 scales and minima per 16 or 32)."""

    name = "checkpoint"
    held = "exact"  # how the layout holds the weight it was given

    def __init__(
        self, source: str, activations: str = "float", native_reason: str | None = NOT_REQUESTED
    ) -> None:
        super().__init__(native_reason)
        self.source = source
        self.activations = activations
        self.layout = "int4"

    @property
    def kernel_bits(self) -> int:
        return LAYOUT_BITS[self.layout]

    def layer_activations(self, layer: Linear) -> str:
        """INT8 rows where this layer's kernel takes them (inputs a multiple of 32; FP8 weights
        keep float rows)."""
        return "float" if layer.in_features % 32 or self.layout == "fp8" else self.activations

    def describe(self, layer: Linear) -> str:
        if layer.native:
            kernel = native_quant.describe_kernel(self.kernel_bits, self.layer_activations(layer))
        elif self.layout == "fp8" and layer.qweight.is_cuda:
            kernel = "Triton FP8 dequantize-matmul (quant_triton.py)"
        else:
            kernel = f"dequantize + dense matmul (engine C kernels off: {self.native_reason})"
        order = "" if _input_order(layer) is None else ", inputs gathered in act-order"
        groups = "a scale a row" if self.layout == "fp8" else f"g{layer.group_size}"
        return f"{self.source} as {self.layout} {groups} ({self.held}{order}); kernel {kernel}"

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert isinstance(weight, QuantizedWeight)  # AutoMethod hands it only those
        self.keep(layer, weight, bias)

    def keep(self, layer: Linear, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        """`weight` in the first layout that holds it exactly (the class docstring)."""
        integer = not weight.is_fp8
        int4 = weight.bits == 4 and native.int4_group_fits(weight.group_size, weight.shape[1])
        if integer and not int4:  # the 8-bit kernels' groups (or INT4's, from g96, g192...)
            weight = weight.with_group_size(32 if weight.group_size % 32 == 0 else 16)
            int4 = weight.bits == 4 and weight.group_size == 32
        # the fastest exact layout first (scripts/bench_checkpoint_layouts.py): INT8 blocks where
        # symmetric; INT5 only beside INT8 activations (with float ones its bit plane costs
        # more to widen than the bytes it saves: grouped INT8 is faster)
        blocks = symmetric_blocks(weight) if integer and weight.bits == 8 else None
        takes_five = integer and weight.bits == 8 and blocks is None and self.activations == "int8"
        five = five_bit_blocks(weight) if takes_five else None
        # copies: a weight cut from a larger one (an expert, a rank's rows) would pin it whole
        mins = _owned(weight.mins)
        if weight.is_fp8:  # AutoMethod hands over one scale a row only
            self.layout, levels = "fp8", weight.q.clone(memory_format=torch.contiguous_format)
            scales, mins = _owned(weight.scales[:, 0]), torch.empty(0)
        elif int4:
            self.layout, levels = "int4", native_quant.pack_int4(weight.q)
            scales = _owned(weight.scales)
        elif blocks is not None:
            self.layout, (levels, scales) = "int8 blocks", blocks
            mins = torch.empty(0)  # none: W = q d
        elif five is not None:
            self.layout, (levels, fifth, scales, mins) = "int5 blocks", five
            layer.register_buffer("fifth_bits", fifth)
        else:
            self.layout, levels = "grouped int8", _owned(weight.q)
            scales = _owned(weight.scales)
        layer.native = self.uses_native(weight.q)
        layer.group_size = weight.group_size
        layer.register_buffer("qweight", levels)
        layer.register_buffer("scales", scales)
        layer.register_buffer("mins", mins)
        layer.register_buffer("input_order", weight.input_order)
        layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def load_columns(
        self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice
    ) -> None:
        assert isinstance(weight, QuantizedWeight)
        self.keep(layer, weight.columns(columns), bias)

    def dequantize(self, layer: Linear) -> torch.Tensor:
        """The weight the stored form represents, [out, in] in float32."""
        weight, order = self._stored_weight(layer), _input_order(layer)
        if order is None:
            return weight
        return torch.empty_like(weight).index_copy_(1, order, weight)

    def _stored_weight(self, layer: Linear) -> torch.Tensor:
        """The stored form's weight, its columns in the stored (act-order) order."""
        out, k, g = layer.out_features, layer.in_features, layer.group_size
        if self.layout == "fp8":
            return layer.qweight.float() * layer.scales[:, None]
        if self.layout == "int8 blocks":
            q = layer.qweight.float().reshape(out, k // g, g)
            return (q * layer.scales.float()[..., None]).reshape(out, k)
        if self.layout == "int5 blocks":
            q = native_quant.unpack_int5(layer.qweight, layer.fifth_bits).float()
            q = q.reshape(out, k // g, g)
            scales, mins = layer.scales.float(), layer.mins.float()
            return (q * scales[..., None] + mins[..., None]).reshape(out, k)
        levels = native_quant.unpack_int4(layer.qweight) if self.layout == "int4" else layer.qweight
        q = levels.float().reshape(out, k // g, g)
        return (q * layer.scales[..., None] + layer.mins[..., None]).reshape(out, k)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "fp8" and x.is_cuda and x.dtype in TRITON_DTYPES:
            from engines.builtin.layers.quant_triton import fp8_matmul

            y = fp8_matmul(_flat(x), layer.qweight, layer.scales)
            y = y.reshape(*x.shape[:-1], layer.out_features)
            return y if layer.bias is None else y + layer.bias
        if not (layer.native and x.device.type == "cpu" and not x.requires_grad):
            return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)
        bias, activations = self.float_bias(layer), self.layer_activations(layer)
        order = _input_order(layer)
        if order is not None:  # act-order: the inputs in the groups' order
            x = x.index_select(-1, order)
        if self.layout == "fp8":
            y = native_quant.fp8_linear(_flat(x), layer.qweight, layer.scales, bias)
        elif self.layout == "int8 blocks":
            y = native_quant.int8b_linear(_flat(x), layer.qweight, layer.scales, bias, activations)
        elif self.layout == "int5 blocks":
            y = native_quant.int5_linear(
                _flat(x), layer.qweight, layer.fifth_bits, layer.scales, layer.mins, bias,
                activations,
            )  # fmt: skip
        else:
            multiply = (
                native_quant.int4_linear if self.layout == "int4" else native_quant.int8g_linear
            )
            y = multiply(
                _flat(x), layer.qweight, layer.scales, layer.mins, layer.group_size, bias,
                activations,
            )  # fmt: skip
        return y.reshape(*x.shape[:-1], layer.out_features)


class DequantizedAtLoad(LinearMethod):
    """A checkpoint's quantized weight where no engine kernel multiplies it (another device,
    the C kernels off): dequantized once, at load, to the compute dtype, then kept by the dense
    method `inner` as `none` keeps every weight (dequantizing for each product cost every
    step)."""

    name = "none"

    def __init__(self, source: str, reason: str, dense: LinearMethod) -> None:
        self.source, self.reason, self.inner = source, reason, dense

    def describe(self, layer: Linear) -> str:
        return f"{self.source} dequantized at load ({self.reason}); {self.inner.describe(layer)}"

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert isinstance(weight, QuantizedWeight)
        self.inner.load(layer, weight.dequantize(), bias)

    def load_columns(
        self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice
    ) -> None:
        assert isinstance(weight, QuantizedWeight)
        self.inner.load_columns(layer, weight.dequantize(), bias, columns)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(layer, x)

    def weight_bytes(self, layer: Linear) -> int:
        return self.inner.weight_bytes(layer)

    def packed_bytes(self, layer: Linear) -> int:
        return self.inner.packed_bytes(layer)


@LINEAR_METHODS.register("auto")
class AutoMethod(LinearMethod):
    """The checkpoint's own format: a quantized weight kept as stored (CheckpointQuantMethod),
    a float one as `none` keeps it. Each layer gets its concrete method at load."""

    name = "auto"
    takes_quantized = True
    takes_int8_activations = True

    @classmethod
    def create(cls, options: LinearOptions) -> LinearMethod:
        return cls(options)

    def __init__(self, options: LinearOptions, dense: LinearMethod | None = None) -> None:
        from engines.builtin.layers.linear import DenseMethod

        self.options = options
        self.dense_method = dense if dense is not None else DenseMethod()

    def _concrete(self, layer: Linear, weight: torch.Tensor) -> LinearMethod:
        if not isinstance(weight, QuantizedWeight):
            return self.dense_method
        native = self.options.native_reason
        if weight.is_fp8 and weight.scales.shape[1] > 1:
            native = f"FP8 in groups of {weight.group_size}: the FP8 kernels take a scale a row"
        elif not weight.is_fp8 and weight.group_size % 16:
            native = f"groups of {weight.group_size}: the kernels take multiples of 16"
        elif weight.is_fp8 and weight.device.type == "cuda" and weight.dtype in TRITON_DTYPES:
            return CheckpointQuantMethod(weight.source, "float", native)  # the Triton kernel
        if native is None and weight.device.type == "cpu":
            return CheckpointQuantMethod(weight.source, self.options.activations, native)
        reason = native if native is not None else f"no engine kernel on {weight.device.type}"
        return DequantizedAtLoad(weight.source, reason, self.dense_method)

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        layer.method = self._concrete(layer, weight)
        layer.method.load(layer, weight, bias)

    def load_columns(
        self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice
    ) -> None:
        layer.method = self._concrete(layer, weight)
        if isinstance(weight, QuantizedWeight) and weight.input_order is not None:
            # a row-parallel shard of act-order inputs is no run of the stored columns
            reason = "act-order inputs cut by tensor parallelism"
            layer.method = DequantizedAtLoad(weight.source, reason, self.dense_method)
        layer.method.load_columns(layer, weight, bias, columns)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.name}: multiplied before its weight was loaded")
