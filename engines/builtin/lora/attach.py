"""Give a model's decoder blocks their LoRA slots: one `LoRALayerSlots` per LoRA-carrying linear
layer, holding this tensor-parallel rank's shard of each part, set on the layer as `.lora`."""

from __future__ import annotations

import torch

from engines.builtin.layers.linear import Linear
from engines.builtin.lora.layer import LORA_LAYERS, LoRALayerSlots, LoRAPart
from engines.builtin.model import Transformer
from engines.builtin.weights import shard_columns, shard_rows

#: the row-parallel layers: a rank keeps some of their input columns, all their outputs
_ROW_PARALLEL = ("attn.o_proj", "mlp.down_proj")


def attach_lora_slots(
    model: Transformer,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    native: bool = False,
) -> list[LoRALayerSlots]:
    """`native`: the deltas through the engine's C kernels (CPU float32, the library built)."""
    shard = model.shard
    attached = []
    for index, block in enumerate(model.layers):
        for path, modules in LORA_LAYERS.items():
            linear = block.get_submodule(path)
            assert isinstance(linear, Linear)
            if path in _ROW_PARALLEL:
                ((module, stem),) = modules
                columns = shard_columns(shard, stem)
                parts: tuple[LoRAPart, ...] = (
                    LoRAPart(module, linear.out_features, columns=columns),
                )
            else:
                parts = tuple(
                    LoRAPart(module, rows.stop - rows.start, rows=rows)
                    for module, stem in modules
                    for rows in [shard_rows(shard, stem)]
                )
            slots = LoRALayerSlots(
                index, parts, linear.in_features, max_loras, max_rank, dtype, device, native
            )
            linear.lora = slots
            attached.append(slots)
    return attached
