"""A linear layer's LoRA slots: the A and B weights of every resident adapter, stacked so that
one step applies each adapter's delta to its own rows.

For a fused layer (q/k/v in one projection, gate/up in another) each adapter has one A per part
and one B per part; the parts' A are packed into one [parts * r, in] block per slot, so that the
shrink of a row is one pass over it (h = A x, [parts * r]), and each part's expand adds into its
own output columns (B_part h_part; B is kept transposed, [rank, outputs], so the expand adds
contiguous rows). A slot holds its adapter's own rank r (the unused rows up to max_lora_rank
stay out of the product).

Three ways to apply it, the same numbers (tests/engines/builtin/test_lora_kernels.py): one call
into the engine's C kernels per layer on CPU float32 (the default; a torch formulation costs
several dispatches per adapter per layer, which at decode outweigh the multiply-adds:
docs/lora.md), the Triton kernels on CUDA, and per slot in torch otherwise. A tensor-parallel
rank keeps the shard its base layer keeps: a column-parallel layer's B rows (A whole), a
row-parallel layer's A columns (B whole); the row-parallel delta is a partial sum like the base
output, added before the all-reduce that sums both.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engines.builtin import native as native_kernels
from engines.builtin.lora.adapter import LoRAAdapter
from engines.builtin.lora.batch import LoRABatch


@dataclass(frozen=True)
class LoRAPart:
    """One Hugging Face module inside an engine linear layer (the parts fill the layer's output
    columns in order): its name, its outputs on this rank, and the slice of its full B rows
    (column-parallel) or A columns (row-parallel) this rank keeps."""

    module: str
    out_size: int
    rows: slice | None = None  # of B: a column-parallel shard
    columns: slice | None = None  # of A: a row-parallel shard


class LoRALayerSlots:
    def __init__(
        self,
        layer_index: int,
        parts: tuple[LoRAPart, ...],
        in_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        native: bool = False,
    ) -> None:
        """`native`: CPU float32 with the engine's C kernels built (one call per layer)."""
        self.layer_index = layer_index
        self.parts = parts
        self.a = torch.zeros(
            max_loras, len(parts) * max_rank, in_features, dtype=dtype, device=device
        )
        # every part's B, transposed, in one tensor: [slot, rank, outputs], each part's outputs
        # in order (its columns of y), so that the expand adds contiguous rows into y's
        out = sum(part.out_size for part in parts)
        self.b = torch.zeros(max_loras, max_rank, out, dtype=dtype, device=device)
        ends = list(itertools.accumulate(part.out_size for part in parts))
        self.part_ends = torch.tensor(ends, dtype=torch.int64)
        self.part_rows = [
            slice(end - part.out_size, end) for end, part in zip(ends, parts, strict=True)
        ]
        self.ranks = [0] * max_loras  # 0: an empty slot, or an adapter that skips this layer
        self.rank_tensor = torch.zeros(max_loras, dtype=torch.int32, device=device)
        # the C view of the slots (it points into a, b and rank_tensor, which `write` fills in
        # place), read by each native call and by the decode program (decode_program.py)
        self.native_weights = (
            native_kernels.lora_weights(self.a, self.b, self.rank_tensor, self.part_ends)
            if native
            else None
        )

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter`'s weights for this layer into `slot` (zeros where it targets none of
        the parts)."""
        r = adapter.rank
        targeted = False
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, part in enumerate(self.parts):
            pair = adapter.weights.get((self.layer_index, part.module))
            if pair is None:
                continue
            a, b = pair
            if part.columns is not None:
                a = a[:, part.columns]
            if part.rows is not None:
                b = b[part.rows]
            self.a[slot, index * r : (index + 1) * r].copy_(a)
            self.b[slot, :r, self.part_rows[index]].copy_(b.T)
            targeted = True
        self.ranks[slot] = r if targeted else 0
        self.rank_tensor[slot] = self.ranks[slot]

    def clear(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.rank_tensor[slot] = 0

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        """y += each row's adapter delta (in place); rows of the base model are left alone.
        One call into the C kernels on CPU float32 (`native_weights`), the Triton kernels
        (triton_kernels.py) on CUDA, else per slot in torch."""
        if self.native_weights is not None and native_kernels.takes(x, y):
            native_kernels.lora_bgmv(self.native_weights, x, y, batch.slot_of_row)
            return
        if x.is_cuda:
            self._add_delta_triton(y, x, batch)
            return
        for slot, rows in batch.groups:
            r = self.ranks[slot]
            if not r:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = xs @ self.a[slot, : len(self.parts) * r].T
            deltas = [
                shrunk[:, index * r : (index + 1) * r] @ self.b[slot, :r, rows_of]
                for index, rows_of in enumerate(self.part_rows)
            ]
            delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
            if rows is None:
                y.add_(delta)
            else:
                y.index_add_(0, rows, delta)

    def _add_delta_triton(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        from engines.builtin.lora.triton_kernels import lora_expand, lora_shrink

        shrunk = lora_shrink(x, self.a, batch.slot_of_row, self.rank_tensor, len(self.parts))
        for index, rows_of in enumerate(self.part_rows):
            b = self.b[:, :, rows_of]
            lora_expand(shrunk, b, batch.slot_of_row, self.rank_tensor, y, index, rows_of.start)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b))


#: The engine's LoRA-carrying layers in a decoder block: its path in the block, and the
#: Hugging Face modules it fuses, in output order, each with the checkpoint stem the loader
#: shards it by (engines/builtin/weights.py)
LORA_LAYERS: dict[str, tuple[tuple[str, str], ...]] = {
    "attn.qkv_proj": (
        ("q_proj", "self_attn.q_proj"),
        ("k_proj", "self_attn.k_proj"),
        ("v_proj", "self_attn.v_proj"),
    ),
    "attn.o_proj": (("o_proj", "self_attn.o_proj"),),
    "mlp.gate_up_proj": (("gate_proj", "mlp.gate_proj"), ("up_proj", "mlp.up_proj")),
    "mlp.down_proj": (("down_proj", "mlp.down_proj"),),
}
