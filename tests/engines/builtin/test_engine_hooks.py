"""The engine's public surface for code outside it: logits observers, the gauges snapshot, the
limits it hands its scheduler and runner, and the planted slowdown applied from outside (a
`SlowedEngine` built only when engine.debug_step_delay_fraction > 0)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import math
from typing import Any

import pytest
import torch

from engines.base import GenerationRequest, StepRecord, Tokens
from engines.builtin import LLMEngine, SamplingParams
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.builtin.factory import build_engine
from engines.builtin.planted_slowdown import SlowedEngine
from engines.builtin.scheduler import StepPlan
from engines.builtin.step_stats import EngineGauges

TINY = dict(model="tiny", dtype="float32", device="cpu", max_model_len=64, max_num_seqs=8)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---- logits observers -----------------------------------------------------------------------


def test_logits_observer_sees_every_token_and_the_sampled_rows(make_tiny: Any) -> None:
    llm = make_tiny(kv_cache="paged")
    engine = llm.engine
    seen: list[tuple[int, list[tuple[str, int, bool]], torch.Tensor]] = []
    also: list[int] = []

    def observer(plan: StepPlan, logits: torch.Tensor) -> None:
        # what each row belongs to must be read now: the plan's sequences move on
        rows = [(i.seq.request_id, i.num_new_tokens, i.samples) for i in plan.scheduled]
        seen.append((plan.step, rows, logits.clone()))

    def second(plan: StepPlan, logits: torch.Tensor) -> None:
        also.append(plan.step)

    engine.add_logits_observer(observer)
    engine.add_logits_observer(second)
    prompts = [[10, 11, 12], [20, 21, 22, 23, 24]]
    outs = llm.generate(prompts, greedy(3))
    assert [s for s, _, _ in seen] == also == [0, 1, 2]  # both observers, every step
    vocab = engine.tokenizer.vocab_size
    drawn: dict[str, list[int]] = {}
    for _, rows, logits in seen:
        assert logits.dtype == torch.float32
        assert logits.shape == (sum(n for _, n, _ in rows), engine.model_config.vocab_size)
        end = 0
        for request_id, num_new, samples in rows:
            end += num_new
            if samples:  # greedy: the token drawn is the argmax of the sequence's last row
                drawn.setdefault(request_id, []).append(int(logits[end - 1, :vocab].argmax()))
    assert [drawn[o.request_id] for o in outs] == [o.token_ids for o in outs]
    assert len(seen[0][2]) == 8  # the first step: both whole prompts

    engine.remove_logits_observer(observer)
    engine.remove_logits_observer(second)
    llm.generate([[30, 31]], greedy(2))
    assert len(seen) == len(also) == 3  # removed: not called any more
    with pytest.raises(ValueError):
        engine.remove_logits_observer(observer)


# ---- gauges ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache", ["none", "contiguous", "paged"])
def test_gauges_match_the_scheduler_and_the_kv_cache(make_tiny: Any, kv_cache: str) -> None:
    engine = make_tiny(kv_cache=kv_cache, max_num_seqs=2).engine

    def expected() -> EngineGauges:
        kv = engine.kv
        return EngineGauges(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            kv_bytes_reserved=kv.bytes_reserved(),
            kv_pool_bytes=kv.layout.pool_bytes,
            kv_blocks_used=kv.num_blocks_in_use,
            kv_num_blocks=kv.layout.num_blocks,
            step=engine.scheduler.step_counter,
            num_preemptions=engine.scheduler.num_preemptions,
            prefix_cache_queries=engine.scheduler.prefix_cache_queries,
            prefix_cache_hits=engine.scheduler.prefix_cache_hits,
        )

    idle = engine.gauges()
    assert idle == expected()
    assert (idle.num_running, idle.num_waiting, idle.kv_bytes_reserved, idle.step) == (0, 0, 0, 0)
    assert (idle.kv_pool_bytes > 0) == (kv_cache != "none")
    for i in range(4):  # two run, two wait (max_num_seqs=2)
        engine.add_request(f"r{i}", [10 + i, 20, 30], greedy(3))
    assert engine.gauges().num_waiting == 4
    states = []
    while engine.has_unfinished_requests():
        engine.step()
        gauges = engine.gauges()
        assert gauges == expected()
        assert gauges.step == engine.step_counter
        states.append((gauges.num_running, gauges.num_waiting, gauges.kv_bytes_reserved))
    assert states[0][:2] == (2, 2) and states[-1] == (0, 0, 0)
    assert (max(r for _, _, r in states) > 0) == (kv_cache != "none")
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.gauges().num_running = 5  # type: ignore[misc]


def test_prefix_cache_counters_count_each_admissions_lookup(make_tiny: Any) -> None:
    """With prefix caching, every admission adds its tokens to the queries and its cached
    ones to the hits (vLLM's prefix_cache_queries / prefix_cache_hits); without, neither
    moves."""
    prompt = list(range(300, 332))  # 32 tokens: 2 full blocks of 16
    cached = make_tiny(kv_cache="paged", enable_prefix_caching=True)
    plain = make_tiny(kv_cache="paged")
    for llm in (cached, plain):
        llm.generate([prompt], greedy(2))
        first = llm.engine.gauges()
        llm.generate([prompt], greedy(2))
        second = llm.engine.gauges()
        if llm is plain:
            assert (second.prefix_cache_queries, second.prefix_cache_hits) == (0, 0)
            continue
        assert (first.prefix_cache_queries, first.prefix_cache_hits) == (32, 0)
        # the repeat finds its first block cached (the last prompt token is always computed)
        assert second.prefix_cache_queries - first.prefix_cache_queries == 32
        assert second.prefix_cache_hits - first.prefix_cache_hits == 16
        assert second.num_preemptions == 0


def test_engine_thread_publishes_the_engines_gauges() -> None:
    backend = BuiltinBackend(EngineConfig(**TINY, kv_cache="paged"))
    backend.load()
    thread = backend.start_engine_thread()

    async def run() -> None:
        request = GenerationRequest("r", [10, 11, 12], greedy(4))
        events = [e async for e in thread.generate(request)]
        assert sum(isinstance(e, Tokens) for e in events) == 4

    try:
        asyncio.run(run())
        now = thread.call(lambda engine: engine.gauges()).result(timeout=30)
    finally:
        backend.close()
    assert isinstance(thread.stats, EngineGauges)
    assert thread.stats == now  # what /metrics reads is the engine's own snapshot
    assert now.step == 4 and now.kv_pool_bytes > 0 and now.num_running == 0


# ---- limits ---------------------------------------------------------------------------------


def test_scheduler_and_runner_take_the_engines_limits(make_tiny: Any) -> None:
    per_seq = 64 * 2 * 2 * 2 * 16 * 4  # max_model_len x layers x kv_heads x head_dim x K,V x fp32
    llm = make_tiny(
        kv_cache="contiguous", max_model_len=64, max_num_seqs=8, kv_cache_memory_bytes=3 * per_seq
    )
    engine = llm.engine
    limits = engine.limits
    assert (limits.max_model_len, limits.max_num_seqs) == (64, 3)  # three slots, not eight
    for part in (engine.scheduler, engine.runner):
        assert part.max_num_seqs == limits.max_num_seqs
        assert part.max_num_batched_tokens == limits.max_num_batched_tokens
        assert part.max_model_len == limits.max_model_len
    assert engine.runner.inputs.device["seq_lens"].shape == (3,)  # step buffers: what can run
    outs = llm.generate([[10 + i, 20] for i in range(5)], greedy(4))
    assert all(o.finish_reason == "length" for o in outs)


# ---- the planted slowdown -------------------------------------------------------------------


def ticking_clock(engine: LLMEngine, tick: int = 1000) -> None:
    """The engine's clock, made to advance `tick` ns per reading: step spans become exact."""
    counter = itertools.count(10**9, tick)
    engine.platform.now_ns = lambda: next(counter)  # type: ignore[method-assign]


def step_spans(engine: LLMEngine) -> list[int]:
    records: list[StepRecord] = []
    engine.step_observers.append(records.append)
    engine.add_request("r", [10, 11, 12], greedy(3))
    while engine.has_unfinished_requests():
        engine.step()
    return [r.end_ns - r.start_ns for r in records]


def test_build_engine_plants_the_slowdown_only_when_asked() -> None:
    assert type(build_engine(EngineConfig(**TINY))) is LLMEngine
    slowed = build_engine(EngineConfig(**TINY, debug_step_delay_fraction=0.5))
    assert isinstance(slowed, SlowedEngine) and slowed.delay_fraction == 0.5
    with pytest.raises(ValueError, match="debug_step_delay_fraction"):
        build_engine(EngineConfig(**TINY, debug_step_delay_fraction=-1.0))


@pytest.mark.parametrize("fraction", [0.25, 1.0, 3.0])
def test_slowed_engine_stretches_each_step_by_the_fraction(fraction: float) -> None:
    plain = build_engine(EngineConfig(**TINY))
    slowed = build_engine(EngineConfig(**TINY, debug_step_delay_fraction=fraction))
    ticking_clock(plain)
    ticking_clock(slowed)
    work = step_spans(plain)
    assert work == [1000] * 3  # start and end: one tick apart
    # the wait ends at the first reading at or past end + fraction x (end - start)
    assert step_spans(slowed) == [1000 * (1 + math.ceil(fraction))] * 3


def test_plain_engine_step_never_reads_the_delay() -> None:
    engine = build_engine(EngineConfig(**TINY))
    ticking_clock(engine)
    # too late: only build_engine reads it
    engine.config = dataclasses.replace(engine.config, debug_step_delay_fraction=3.0)
    assert step_spans(engine) == [1000] * 3
    assert "debug_step_delay" not in inspect.getsource(LLMEngine)
