"""Every KV variant gives the plain path's greedy tokens: none / contiguous / paged, with and
without prefix caching, shared prefixes, n > 1, sliding windows, GQA/MQA, chunked prefill and
preemption; and paged memory is accounted as the seeds argue."""

from __future__ import annotations

import random

import pytest

from engines.base import StepRecord
from engines.builtin import LLM, SamplingParams

TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x kv_heads x head_dim x fp32, K and V

SHARED = list(range(100, 148))  # a 48-token shared prefix: three 16-token blocks
PROMPTS = [
    [*SHARED, 7, 8, 9],
    list(range(200, 237)),
    [*SHARED, *range(300, 320)],
    [11, 12, 13],
    [*SHARED, 7, 8, 9],  # the whole prompt seen before: all but the last token can hit
    list(range(400, 470)),
]
MAX_TOKENS = [12, 5, 20, 9, 12, 16]


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


def run(
    prompts: list[list[int]], max_tokens: list[int], n: int = 1, **options: object
) -> tuple[list[list[list[int]]], list[StepRecord], LLM]:
    llm = LLM("tiny", dtype="float32", **options)  # type: ignore[arg-type]
    steps: list[StepRecord] = []
    llm.engine.step_observers.append(steps.append)
    outs = llm.generate(prompts, [greedy(m, n) for m in max_tokens])
    assert llm.engine.kv.num_live == 0  # everything freed
    return [[o.token_ids for o in out.outputs] for out in outs], steps, llm


@pytest.fixture(scope="module")
def reference() -> list[list[list[int]]]:
    """Each prompt alone, no KV cache: the plain path."""
    return [run([p], [m], kv_cache="none")[0][0] for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]


VARIANTS = {
    "none": dict(kv_cache="none"),
    "contiguous": dict(kv_cache="contiguous"),
    "paged": dict(kv_cache="paged"),
    "paged_bs1": dict(kv_cache="paged", block_size=1),
    "paged_bs7": dict(kv_cache="paged", block_size=7),
    "paged_prefix": dict(kv_cache="paged", enable_prefix_caching=True),
    "paged_prefix_chunked": dict(
        kv_cache="paged",
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
    ),
    "paged_sdpa_small_batch": dict(kv_cache="paged", max_num_seqs=2),
    "paged_torch": dict(kv_cache="paged", attention_backend="torch"),
    # auto is the C decode kernel on CPU; sdpa is what it replaced, kept as a backend
    "paged_sdpa": dict(kv_cache="paged", attention_backend="sdpa"),
    "contiguous_sdpa": dict(kv_cache="contiguous", attention_backend="sdpa"),
    # 40 blocks of 4 tokens: the first three prompts fill the pool exactly, so the first
    # decode that crosses a block boundary preempts the newest sequence (recomputed later)
    "paged_preempt": dict(
        kv_cache="paged", block_size=4, kv_cache_memory_bytes=40 * 4 * TINY_BYTES_PER_TOKEN
    ),
    "paged_prefix_preempt": dict(
        kv_cache="paged",
        block_size=4,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=40 * 4 * TINY_BYTES_PER_TOKEN,
    ),
    "paged_chunked_preempt": dict(
        kv_cache="paged",
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=40 * 4 * TINY_BYTES_PER_TOKEN,
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_match_the_plain_path(variant: str, reference) -> None:
    outputs, steps, _ = run(PROMPTS, MAX_TOKENS, **VARIANTS[variant])
    assert outputs == reference
    if "preempt" in variant:
        assert sum(s.num_preempted for s in steps) > 0  # the budget really forced preemption


def test_prefix_cache_hits_shared_blocks_and_never_the_last_token() -> None:
    llm = LLM("tiny", dtype="float32", kv_cache="paged", enable_prefix_caching=True)
    llm.generate([PROMPTS[0]], greedy(4))
    seqs = []
    original = llm.engine.scheduler._admit

    def spy(seq, plan):
        seqs.append(seq)
        original(seq, plan)

    llm.engine.scheduler._admit = spy
    llm.generate([PROMPTS[0], PROMPTS[2]], greedy(4))
    by_len = {s.num_prompt_tokens: s.cached_prompt_tokens for s in seqs}
    assert by_len[len(PROMPTS[0])] == 48  # 51 tokens: 3 full blocks, the 4th is partial
    assert by_len[len(PROMPTS[2])] == 48  # shares exactly the 48-token prefix
    exact = list(range(500, 532))  # 32 tokens = 2 full blocks
    llm.generate([exact], greedy(2))
    seqs.clear()
    llm.generate([exact], greedy(2))
    assert seqs[0].cached_prompt_tokens == 16  # the last prompt token is always computed


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache="contiguous"),
        dict(kv_cache="paged"),
        dict(kv_cache="paged", enable_prefix_caching=True),
    ],
)
def test_parallel_sampling_greedy_samples_equal_n1(options: dict, reference) -> None:
    outputs, _, _ = run(PROMPTS[:3], MAX_TOKENS[:3], n=3, **options)
    for out, ref in zip(outputs, reference[:3], strict=True):
        assert out == [ref[0]] * 3


def test_parallel_sampling_shares_prompt_blocks_and_copies_on_write() -> None:
    llm = LLM("tiny", dtype="float32", kv_cache="paged")
    copies: list = []
    original = llm.engine.runner.copy_blocks
    llm.engine.runner.copy_blocks = lambda pairs: (copies.extend(pairs), original(pairs))
    steps: list[StepRecord] = []
    llm.engine.step_observers.append(steps.append)
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks and a partial third
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=4, ignore_eos=True)
    )[0]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # the samples diverged
    assert len(copies) == 3  # each child copies the shared partial block once
    # after the fork: 4 sequences on 2 shared full blocks + 4 own partial blocks
    assert max(s.kv_blocks_used for s in steps) == 2 + 4


@pytest.mark.parametrize("window", [8, 20])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_sliding_window_and_head_counts(window: int, kv_heads: int) -> None:
    overrides = {"sliding_window": window, "num_kv_heads": kv_heads}
    ref, _, _ = run(PROMPTS[:4], MAX_TOKENS[:4], kv_cache="none", model_overrides=overrides)
    for options in (
        dict(kv_cache="contiguous"),
        dict(kv_cache="paged", block_size=4),
        dict(
            kv_cache="paged", block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=12
        ),
    ):
        got, _, llm = run(PROMPTS[:4], MAX_TOKENS[:4], model_overrides=overrides, **options)
        assert got == ref, options
    # paged KV per sequence stops growing at the window
    long_prompt = list(range(100, 180))
    _, steps, llm = run(
        [long_prompt], [40], model_overrides=overrides, kv_cache="paged", block_size=4
    )
    bound = (-(-window // 4) + 2) * 4 * llm.engine.kv.layout.bytes_per_token
    assert max(s.kv_bytes_reserved for s in steps) <= bound


def test_paged_memory_is_used_and_contiguous_is_reserved() -> None:
    budget = 64 * 16 * TINY_BYTES_PER_TOKEN  # 64 blocks of 16 tokens = 4 sequences of 256
    prompts = [list(range(100, 100 + n)) for n in (10, 30, 50, 20, 40, 60, 15, 25)]
    tokens = [20] * len(prompts)
    results = {}
    for kv in ("contiguous", "paged"):
        _, steps, _ = run(
            prompts, tokens, kv_cache=kv, kv_cache_memory_bytes=budget, max_model_len=256
        )
        reserving = [s for s in steps if s.kv_bytes_reserved]
        utilization = sum(s.kv_bytes_used / s.kv_bytes_reserved for s in reserving)
        results[kv] = (utilization / len(reserving), max(s.num_running for s in steps))
    assert results["contiguous"][1] == 4  # the budget holds 4 max_model_len slots
    assert results["paged"][1] == 8  # every sequence fits at once
    assert results["paged"][0] > 0.7 > 0.3 > results["contiguous"][0]


def test_request_that_can_never_fit_fails_with_the_reason() -> None:
    llm = LLM(
        "tiny",
        dtype="float32",
        kv_cache="paged",
        kv_cache_memory_bytes=4 * 16 * TINY_BYTES_PER_TOKEN,
    )
    with pytest.raises(ValueError, match="can never run"):
        llm.generate([list(range(100, 150))], greedy(40))


def test_contiguous_ring_buffer_stops_growing_at_the_window() -> None:
    overrides = {"sliding_window": 16}
    _, steps, llm = run(
        [list(range(100, 180))],
        [30],
        kv_cache="contiguous",
        model_overrides=overrides,
        max_model_len=512,
    )
    assert llm.engine.kv.ring and llm.engine.kv.layout.block_size == 16
    per_token = llm.engine.kv.layout.bytes_per_token
    assert max(s.kv_bytes_reserved for s in steps) == 16 * per_token
    assert max(s.kv_bytes_used for s in steps) == 16 * per_token


def test_a_request_that_cannot_start_fails_instead_of_spinning() -> None:
    llm = LLM("tiny", dtype="float32", kv_cache="paged")
    llm.engine.kv.can_allocate = lambda seq_id, num_tokens: False  # a pool that never admits
    out = llm.generate([[10, 11, 12]], greedy(3))[0]
    assert out.error is not None and "cannot be scheduled" in out.error
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache="paged"),
        dict(kv_cache="contiguous"),
        dict(kv_cache="paged", model_overrides={"sliding_window": 8}),
    ],
)
def test_decodes_of_very_different_lengths(options: dict) -> None:
    # One long context among short ones: the dense path attends per sequence instead of
    # padding every gather to the longest (see DenseAttention._decode); tokens must not change.
    prompts = [list(range(100, 300)), [5, 6, 7], [8, 9], [10, 11, 12, 13]]
    batch, _, _ = run(prompts, [6] * 4, **options)
    alone = [run([p], [6], **options)[0][0] for p in prompts]
    assert batch == alone


def test_forks_beyond_max_num_seqs_wait_instead_of_overflowing() -> None:
    llm = LLM("tiny", dtype="float32", kv_cache="paged", max_num_seqs=2)
    out = llm.generate(
        [[1, 2, 3, 4, 5]],
        SamplingParams(n=4, temperature=1.0, max_tokens=4, ignore_eos=True, seed=1),
    )[0]
    assert out.error is None and [len(o.token_ids) for o in out.outputs] == [4, 4, 4, 4]


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache="paged", kv_cache_memory_bytes=8 * 16 * TINY_BYTES_PER_TOKEN),
        dict(kv_cache="contiguous", model_overrides={"sliding_window": 4}),  # a ring buffer
    ],
)
def test_static_batches_with_paged_and_ring_caches_match_continuous(options: dict) -> None:
    # a short prompt queued before a long one: padding must neither need room nor clobber K/V
    prompts, tokens = [list(range(10, 20)), list(range(10, 110))], [5, 10]
    static, _, _ = run(prompts, tokens, batching="static", max_model_len=256, **options)
    continuous, _, _ = run(prompts, tokens, max_model_len=256, **options)
    assert static == continuous


def test_a_readmitted_sequence_with_all_but_its_last_token_cached_is_packed_as_a_decode() -> None:
    """Prefix caching and preemption: a preempted sequence whose every token but the last is
    still cached comes back as a decode. It must be packed with the decodes, first: placed
    after the prefills, the runner read a prefill as a decode row and every token after the
    recompute was wrong (a hostile pass found it; block_size=1 keeps every token cached)."""
    rng = random.Random(4)
    prompt = lambda n: [rng.randrange(4, 4000) for _ in range(n)]  # noqa: E731
    base = prompt(120)
    prompts = [base, base[:100] + prompt(50), prompt(1), prompt(7), prompt(33), base, prompt(200)]
    prompts += [prompt(180), base[:90] + prompt(60)]
    want = [run([p], [50], kv_cache="none", max_model_len=256)[0][0] for p in prompts]
    got, _, llm = run(
        prompts,
        [50] * len(prompts),
        kv_cache="paged",
        max_model_len=256,
        block_size=1,
        kv_cache_memory_bytes=int(1.3 * 256 * TINY_BYTES_PER_TOKEN),
        enable_prefix_caching=True,
    )
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hit_tokens > 0
    assert got == want
