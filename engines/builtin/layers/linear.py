"""Linear layers whose weight storage and multiply are a pluggable `LinearMethod`.

The model only ever calls `Linear.forward`; how the weight is kept (dense, INT8 per-channel,
INT4 group-wise, ...) and which kernel multiplies it is the method's business. The loader
hands every weight to `Linear.load`, full-precision or as its checkpoint quantized it, so
quantizing (or keeping the file's quantization) at load time is a method concern too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin import native
from engines.registry import Registry
from models.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from engines.builtin.lora.batch import LoRABatch
    from engines.builtin.lora.layer import LoRALayerSlots


@dataclass(frozen=True)
class LinearOptions:
    """The engine's options a linear method is built from: group-wise methods take
    `group_size` and `zero_point`, INT4 `activations`; quantized methods multiply through the
    engine's C kernels where `native_reason` is None, and say why not otherwise."""

    group_size: int = 128
    zero_point: str = "float"
    activations: str = "float"
    native_reason: str | None = "not requested"


class LinearMethod(ABC):
    """How a linear layer stores its weight and multiplies by it."""

    name: str = "abstract"
    #: Whether the weights are kept unquantized (a packed copy may then be kept beside them).
    dense: bool = True
    #: Whether the weights are quantized in groups along the input columns, which a
    #: tensor-parallel shard must not split (int4).
    groups_inputs: bool = False
    #: Whether it can multiply activations quantized to INT8 (engine.quantization_activations).
    takes_int8_activations: bool = False
    #: Whether `load` takes a checkpoint's QuantizedWeight as it is (others get it dequantized).
    takes_quantized: bool = False

    @classmethod
    def create(cls, options: LinearOptions) -> LinearMethod:
        """An instance for the engine's options (a dense method takes none)."""
        return cls()

    def describe(self, layer: Linear) -> str:
        """How this layer is kept, for describe()["linear_methods"] (e.g. "int4 g64 ...")."""
        return self.name

    @abstractmethod
    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Take a full-precision [out, in] weight and keep it in this method's format."""

    def load_columns(
        self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice
    ) -> None:
        """A row-parallel shard: keep `columns` of the full [out, in] `weight` (tensor
        parallelism). Quantized as if the whole weight were loaded and then cut, so that each
        rank multiplies by exactly the numbers one rank would; for a method whose numbers
        depend on each column alone (dense), that is cutting first."""
        self.load(layer, weight[:, columns], bias)

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W^T + b for x of shape [..., in]."""

    def weight_bytes(self, layer: Linear) -> int:
        """Bytes a forward pass must read for this layer's weight (and scales)."""
        return sum(t.numel() * t.element_size() for t in layer.state_tensors())

    def packed_bytes(self, layer: Linear) -> int:
        """Bytes of a packed copy of the weight kept beside it for a faster kernel: resident,
        but not read on top of the weight (a forward reads one copy or the other)."""
        return 0


#: `engine.quantization` -> the method class; quant.py registers the quantized ones.
LINEAR_METHODS = Registry[type[LinearMethod]]("engine.quantization")


@LINEAR_METHODS.register("none")
class DenseMethod(LinearMethod):
    """Unquantized weights in the compute dtype."""

    name = "none"

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        layer.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        assert layer.weight is not None  # set by load(), which runs before any forward
        return F.linear(x, layer.weight, layer.bias)

    def weight_bytes(self, layer: Linear) -> int:
        # what a forward reads: one copy of the weight (and the bias), whatever packed copy
        # a subclass keeps beside it
        return sum(
            t.numel() * t.element_size() for t in (layer.weight, layer.bias) if t is not None
        )


class PrepackedDenseMethod(DenseMethod):
    """Unquantized weights on CPU, also kept in oneDNN's packed layout.

    torch's CPU GEMM re-packs the weight on every call when the input has several rows, which
    makes a decode step at batch 4-64 cost 1.5-2.5x the batch-1 step although it reads the
    same bytes. The packed copy is made once at load. Up to 3 fp32 rows (batch 1-3 decode)
    run fastest on the plain weight; bf16 is fastest packed at any batch (docs/benchmarks.md,
    "Figures behind design choices").
    Costs a second copy of the weights in memory (not read twice: one copy serves each call).
    """

    name = "none"  # the same weights, unquantized; describe() says "prepacked_weights"
    PACK_FOR_ROWS = 8  # oneDNN's batch-size hint (best of 1/8/32/64 here); serves any rows
    PLAIN_FP32_MAX_ROWS = 3

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().load(layer, weight, bias)
        assert layer.weight is not None  # just set by DenseMethod.load
        packed = (
            torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, self.PACK_FOR_ROWS)
            if self.supported(layer.weight.device, layer.weight.dtype)
            else None
        )
        layer.register_buffer("packed_weight", packed, persistent=False)

    def packed_bytes(self, layer: Linear) -> int:
        # an opaque oneDNN tensor: its logical size (the blocked layout pads little)
        packed = layer.packed_weight
        return 0 if packed is None else packed.numel() * packed.element_size()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        if layer.packed_weight is None or (
            rows <= self.PLAIN_FP32_MAX_ROWS and x.dtype == torch.float32
        ):
            assert layer.weight is not None  # set by load(), which runs before any forward
            return F.linear(x, layer.weight, layer.bias)
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(rows, layer.in_features), layer.packed_weight, layer.bias, "none", [], ""
        )
        return y.reshape(*x.shape[:-1], layer.out_features)

    @staticmethod
    def supported(device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        # oneDNN packs bf16 only where the CPU converts it natively (AVX-512 BW/VL/DQ or
        # AVX-NE-CONVERT); elsewhere the reorder raises, and the plain weight is the path
        return dtype == torch.float32 or (
            dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )


class PanelDenseMethod(DenseMethod):
    """Unquantized CPU float32 weights, also kept in panels for the engine's own GEMM
    (`native.linear`; the layout and the kernel: cpu_kernels.c), which multiplies up to
    MAX_ROWS rows: decode up to batch 256, and short prefills.

    On a 2-core Xeon, the small preset's 49 matmuls (scripts/bench_cpu_kernels.py): 0.72-0.83x
    the time of oneDNN's packed GEMM at 4-64 rows (0.52-0.67x torch's plain GEMM), 0.9x at
    128, about the same as the better of the two at 2 and 256 rows. One row (batch-1 decode)
    takes the plain weight through torch's GEMV, 5-11% faster there; so do longer inputs
    (prefill steps), through torch's GEMM: the blocks' 48 matmuls at 384-1,024 rows take it
    0.90-1.02x this kernel's time and 0.97-1.06x oneDNN's; at 2,000 rows 0.85x and 0.94x.
    Costs a second copy of the weights in memory, as `PrepackedDenseMethod` does; inputs the
    kernel cannot take (not contiguous, or needing gradients) use the plain weight too.
    """

    name = "none"  # the same weights, unquantized; describe() says "prepacked_weights"
    MAX_ROWS = 256

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().load(layer, weight, bias)
        assert layer.weight is not None  # just set by DenseMethod.load
        layer.register_buffer(
            "panels", native.pack_linear_weight(layer.weight.data), persistent=False
        )

    def packed_bytes(self, layer: Linear) -> int:
        return layer.panels.numel() * layer.panels.element_size()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(layer.in_features, 1)
        if (
            rows > self.MAX_ROWS or rows == 1 or not native.takes(x) or x.requires_grad
        ):  # the kernel has no backward
            assert layer.weight is not None  # set by load(), which runs before any forward
            return F.linear(x, layer.weight, layer.bias)
        y = native.linear(
            x.reshape(-1, layer.in_features), layer.panels, layer.out_features, layer.bias
        )
        return y.reshape(*x.shape[:-1], layer.out_features)


class Linear(nn.Module):
    """A linear layer that is empty until `load` is called with its weight."""

    # Buffers and attributes the methods set at load (nn.Module keeps buffers in _buffers;
    # these annotations give them their types): PrepackedDenseMethod, PanelDenseMethod,
    # Int8Method, Int4Method (`group_size`: the one this layer got, quant.int4_group_size;
    # `native`: kept in the layout of the engine's C kernels, which multiply it).
    packed_weight: torch.Tensor | None
    panels: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    fifth_bits: torch.Tensor
    scales_and_zeros: torch.Tensor
    int4_packed: bool
    group_size: int
    native: bool

    def __init__(
        self, in_features: int, out_features: int, method: LinearMethod, bias: bool = False
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.method = method
        self.name = ""  # its path in the model, for error messages (set by the Transformer)
        self.native = False
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        # the resident LoRA adapters' weights for this layer (engines/builtin/lora), if any
        self.lora: LoRALayerSlots | None = None

    def load(
        self,
        weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None = None,
        columns: slice | None = None,
    ) -> None:
        """`columns`: a row-parallel shard's input columns of the full `weight` (None: all). A
        checkpoint's QuantizedWeight goes as it is to a method that takes it (auto), else
        dequantized."""
        kept = weight.shape[1] if columns is None else len(range(weight.shape[1])[columns])
        if (weight.shape[0], kept) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} does not fit a linear layer "
                f"of [{self.out_features}, {self.in_features}]"
                + ("" if columns is None else f" (columns {columns.start}:{columns.stop})")
            )
        if self.has_bias != (bias is not None):
            raise ValueError(f"bias expected: {self.has_bias}, given: {bias is not None}")
        if isinstance(weight, QuantizedWeight) and not self.method.takes_quantized:
            weight = weight.dequantize()  # a float method (none, int8, int4) asked for
        # a QuantizedWeight only reaches a method that takes one (its load says so)
        given = cast(torch.Tensor, weight)
        if columns is None:
            self.method.load(self, given, bias)
        else:
            self.method.load_columns(self, given, bias, columns)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.parameters(recurse=False), *self.buffers(recurse=False))]

    def weight_bytes(self) -> int:
        return self.method.weight_bytes(self)

    def packed_bytes(self) -> int:
        return self.method.packed_bytes(self)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """x @ W^T (+ b), and for the rows `lora` assigns an adapter, its delta."""
        y = self.method.apply(self, x)
        if lora is not None and self.lora is not None:
            self.lora.add_delta(y, x, lora)
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.has_bias}, "
            f"method={self.method.name}"
        )
