"""Building blocks of the transformer: linear layers with a pluggable storage and multiply
(linear.py: the `LinearMethod` interface, dense methods; quant.py: INT8/INT4;
checkpoint_quant.py: auto, a checkpoint's own quantization; fp8.py: FP8 at load; registered
in `LINEAR_METHODS` by `engine.quantization`), norms, rotary."""

from __future__ import annotations

from engines.builtin.layers import fp8, quant  # noqa: F401  (register the quantized methods)
from engines.builtin.layers.checkpoint_quant import AutoMethod
from engines.builtin.layers.linear import (
    LINEAR_METHODS,
    LinearMethod,
    LinearOptions,
    PanelDenseMethod,
    PrepackedDenseMethod,
)


def make_linear_method(
    quantization: str,
    group_size: int = 128,
    prepack: str | None = None,
    zero_point: str = "float",
    activations: str = "float",
    native_reason: str | None = "not requested",
) -> LinearMethod:
    """The method for `engine.quantization`; `group_size`, `zero_point` and `activations` are
    used by group-wise methods (int4); quantized methods multiply through the engine's C
    kernels where `native_reason` is None (else it says why not);
    `prepack` ("panels" or "onednn") keeps unquantized CPU weights also in that packed
    layout, for the engine's own GEMM or oneDNN's."""
    method = LINEAR_METHODS.get(quantization)
    options = LinearOptions(group_size, zero_point, activations, native_reason)
    dense: LinearMethod | None = None
    if method.dense and prepack is not None:
        packed = {"panels": PanelDenseMethod, "onednn": PrepackedDenseMethod}
        if prepack not in packed:
            raise ValueError(f"prepack: {prepack!r}; allowed: panels|onednn")
        dense = packed[prepack]()
    if method is AutoMethod:  # float weights as `none` keeps them, quantized ones as stored
        return AutoMethod(options, dense)
    return dense if dense is not None else method.create(options)


__all__ = ["LINEAR_METHODS", "LinearMethod", "make_linear_method"]
