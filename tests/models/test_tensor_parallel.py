"""Tensor parallelism's shape arithmetic: the allowed sizes, what one rank holds, the errors."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from models.config import PRESETS, kv_bytes_per_token
from models.tensor_parallel import (
    allowed_tp_sizes,
    kv_bytes_per_token_per_rank,
    rank_params,
    tp_shard,
)

TINY = PRESETS["tiny"]  # vocab 4096, hidden 64, intermediate 176, 2 layers, 4/2 heads, dim 16


def test_llama3_70b_has_llama_3_70bs_shape() -> None:
    cfg = PRESETS["llama3-70b"]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (128256, 8192, 28672)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (80, 64, 8, 128)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (5e5, 1e-5, 8192)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (128000, (128001, 128009))
    assert cfg.num_parameters() == 70_553_706_496  # ~70.6B, Meta's "70B"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_one_rank_holds_the_whole_model(name: str) -> None:
    cfg = PRESETS[name]
    shard = tp_shard(cfg, 1)
    assert rank_params(cfg, shard).total == cfg.num_parameters()
    assert kv_bytes_per_token_per_rank(cfg, shard, 2) == kv_bytes_per_token(cfg, 2)


def test_allowed_sizes_divide_heads_and_intermediate_and_respect_kv_heads() -> None:
    assert allowed_tp_sizes(TINY) == [1, 2, 4]
    # 12 heads, 12 kv heads, intermediate 2048: 3, 6 and 12 do not divide 2048
    assert allowed_tp_sizes(PRESETS["small"]) == [1, 2, 4]
    assert allowed_tp_sizes(PRESETS["llama3-8b"]) == [1, 2, 4, 8, 16, 32]
    assert allowed_tp_sizes(PRESETS["llama3-70b"]) == [1, 2, 4, 8, 16, 32, 64]
    # 12 heads, 4 kv heads, intermediate 1200: 6 divides both but neither divides 4 nor is a
    # multiple of it; 12 is a multiple
    odd = replace(TINY, num_heads=12, num_kv_heads=4, intermediate_size=1200)
    assert allowed_tp_sizes(odd) == [1, 2, 4, 12]


def test_per_rank_parameters_of_tiny_by_hand() -> None:
    # N = 2: 2 q heads and 1 kv head of 16 per rank, intermediate 88, vocab 2048 rows
    params = rank_params(TINY, tp_shard(TINY, 2))
    qkv = 64 * (2 * 16 + 2 * 1 * 16)  # hidden x (q + k + v rows)
    o = (2 * 16) * 64
    mlp = 3 * 64 * 88
    assert params.block_linear == 2 * (qkv + o + mlp) == 2 * (4096 + 2048 + 16896)
    assert params.block_bias == 0
    assert params.norms == 2 * 2 * 64 + 64  # replicated: the whole model's norms
    assert params.embedding == params.lm_head == 2048 * 64
    assert params.total == 46080 + 320 + 2 * 131072 == 308544
    # the split parts sum to the model's, the norms are counted once per rank
    assert 2 * (params.total - params.norms) + params.norms == TINY.num_parameters()


def test_kv_heads_split_then_replicated() -> None:
    cfg = PRESETS["llama3-8b"]  # 32 heads, 8 kv heads
    for n, kv_heads, replicas in [(1, 8, 1), (2, 4, 1), (8, 1, 1), (16, 1, 2), (32, 1, 4)]:
        shard = tp_shard(cfg, n)
        assert (shard.heads, shard.kv_heads, shard.kv_replicas) == (32 // n, kv_heads, replicas)
        assert shard.kv_replicated == (replicas > 1)
        assert kv_bytes_per_token_per_rank(cfg, shard, 2) == 2 * 32 * kv_heads * 128 * 2
    # replicated: every rank stores its KV head, so 16 ranks hold twice the model's KV
    assert 16 * kv_bytes_per_token_per_rank(cfg, tp_shard(cfg, 16), 2) == 2 * kv_bytes_per_token(
        cfg, 2
    )


def test_vocab_is_padded_to_a_multiple_of_the_size() -> None:
    cfg = replace(TINY, vocab_size=4097)
    shard = tp_shard(cfg, 4)
    assert (shard.padded_vocab, shard.vocab) == (4100, 1025)
    assert rank_params(cfg, shard).embedding == 1025 * 64
    assert tp_shard(PRESETS["llama3-70b"], 8).vocab == 128256 // 8  # no padding needed


def test_tied_head_and_qkv_bias_split_with_their_rows() -> None:
    tied = rank_params(replace(TINY, tie_word_embeddings=True), tp_shard(TINY, 2))
    assert tied.lm_head == 0 and tied.lm_head_rows == tied.embedding == 2048 * 64
    biased = rank_params(replace(TINY, attention_bias=True), tp_shard(TINY, 2))
    assert biased.block_bias == 2 * (2 * 16 + 2 * 16)  # the rank's q, k and v rows, 2 layers


@pytest.mark.parametrize("size", [3, 8, 0, -2, 2.0, True, "2"])
def test_a_size_the_layout_cannot_take_names_the_key_and_the_allowed_sizes(size: object) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^engine\.tensor_parallel_size: {re.escape(repr(size))} is invalid .*"
        r"num_heads=4, num_kv_heads=2, intermediate_size=176.*; allowed: 1\|2\|4$",
    ):
        tp_shard(TINY, size)
