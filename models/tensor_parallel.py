"""Tensor parallelism's shape arithmetic: which sizes a model allows and what one rank holds.

The layout is Megatron's. Per decoder layer the q/k/v and gate/up projections are
column-parallel (each rank holds 1/N of their output rows) and o_proj and down_proj are
row-parallel (1/N of their input columns, each followed by one all-reduce of the hidden
states); attention heads are split over the ranks, the norms are replicated. The embedding is
vocab-parallel (1/N of the rows, then an all-reduce) and the LM head column-parallel (1/N of
the vocabulary, then a gather of the logits); the vocabulary is padded up to a multiple of N so
that every rank holds the same number of rows.

KV heads are split like the query heads when N divides num_kv_heads; when N is a multiple of
num_kv_heads each rank keeps the one KV head its query heads read (each KV head is then
replicated on N / num_kv_heads ranks); any other N cannot be laid out. N must also divide
num_heads and intermediate_size.

Mixture-of-experts layers split by expert parallelism (`engine.enable_expert_parallel`): each
rank holds num_experts / N whole experts (rank r the r-th run of them) and 1/N of the shared
expert's width; every rank routes every token, runs the tokens routed to its own experts, and
the all-reduce after the MLP adds the ranks' shares, as it adds a dense MLP's. N must divide
num_experts (and the shared expert's width). Without it an MoE model runs on one rank.

This module is pure shape arithmetic, shared by whoever needs it (the planner in
harness/measuring/kv_calc.py, the engine): no torch, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.config import ModelConfig, ceil_div

TP_KEY = "engine.tensor_parallel_size"


EP_KEY = "engine.enable_expert_parallel"


def _splits_across_ranks(model: ModelConfig, expert_parallel: bool) -> bool:
    """Whether the layout can split the model at all: not its mixture-of-experts layers
    without expert parallelism, nor OLMoE's q/k norms, taken over every head at once."""
    return (model.num_experts == 0 or expert_parallel) and model.qk_norm != "full"


def _layout_ok(model: ModelConfig, n: int, expert_parallel: bool = False) -> bool:
    if n > 1 and not _splits_across_ranks(model, expert_parallel):
        return False
    dense = any(not model.is_moe_layer(i) for i in range(model.num_layers))
    return (
        model.num_heads % n == 0
        and (not dense or model.intermediate_size % n == 0)
        and (model.num_kv_heads % n == 0 or n % model.num_kv_heads == 0)
        and model.num_experts % n == 0
        and model.shared_expert_intermediate_size % n == 0
    )


def allowed_tp_sizes(model: ModelConfig, expert_parallel: bool = False) -> list[int]:
    """Every tensor-parallel size the layout allows: the divisors of num_heads that also divide
    intermediate_size (of any dense layer) and either divide num_kv_heads or are a multiple of
    it; with expert parallelism, that also divide num_experts and the shared expert's width."""
    return [n for n in range(1, model.num_heads + 1) if _layout_ok(model, n, expert_parallel)]


@dataclass(frozen=True)
class TPShard:
    """What one of `world_size` ranks holds of each split dimension."""

    world_size: int
    heads: int  # query heads per rank
    kv_heads: int  # KV heads per rank: num_kv_heads / N, or 1 when replicated
    kv_replicas: int  # ranks holding each KV head: 1 when split, N / num_kv_heads when not
    intermediate: int  # MLP width per rank
    vocab: int  # embedding and LM-head rows per rank: padded_vocab / N
    padded_vocab: int  # the vocabulary rounded up to a multiple of N
    experts: int = 0  # whole experts per rank: num_experts / N with expert parallelism
    shared_expert_intermediate: int = 0  # the shared expert's width per rank

    @property
    def kv_replicated(self) -> bool:
        return self.kv_replicas > 1


def tp_shard(
    model: ModelConfig, world_size: Any, key: str = TP_KEY, expert_parallel: bool = False
) -> TPShard:
    """The per-rank shape for `world_size` ranks (`expert_parallel`: a mixture-of-experts
    model's experts placed per rank); a ValueError naming `key` and the allowed sizes when the
    layout cannot split this model that way."""
    if expert_parallel and not model.num_experts:
        raise ValueError(f"{EP_KEY}: true is invalid for a dense model; allowed: false")
    allowed = allowed_tp_sizes(model, expert_parallel)
    valid = isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1
    if valid and world_size > 1 and not _splits_across_ranks(model, expert_parallel):
        reason = (
            "OLMoE's q/k norms over every head run on one rank"
            if model.qk_norm == "full"
            else f"its mixture-of-experts layers split by expert only: set {EP_KEY}=true"
        )
        raise ValueError(f"{key}: {world_size!r} is invalid for this model: {reason}; allowed: 1")
    if not valid or not _layout_ok(model, world_size, expert_parallel):
        moe = (
            f", num_experts={model.num_experts}, shared expert "
            f"{model.shared_expert_intermediate_size}: it must divide them too"
            if model.num_experts
            else ""
        )
        raise ValueError(
            f"{key}: {world_size!r} is invalid for this model (num_heads={model.num_heads}, "
            f"num_kv_heads={model.num_kv_heads}, intermediate_size={model.intermediate_size}: "
            "it must divide num_heads and intermediate_size, and divide num_kv_heads or be a "
            f"multiple of it{moe}); allowed: {'|'.join(map(str, allowed))}"
        )
    n = world_size
    split = model.num_kv_heads % n == 0
    padded = ceil_div(model.vocab_size, n) * n
    return TPShard(
        world_size=n,
        heads=model.num_heads // n,
        kv_heads=model.num_kv_heads // n if split else 1,
        kv_replicas=1 if split else n // model.num_kv_heads,
        intermediate=model.intermediate_size // n,
        vocab=padded // n,
        padded_vocab=padded,
        experts=model.num_experts // n,
        shared_expert_intermediate=model.shared_expert_intermediate_size // n,
    )


@dataclass(frozen=True)
class RankParams:
    """The parameters one rank holds, by kind (all layers together)."""

    block_linear: int  # the blocks' matmul weights: q/k/v, o, gate/up, down (every expert's)
    block_bias: int  # the q/k/v biases (attention_bias models), split with their rows
    norms: int  # every RMSNorm weight (q/k norms too), replicated on each rank
    embedding: int  # the rank's rows of the vocab-parallel embedding
    lm_head: int  # the rank's rows of the column-parallel LM head; 0 when tied

    @property
    def total(self) -> int:
        return self.block_linear + self.block_bias + self.norms + self.embedding + self.lm_head

    @property
    def lm_head_rows(self) -> int:
        """The LM head's weights a rank reads per step: its own or, tied, the embedding's."""
        return self.lm_head or self.embedding


def rank_params(model: ModelConfig, shard: TPShard) -> RankParams:
    """Per-rank parameters; at world_size 1 they add up to model.num_parameters()."""
    hidden = model.hidden_size
    q = shard.heads * model.head_dim
    kv = shard.kv_heads * model.head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    moe_mlp = (  # the rank's experts, the router, its share of the shared expert
        shard.experts * 3 * hidden * model.expert_intermediate_size
        + model.num_experts * hidden
        + 3 * hidden * shard.shared_expert_intermediate
        + (hidden if model.shared_expert_intermediate_size else 0)
    )
    mlps = sum(
        moe_mlp if model.is_moe_layer(i) else 3 * hidden * shard.intermediate
        for i in range(model.num_layers)
    )
    bias = (q + 2 * kv) if model.attention_bias else 0
    qk_norms = {"none": 0, "head": 2 * model.head_dim, "full": q + kv}[model.qk_norm]
    embedding = shard.vocab * hidden
    return RankParams(
        block_linear=model.num_layers * attention + mlps,
        block_bias=model.num_layers * bias,
        norms=model.num_layers * ((4 if model.sandwich_norms else 2) * hidden + qk_norms) + hidden,
        embedding=embedding,
        lm_head=0 if model.tie_word_embeddings else embedding,
    )


def kv_bytes_per_token_per_rank(
    model: ModelConfig, shard: TPShard, bytes_per_element: float
) -> float:
    """2 (K and V) x layers x the rank's KV heads x head_dim x bytes: what one token's KV
    costs on each rank (a replicated KV head is stored on every rank that reads it)."""
    return 2 * model.num_layers * shard.kv_heads * model.head_dim * bytes_per_element
