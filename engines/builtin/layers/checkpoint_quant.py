"""Weights a checkpoint stores quantized, multiplied as stored: `engine.quantization=auto` (the
default) keeps each `QuantizedWeight` the loader hands a layer (models/quantized_weight.py: a
GGUF file's Q4_0 ... Q8_0 and K-quants, decoded exactly by models/gguf_blocks.py) in the layout
of one of the engine's C kernels, and every float weight as `none` would.

- 4-bit levels in groups of 32 (Q4_0, Q4_1, Q4_K): the INT4 layout (native/quant.py), exactly
  the file's bytes of levels, float32 scales and minima;
- 5- to 8-bit levels (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, and Q2_K / Q3_K): the grouped INT8 layout,
  a byte a level, groups of 16 or 32.

Each weight is the file's to float32 rounding: the kernels compute q * scale + min in float32
as gguf's dequantization does (tests/engines/builtin/layers/test_checkpoint_quant.py).
`engine.quantization_activations=int8` quantizes the decode rows per block of 32 as llama.cpp
does for its quantized matmuls (integer dot products; a layer whose inputs are not a multiple
of 32 keeps float rows). Without the C kernels (another device, native_kernels=false) a layer
dequantizes its weight for each product: correct, slow, and said by `describe()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engines.builtin.layers.linear import LINEAR_METHODS, LinearMethod, LinearOptions
from engines.builtin.layers.quant import NOT_REQUESTED, QuantMethod, _flat
from engines.builtin.native import quant as native_quant
from models.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from engines.builtin.layers.linear import Linear


class CheckpointQuantMethod(QuantMethod):
    """One layer's weight as its checkpoint quantized it (made by `AutoMethod.load`)."""

    name = "checkpoint"

    def __init__(
        self, source: str, activations: str = "float", native_reason: str | None = NOT_REQUESTED
    ) -> None:
        super().__init__(native_reason)
        self.source = source
        self.activations = activations
        self.bits = 4

    def layer_activations(self, layer: Linear) -> str:
        """INT8 rows where this layer's kernel takes them (inputs a multiple of 32)."""
        return "float" if layer.in_features % 32 else self.activations

    def describe(self, layer: Linear) -> str:
        form = "int4" if self.bits == 4 else "grouped int8"
        if layer.native:
            kernel = native_quant.describe_kernel(self.kernel_bits, self.layer_activations(layer))
        else:
            kernel = f"dequantize + dense matmul (engine C kernels off: {self.native_reason})"
        return f"{self.source} as {form} g{layer.group_size} (exact); kernel {kernel}"

    @property
    def kernel_bits(self) -> int:
        return 4 if self.bits == 4 else native_quant.GROUPED_INT8

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert isinstance(weight, QuantizedWeight)  # AutoMethod hands it only those
        self.bits = 4 if weight.bits == 4 and weight.group_size % 32 == 0 else 8
        if self.bits == 4:
            levels = native_quant.pack_int4(weight.q)
        else:
            if weight.group_size % 32 == 0:  # the kernel's groups are 16 or 32
                weight = weight.with_group_size(32)
            levels = weight.q.contiguous()
        layer.native = self.uses_native(weight.q)
        layer.group_size = weight.group_size
        layer.register_buffer("qweight", levels)
        layer.register_buffer("scales", weight.scales.float().contiguous())
        layer.register_buffer("mins", weight.mins.float().contiguous())
        layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.dtype = weight.dtype

    def load_columns(
        self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice
    ) -> None:
        assert isinstance(weight, QuantizedWeight)
        self.load(layer, weight.columns(columns), bias)

    def levels(self, layer: Linear) -> torch.Tensor:
        """q [out, in] (uint8), whichever layout keeps them."""
        if self.bits == 4:
            return native_quant.unpack_int4(layer.qweight)
        return layer.qweight

    def dequantize(self, layer: Linear) -> torch.Tensor:
        """The weight the stored form represents, [out, in] in float32."""
        out, k, g = layer.out_features, layer.in_features, layer.group_size
        q = self.levels(layer).float().reshape(out, k // g, g)
        return (q * layer.scales[..., None] + layer.mins[..., None]).reshape(out, k)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.native and x.device.type == "cpu" and not x.requires_grad:
            multiply = native_quant.int4_linear if self.bits == 4 else native_quant.int8g_linear
            y = multiply(
                _flat(x),
                layer.qweight,
                layer.scales,
                layer.mins,
                layer.group_size,
                self.float_bias(layer),
                self.layer_activations(layer),
            )
            return y.reshape(*x.shape[:-1], layer.out_features)
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)


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
        if isinstance(weight, QuantizedWeight):
            return CheckpointQuantMethod(
                weight.source, self.options.activations, self.options.native_reason
            )
        return self.dense_method

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        layer.method = self._concrete(layer, weight)
        layer.method.load(layer, weight, bias)

    def load_columns(
        self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice
    ) -> None:
        layer.method = self._concrete(layer, weight)
        layer.method.load_columns(layer, weight, bias, columns)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.name}: multiplied before its weight was loaded")
