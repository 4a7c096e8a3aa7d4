"""Which rows of a step run under which adapter slot: built once per step from the scheduled
sequences and read by every LoRA-carrying linear layer of the forward (no global state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRABatch:
    """The step's rows grouped by adapter slot: (slot, the rows' indices in the packed batch,
    None when the slot has every row). Rows of the base model belong to no group."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]
    #: each row's slot, -1 for the base model (int32): what the C and Triton kernels read
    slot_of_row: torch.Tensor

    @classmethod
    def of(
        cls, slot_per_seq: list[int | None], rows_per_seq: list[int], device: torch.device
    ) -> LoRABatch | None:
        """From each scheduled sequence's slot (None: the base model) and its rows this step,
        in the packed order; None when no row has an adapter."""
        total = sum(rows_per_seq)
        ranges: dict[int, list[range]] = {}
        per_row: list[int] = []
        start = 0
        for slot, rows in zip(slot_per_seq, rows_per_seq, strict=True):
            if slot is not None and rows:
                ranges.setdefault(slot, []).append(range(start, start + rows))
            per_row += [-1 if slot is None else slot] * rows
            start += rows
        if not ranges:
            return None
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot, spans in ranges.items():
            count = sum(len(span) for span in spans)
            if count == total:
                groups.append((slot, None))
                continue
            index = [i for span in spans for i in span]
            groups.append((slot, torch.tensor(index, dtype=torch.long, device=device)))
        slot_of_row = torch.tensor(per_row, dtype=torch.int32, device=device)
        return cls(tuple(groups), slot_of_row)
