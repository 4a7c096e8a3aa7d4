"""What one tensor-parallel rank keeps of the model, Megatron-style.

Column-parallel layers split their output rows: the Q/K/V projection by attention head, gate
and up by intermediate channel, the LM head and the embedding table by vocabulary row.
Row-parallel layers (o_proj, down_proj) split their input columns to match, so each rank's
partial sum needs one all-reduce. K/V heads are split like the query heads when the rank count
divides them; with more ranks than K/V heads (MQA, or GQA at a large rank count) each rank keeps
the one K/V head its query heads read, a replica. The vocabulary is padded up to a multiple of
the rank count: the padding rows are zero and never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.base import ConfigError
from models.config import ModelConfig, ceil_div


def allowed_sizes(cfg: ModelConfig, up_to: int = 64) -> list[int]:
    """Rank counts this model splits over: they divide the attention heads and the MLP's
    intermediate size, and divide or are a multiple of the K/V heads."""
    return [
        n
        for n in range(1, up_to + 1)
        if cfg.num_heads % n == 0
        and cfg.intermediate_size % n == 0
        and (cfg.num_kv_heads % n == 0 or n % cfg.num_kv_heads == 0)
    ]


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's K/V heads (1 when replicated)
    kv_head_start: int  # the first K/V head it keeps
    intermediate_size: int
    vocab_per_rank: int  # embedding and LM head rows per rank (the padded vocabulary / size)
    head_dim: int
    num_kv_heads_total: int  # the model's

    @property
    def kv_replicated(self) -> bool:
        return self.num_kv_heads * self.size > self.num_kv_heads_total

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    # ---- the rows and columns of each Hugging Face tensor this rank keeps -------------------

    def q_rows(self) -> slice:
        rows = self.num_heads * self.head_dim
        return slice(self.rank * rows, (self.rank + 1) * rows)

    def kv_rows(self) -> slice:
        start = self.kv_head_start * self.head_dim
        return slice(start, start + self.num_kv_heads * self.head_dim)

    def mlp_rows(self) -> slice:
        return slice(self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size)

    def vocab_rows(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's rows of an embedding table or LM head [vocab, hidden], zero-padded."""
        start, rows = self.vocab_start, self.vocab_per_rank
        kept = table[start : start + rows]
        if kept.shape[0] == rows:
            return kept
        pad = table.new_zeros(rows - kept.shape[0], table.shape[1])
        return torch.cat([kept, pad])


def shard_for(cfg: ModelConfig, rank: int, size: int) -> TPShard:
    """Rank `rank` of `size`; a ConfigError naming engine.tensor_parallel_size when the model
    does not split over `size` ranks."""
    if size not in allowed_sizes(cfg, max(size, 1)):
        allowed = "|".join(map(str, allowed_sizes(cfg)))
        raise ConfigError(
            f"engine.tensor_parallel_size: {size} does not split this model ({cfg.num_heads} "
            f"attention heads, {cfg.num_kv_heads} K/V heads, intermediate_size "
            f"{cfg.intermediate_size}): the rank count must divide the heads and the "
            f"intermediate size, and divide or be a multiple of the K/V heads; allowed: {allowed}"
        )
    kv = cfg.num_kv_heads
    if kv % size == 0:
        kv_local, kv_start = kv // size, rank * (kv // size)
    else:  # size is a multiple of kv: ranks r*size/kv .. share K/V head r
        kv_local, kv_start = 1, rank * kv // size
    return TPShard(
        rank=rank,
        size=size,
        num_heads=cfg.num_heads // size,
        num_kv_heads=kv_local,
        kv_head_start=kv_start,
        intermediate_size=cfg.intermediate_size // size,
        vocab_per_rank=ceil_div(cfg.vocab_size, size),
        head_dim=cfg.head_dim,
        num_kv_heads_total=kv,
    )
