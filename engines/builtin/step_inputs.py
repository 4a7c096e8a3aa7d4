"""A step's integer inputs (token ids, positions, KV slots, block tables, ...) in one
preallocated buffer per side, so that a step costs one host-to-device copy and CUDA graphs can
replay over fixed addresses."""

from __future__ import annotations

import numpy as np
import torch


def group_input(name: str, group: int) -> str:
    """The section of KV group `group`'s `slots` or `block_tables` (group 0's: the name)."""
    return name if group == 0 else f"{name}_{group}"


class StepInputs:
    """A step's integer inputs, in one device buffer mirrored by one host buffer (pinned on
    CUDA). prepare() writes the host side through numpy views and `upload` moves it with one
    copy; on CPU both sides are the same memory and nothing is copied. The device views keep
    their addresses for the engine's lifetime (CUDA graphs read them on replay).

    Sections, in buffer order; the upload copies the prefix up to the last block-table row in
    use (token sections whole: 32 bytes x max_num_batched_tokens, small next to a launch)."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        device: torch.device,
        num_kv_groups: int = 1,
    ) -> None:
        """`num_kv_groups`: KV cache groups (kv_cache/groups.py), each with its own slots and
        block tables (`group_input`); the first group's come last, so that a step with one
        group uploads the prefix up to the rows it uses."""
        self.num_kv_groups = num_kv_groups
        sections: list[tuple[str, np.dtype, tuple[int, ...]]] = [
            ("qsl", np.dtype(np.int32), (max_seqs + 1,)),
            ("seq_lens", np.dtype(np.int32), (max_seqs,)),
            # one per sampling row, or 1 + drafts per speculative row: at most every token
            ("logits_indices", np.dtype(np.int64), (max(max_tokens, max_seqs),)),
            ("input_ids", np.dtype(np.int64), (max_tokens,)),
            ("positions", np.dtype(np.int64), (max_tokens,)),
        ]
        for group in reversed(range(num_kv_groups)):
            sections += [
                (group_input("slots", group), np.dtype(np.int64), (max_tokens,)),
                (group_input("block_tables", group), np.dtype(np.int32), (max_seqs, max_blocks)),
            ]
        offsets, end = {}, 0
        for name, dtype, shape in sections:
            offsets[name] = end
            end += -(-int(np.prod(shape)) * dtype.itemsize // 8) * 8  # keep 8-byte alignment
        self.device_bytes = torch.zeros(end, dtype=torch.uint8, device=device)
        self.same_memory = device.type == "cpu"
        self.host_bytes = (
            self.device_bytes
            if self.same_memory
            else torch.zeros(end, dtype=torch.uint8, pin_memory=True)
        )
        self.device: dict[str, torch.Tensor] = {}
        self._host: dict[str, np.ndarray] = {}
        host_np = self.host_bytes.numpy()
        for name, dtype, shape in sections:
            start, size = offsets[name], int(np.prod(shape)) * dtype.itemsize
            self._host[name] = host_np[start : start + size].view(dtype).reshape(shape)
            torch_dtype = torch.int32 if dtype == np.int32 else torch.int64
            self.device[name] = (
                self.device_bytes[start : start + size].view(torch_dtype).view(shape)
            )
        self._tables_offset = offsets["block_tables"]
        self._table_row_bytes = max_blocks * 4
        self._uploaded: torch.cuda.Event | None = None

    def host_arrays(self) -> dict[str, np.ndarray]:
        """The host side, once the last upload has finished reading it."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None
        return self._host

    def upload(self, with_tables: bool, num_seqs: int) -> None:
        if self.same_memory:
            return
        end = self._tables_offset + (self._table_row_bytes * num_seqs if with_tables else 0)
        self.device_bytes[:end].copy_(self.host_bytes[:end], non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()
