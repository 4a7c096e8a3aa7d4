"""What attention needs to know about one packed, variable-length step.

The batch is packed: the new tokens of every scheduled sequence are concatenated, single-token
decodes first, then prefill chunks. `query_start_loc[i]:query_start_loc[i+1]` are sequence i's
tokens; `seq_lens[i]` is its context length once this step's tokens are in the cache.
Device tensors are views into buffers the model runner preallocates at the largest step size,
so their addresses are stable from step to step (what CUDA graph capture needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engines.builtin.lora.batch import LoRABatch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot each new K/V is written to
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    # Host copies for the parts of the reference path that loop over prefilling sequences.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    num_decodes: int  # sequences 0..num_decodes-1 contribute exactly one query token
    max_seq_len: int
    block_size: int
    sliding_window: int | None
    use_cache: bool  # False for kv_cache=none: every step brings the whole context
    #: Contiguous KV with a sliding window: each sequence's region is a ring of `block_size`
    #: (= window) slots holding the last window positions, in rotated order. Attention is
    #: order-free, so a decode reads all min(seq_len, window) slots unmasked.
    ring: bool = False
    #: Gemma 2's attention soft cap: scores -> cap * tanh(scores / cap) before the softmax.
    #: Set per layer kind by the model (Transformer.layer_metadata), like a layer's own window.
    logit_softcap: float | None = None
    #: Tokens whose K/V are stored (None: all); a ring keeps only a prompt's last window.
    write_index: torch.Tensor | None = None
    #: What the attention backend derives from this metadata once and every layer of the step
    #: reuses (masks, orderings). Lives for one forward: the runner builds new metadata per
    #: step, and CUDA graph buckets, which keep theirs, clear it before each forward.
    per_step: dict[str, Any] = field(default_factory=dict)
    #: LoRA: which rows run under which adapter slot (None: every row runs the base model).
    #: Not attention's, but the step's, read by the linear layers the forward passes it to.
    lora: LoRABatch | None = None
    #: KV groups 1.. of a hybrid cache (kv_cache/groups.py): each group's (slot_mapping,
    #: block_tables), which its layers read instead (Transformer.layer_metadata). Empty: every
    #: layer reads the fields above.
    group_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes
