"""What one tensor-parallel rank keeps of each Hugging Face tensor.

The layout's rules (which rank counts a model allows, heads and K/V heads per rank, the padded
vocabulary) are models/tensor_parallel.py's, shared with the planner; this adds the rank: which
rows of a column-parallel tensor and which columns of a row-parallel one it keeps. K/V heads
are split like the query heads, or (more ranks than K/V heads) each rank keeps the one K/V head
its query heads read. Padding rows of the vocabulary are zero and never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.base import ConfigError
from engines.builtin.layers.quant import int4_group_size, int4_straddle_error
from models.config import ModelConfig
from models.quantized_weight import QuantizedWeight, Weight
from models.tensor_parallel import TPShard, tp_shard


@dataclass(frozen=True)
class RankShard:
    rank: int
    layout: TPShard
    head_dim: int
    num_kv_heads_total: int  # the model's

    @property
    def size(self) -> int:
        return self.layout.world_size

    @property
    def num_heads(self) -> int:
        return self.layout.heads

    @property
    def num_kv_heads(self) -> int:
        return self.layout.kv_heads

    @property
    def kv_replicated(self) -> bool:
        return self.layout.kv_replicated

    @property
    def intermediate_size(self) -> int:
        return self.layout.intermediate

    @property
    def vocab_per_rank(self) -> int:
        return self.layout.vocab

    @property
    def vocab_start(self) -> int:
        return self.rank * self.layout.vocab

    @property
    def kv_head_start(self) -> int:
        if self.kv_replicated:  # ranks r * kv / size .. read K/V head r * kv // size
            return self.rank * self.num_kv_heads_total // self.size
        return self.rank * self.num_kv_heads

    # ---- the rows and columns of each Hugging Face tensor this rank keeps -------------------

    def q_rows(self) -> slice:
        rows = self.num_heads * self.head_dim
        return slice(self.rank * rows, (self.rank + 1) * rows)

    def kv_rows(self) -> slice:
        start = self.kv_head_start * self.head_dim
        return slice(start, start + self.num_kv_heads * self.head_dim)

    def mlp_rows(self) -> slice:
        width = self.intermediate_size
        return slice(self.rank * width, (self.rank + 1) * width)

    @property
    def experts(self) -> range:
        """The mixture-of-experts layers' experts this rank holds (all of them on one rank)."""
        count = self.layout.experts
        return range(self.rank * count, (self.rank + 1) * count)

    def shared_expert_rows(self) -> slice:
        width = self.layout.shared_expert_intermediate
        return slice(self.rank * width, (self.rank + 1) * width)

    def vocab_rows(self, table: Weight) -> Weight:
        """This rank's rows of an embedding table or LM head [vocab, hidden], zero-padded."""
        start, rows = self.vocab_start, self.vocab_per_rank
        kept = table[start : start + rows]
        if kept.shape[0] == rows:
            return kept
        if isinstance(kept, QuantizedWeight):
            return kept.padded_rows(rows)
        return torch.cat([kept, kept.new_zeros(rows - kept.shape[0], kept.shape[1])])


def shard_for(cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False) -> RankShard:
    """Rank `rank` of `size` (`expert_parallel`: engine.enable_expert_parallel); a ConfigError
    naming the option and the allowed values when the model does not split that way."""
    try:
        layout = tp_shard(cfg, size, expert_parallel=expert_parallel)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return RankShard(rank, layout, cfg.head_dim, cfg.num_kv_heads)


def check_int4_groups(cfg: ModelConfig, shard: RankShard, group_size: int) -> None:
    """A ConfigError when an INT4 layer's groups would straddle the shards: the same check the
    weight loader makes (LinearMethod.load_columns), made before any rank starts. Only the
    row-parallel layers split their inputs, along which the groups run."""
    if shard.size == 1:
        return
    row_parallel = {
        "attn.o_proj": (cfg.num_heads * cfg.head_dim, shard.num_heads * cfg.head_dim),
        "mlp.down_proj": (cfg.intermediate_size, shard.intermediate_size),
    }
    for name, (full_width, shard_width) in row_parallel.items():
        group = int4_group_size(full_width, group_size)
        if group is not None and shard_width % group:  # None: the layer falls back to INT8
            raise int4_straddle_error(f"layers.*.{name}", full_width, shard_width, group)
