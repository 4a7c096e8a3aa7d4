"""A hybrid KV cache (one block table per KV group over one pool) gives a model whose layers
keep different windows the tokens of one table for all layers, while its windowed layers give
back the blocks out of their window; the groups' prefix caches never stand in for each
other. Against Hugging Face: tests/engines/hf/test_hf_parity.py's paged modes, which run the
Gemma and windowed Qwen checkpoints with the hybrid cache (the default)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engines.builtin import LLM, SamplingParams
from engines.builtin.kv_cache.base import KVLayout
from engines.builtin.kv_cache.groups import KVGroups, kv_groups
from engines.builtin.kv_cache.hybrid import HybridKVCacheManager
from models.config import PRESETS

GEMMA2 = PRESETS["tiny-gemma2"]


def test_groups_cut_each_layer_kind_into_groups_of_equal_size() -> None:
    window = GEMMA2.sliding_window
    groups = kv_groups(GEMMA2)  # 4 layers, 1 and 3 global
    assert groups == KVGroups((None, window), (1, 0, 1, 0), (0, 0, 1, 1))
    # Gemma 3's five windowed layers to one global: groups of the global layers' count
    gemma3 = replace(GEMMA2, num_layers=12, full_attention_layers=(5, 11))
    groups = kv_groups(gemma3)
    assert groups is not None and groups.group_size == 2
    assert groups.windows == (None, *[window] * 5)
    assert [groups.layer_group[i] for i in (5, 11)] == [0, 0]
    assert sorted(zip(groups.layer_group, groups.layer_slot, strict=True)) == [
        (g, s) for g in range(6) for s in range(2)
    ]  # every (group, slot) exactly once
    # 3 global and 1 windowed layer: groups of one
    qwen = replace(GEMMA2, full_attention_layers=(0, 1, 2))
    assert kv_groups(qwen) == KVGroups((None, None, None, window), (0, 1, 2, 3), (0, 0, 0, 0))
    assert kv_groups(replace(GEMMA2, full_attention_layers=())) is None  # every layer windowed
    assert kv_groups(PRESETS["tiny"]) is None  # every layer global


def manager(num_blocks: int = 41, caching: bool = True) -> HybridKVCacheManager:
    groups = KVGroups((None, 8), (0, 1), (0, 0))
    return HybridKVCacheManager(KVLayout(num_blocks, 4, 64), groups, caching)


def test_the_windowed_group_gives_back_blocks_the_global_one_keeps() -> None:
    kv = manager()
    # global: 32 tokens; windowed: 8 + the step's tokens + 2 blocks of room
    assert kv.blocks_to_hold(32, step_tokens=1) == 8 + 5
    assert kv.blocks_to_hold(32) == 8 + 8  # a step may write all 32 before any is released
    assert kv.can_allocate(0, 80) and not kv.can_allocate(0, 81)  # 2 x 20 of 40 blocks
    kv.allocate(0, 32)
    assert kv.num_blocks_in_use == 16
    kv.commit(0, 32)
    # keys from position 32 - 8 + 1 = 25 on are still seen: blocks 6 and 7 (of 8)
    assert kv.group_block_table(1, 0)[:6] == [0] * 6
    assert kv.num_blocks_in_use == 8 + 2
    assert kv.bytes_reserved() == 10 * 4 * 64
    assert len(kv.free(0)) == 10 and kv.num_blocks_in_use == 0


def test_a_prefix_hits_only_as_far_as_every_group_has_it() -> None:
    kv = manager()
    prompt = list(range(100, 133))  # 33 tokens: 8 full blocks, the last token never hits
    kv.allocate(0, 33)
    kv.commit(0, 33, prompt)
    kv.free(0)
    assert kv.num_cached_blocks == 16  # both groups' blocks, each group's own
    assert kv.match_prefix(1, prompt) == 32
    global_blocks, windowed_blocks = kv.group_block_table(0, 1), kv.group_block_table(1, 1)
    assert len(global_blocks) == 8 and windowed_blocks[:6] == [0] * 6  # released again
    assert not set(global_blocks) & set(windowed_blocks)
    kv.free(1)
    # the windowed group's first block, released first, is the first evicted
    for _ in range(kv.pool.num_free - kv.num_cached_blocks + 1):
        kv.pool.allocate()
    assert kv.match_prefix(2, prompt) == 0
    assert kv.num_cached_blocks == 15 and kv.num_live == 0  # the global blocks stay cached
    assert (kv.prefix_hit_tokens, kv.prefix_queries_tokens) == (32, 66)


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


PROMPTS = [[5 + (i * 7 + j) % 90 for j in range(30 + 25 * i)] for i in range(4)]


def run(hybrid: bool, **options: object) -> tuple[list[list[list[int]]], int, LLM]:
    """Greedy tokens of PROMPTS (the first two again, as prefix hits, and with n=2), and the
    most KV bytes reserved at once."""
    llm = LLM(  # type: ignore[arg-type]
        "tiny-gemma2",
        dtype="float32",
        kv_cache="paged",
        max_model_len=256,
        max_num_seqs=4,
        hybrid_kv_cache=hybrid,
        **options,
    )
    kv, peak = llm.engine.kv, [0]
    llm.engine.step_observers.append(
        lambda _: peak.__setitem__(0, max(peak[0], kv.bytes_reserved()))
    )
    outs = llm.generate(PROMPTS, [greedy(60)] * 4)
    outs += llm.generate(PROMPTS[:2], [greedy(20, n=2)] * 2)
    assert kv.num_live == 0  # everything freed
    return [[o.token_ids for o in out.outputs] for out in outs], peak[0], llm


@pytest.mark.parametrize(
    "options",
    [
        {"enable_prefix_caching": True},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
        {"kv_cache_memory_bytes": 24 * 16 * 1024},  # 24 blocks of all layers: preemption
    ],
    ids=["prefix", "chunked", "preemption"],
)
def test_hybrid_tokens_equal_one_table_and_hold_less(options: dict) -> None:
    tokens, peak, llm = run(True, **options)
    plain, plain_peak, plain_llm = run(False, **options)
    assert tokens == plain
    facts = llm.engine.describe()
    assert facts["kv_groups"]["windows"] == [None, GEMMA2.sliding_window]
    assert facts["kv_bytes_per_token"] == plain_llm.engine.describe()["kv_bytes_per_token"]
    if "kv_cache_memory_bytes" in options:  # both fill the budget
        assert llm.engine.scheduler.num_preemptions >= 1
        assert plain_llm.engine.scheduler.num_preemptions >= 1
    else:
        assert peak < 0.9 * plain_peak, (peak, plain_peak)
    if "enable_prefix_caching" in options:
        assert llm.engine.kv.prefix_hit_tokens > 0


def test_a_whole_prompt_in_the_windowed_group_is_budgeted_and_checked() -> None:
    """A prompt prefilled in one step is allocated whole in every group before the window
    releases anything: the default pool holds it with one sequence, and a request that could
    never be prefilled is refused at once with its block count (found by a hostile pass)."""
    prompt = [4 + i % 3000 for i in range(250)]
    llm = LLM("tiny-gemma2", dtype="float32", kv_cache="paged", max_model_len=256, max_num_seqs=1)
    assert len(llm.generate([prompt], greedy(5))[0].outputs[0].token_ids) == 5
    tight = LLM(
        "tiny-gemma2",
        dtype="float32",
        kv_cache="paged",
        max_model_len=256,
        kv_cache_memory_bytes=20 * 16 * 512,  # 20 blocks of half the layers
    )
    with pytest.raises(
        ValueError, match="need 28 KV blocks of 16 tokens, but the whole pool has 20"
    ):
        tight.generate([prompt[:200]], greedy(10))
    with pytest.raises(
        ValueError, match=r"holds 1 KV blocks of block_size=16 .* one token needs 2"
    ):
        LLM("tiny-gemma2", kv_cache="paged", max_model_len=256, kv_cache_memory_bytes=8192)
