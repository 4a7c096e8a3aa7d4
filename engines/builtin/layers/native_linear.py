"""A Linear layer as the C kernels take it (native.LinearWeights): what the decode program
(decode_program.py) and the grouped experts (moe.py) hand to C for each of their layers."""

from __future__ import annotations

import torch

from engines.builtin import native
from engines.builtin.layers.checkpoint_quant import CheckpointQuantMethod
from engines.builtin.layers.linear import Linear, PanelDenseMethod
from engines.builtin.layers.quant import Int4Method, Int8Method
from engines.builtin.native import quant as native_quant


def c_pointer(t: torch.Tensor | None, keep: list[torch.Tensor] | None = None) -> int | None:
    """t's address; `keep` holds t, so that the address stays valid while the C structs live
    (a layer loaded again after they were built would otherwise free what they read)."""
    if t is None:
        return None
    if keep is not None:
        keep.append(t)
    return t.data_ptr()


def linear_problem(layer: Linear) -> str | None:
    """Why the C kernels cannot take `layer` as it is kept (None: they can)."""
    method = layer.method
    if isinstance(method, PanelDenseMethod):
        return None
    if layer._buffers.get("input_order") is not None:
        return f"{layer.name} gathers its inputs in act-order"
    if isinstance(method, Int8Method | Int4Method | CheckpointQuantMethod) and layer.native:
        return None
    return f"{layer.name} is kept as {method.describe(layer)!r}"


def linear_weights(layer: Linear, keep: list[torch.Tensor]) -> native.LinearWeights:
    """`layer`'s weights as C reads them (`linear_problem` said it can)."""
    method = layer.method
    bias = c_pointer(None if layer.bias is None else layer.bias.data, keep)
    shape = (layer.in_features, layer.out_features)
    weights = native.LinearWeights
    if isinstance(method, PanelDenseMethod):
        panels = c_pointer(layer.panels, keep)
        return weights(native.LINEAR_DENSE, panels, None, None, bias, *shape, 0, 0)
    weight, scales = c_pointer(layer.qweight, keep), c_pointer(layer.scales, keep)
    if isinstance(method, CheckpointQuantMethod):
        activations = method.layer_activations(layer)
        kinds = {
            "fp8": (native.LINEAR_FP8, native.LINEAR_FP8),
            "int4": (native.LINEAR_INT4, native.LINEAR_INT4_A8),
            "int5 blocks": (native.LINEAR_INT5B, native.LINEAR_INT5B_A8),
            "int8 blocks": (native.LINEAR_INT8B, native.LINEAR_INT8B_A8),
            "grouped int8": (native.LINEAR_INT8G, native.LINEAR_INT8G_A8),
        }
        kind = kinds[method.layout][activations == "int8"]
        mins = c_pointer(layer.mins, keep)
        fifth = c_pointer(layer.fifth_bits, keep) if method.layout == "int5 blocks" else None
        rows_max = native_quant.rows_max(method.kernel_bits, activations)
        return weights(kind, weight, scales, mins, bias, *shape, layer.group_size, rows_max, fifth)
    if isinstance(method, Int4Method):
        int8_inputs = method.activations == "int8"
        kind = native.LINEAR_INT4_A8 if int8_inputs else native.LINEAR_INT4
        mins = c_pointer(layer.mins, keep)
        rows_max = native_quant.rows_max(4, method.activations)
        return weights(kind, weight, scales, mins, bias, *shape, layer.group_size, rows_max)
    rows_max = native_quant.rows_max(8)
    return weights(native.LINEAR_INT8, weight, scales, None, bias, *shape, 0, rows_max)
