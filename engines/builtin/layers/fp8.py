"""`engine.quantization=fp8`: FP8 (e4m3) weights made at load from a float checkpoint, one scale
per output channel (llm-compressor's FP8_DYNAMIC scheme; vLLM's `fp8` makes one per tensor),
scale = max|w| / 448, the largest e4m3 value, and w rounded to the nearest e4m3 number. The
layer is then kept and multiplied as an FP8 checkpoint's weight is (checkpoint_quant.py): the
engine's C kernels on CPU, widening the bytes in registers; the Triton FP8 kernel on CUDA;
elsewhere the weight dequantized for each product. Activations stay in the compute dtype
(weight-only FP8, W8A16)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engines.builtin.layers.checkpoint_quant import CheckpointQuantMethod
from engines.builtin.layers.linear import LINEAR_METHODS, LinearMethod, LinearOptions
from models.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from engines.builtin.layers.linear import Linear

E4M3_MAX = 448.0


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    """[out, in] float -> e4m3 values with one float32 scale a row (max|w| / 448; an all-zero
    row keeps scale 1)."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    values = (w / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(
        values, scales, torch.zeros_like(scales), w.shape[1], 8, "FP8 e4m3 per-channel (at load)"
    )


@LINEAR_METHODS.register("fp8")
class Fp8Method(CheckpointQuantMethod):
    """FP8 weights quantized at load (this module's docstring)."""

    name = "fp8"
    held = "rounded to e4m3 at load"

    @classmethod
    def create(cls, options: LinearOptions) -> LinearMethod:
        return cls(options.native_reason)

    def __init__(self, native_reason: str | None) -> None:
        super().__init__("FP8 e4m3 per-channel (at load)", "float", native_reason)

    def load(self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.keep(layer, quantize_fp8(weight), bias)

    def load_columns(
        self, layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice
    ) -> None:
        # each row's scale is its maximum over ALL inputs, whichever columns this rank keeps
        self.keep(layer, quantize_fp8(weight).columns(columns), bias)
