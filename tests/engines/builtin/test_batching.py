"""Static batching and chunked prefill in the built-in engine (`tiny` preset and small HF
checkpoints): every scheduling mode gives the same tokens as each request alone, static
batching's padding is counted exactly and waits for the whole batch, chunked prefill splits long
prompts within the token budget and shares its steps with running decodes, and the invalid
combinations are refused by name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from engines.base import ConfigError, Finished, PrefillChunk, Scheduled, StepRecord, Tokens
from engines.builtin import LLM, EngineConfig, SamplingParams
from engines.builtin.scheduler import StepPlan
from models.config import kv_bytes_per_token

BASE: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=256)
# Mixed prompt lengths (5..90 tokens) and output lengths, more requests than max_num_seqs.
PROMPT_LENS = (5, 90, 17, 40, 8, 63, 30, 12, 71, 23)
MAX_TOKENS = (7, 3, 12, 5, 9, 4, 6, 10, 2, 8)
PROMPTS = [[(37 * i + 11 * j) % 3000 + 10 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make(**options: Any) -> LLM:
    return LLM(model="tiny", **{**BASE, **options})


def run(llm: LLM, prompts, params) -> tuple[list, list[StepRecord]]:
    records: list[StepRecord] = []
    llm.engine.step_observers.append(records.append)
    outs = llm.generate(prompts, params)
    llm.engine.step_observers.remove(records.append)
    return outs, records


def run_events(llm: LLM, requests: list[tuple[str, list[int], SamplingParams]]):
    """Drive the engine by hand; return every event and every step record."""
    engine = llm.engine
    records: list[StepRecord] = []
    engine.step_observers.append(records.append)
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    events = []
    while engine.has_unfinished_requests():
        events += engine.step()
    return events, records


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Greedy tokens of each request run alone (continuous, contiguous KV)."""
    llm = make(max_num_seqs=1)
    return [
        llm.generate(p, greedy(n))[0].token_ids for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]


MODES = [
    dict(batching="continuous", kv_cache="contiguous"),
    dict(batching="continuous", kv_cache="none"),
    dict(batching="static", kv_cache="contiguous"),
    dict(batching="static", kv_cache="none"),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=4),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, attention_backend="torch"),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=64, long_prefill_token_threshold=8),
]


@pytest.mark.parametrize("options", MODES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_every_mode_equals_each_request_alone(alone, options: dict[str, Any]) -> None:
    llm = make(**{"max_num_seqs": 3, **options})
    outs, records = run(llm, PROMPTS, [greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    budget = llm.engine.limits.max_num_batched_tokens
    assert max(r.num_seqs for r in records) <= llm.engine.limits.max_num_seqs
    assert all(r.prefill_tokens + r.decode_tokens + r.padding_tokens <= budget for r in records)
    assert llm.engine.kv.num_live == 0 and llm.engine.kv.bytes_reserved() == 0
    padding = sum(r.padding_tokens for r in records)
    assert (padding > 0) == (options.get("batching") == "static")
    if options.get("enable_chunked_prefill") and not options.get("long_prefill_token_threshold"):
        assert max(r.prefill_tokens + r.decode_tokens for r in records) == budget
        assert any(r.prefill_tokens and r.decode_tokens for r in records)


def test_seeded_sampling_is_the_same_in_every_mode() -> None:
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=n, seed=100 + i, ignore_eos=True)
        for i, n in enumerate(MAX_TOKENS)
    ]
    results = [
        [o.token_ids for o in make(max_num_seqs=3, **options).generate(PROMPTS, params)]
        for options in (
            dict(),
            dict(batching="static"),
            dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
        )
    ]
    assert results[0] == results[1] == results[2]


# ---- static batching ------------------------------------------------------------------------


def test_static_padding_is_exact() -> None:
    """Prompts of 4, 7, 10 tokens and 2, 5, 3 output tokens in one static batch of 3."""
    llm = make(batching="static", max_num_seqs=3)
    prompts = [[100 + j for j in range(n)] for n in (4, 7, 10)]
    outs, records = run(llm, prompts, [greedy(n) for n in (2, 5, 3)])
    assert [len(o.token_ids) for o in outs] == [2, 5, 3]
    # The prefill pads every prompt to the longest: (10 - 4) + (10 - 7).
    prefill_padding = (10 - 4) + (10 - 7)
    # The prefill samples each first token; the longest output (5) needs 4 decode steps. After
    # decode step k a request with n outputs has k + 1 of them: request 0 (2 tokens) finishes
    # at decode step 1, request 2 (3 tokens) at step 2, request 1 (5 tokens) at step 4. Each
    # decode step pads one token per member finished before it: 0, 1, 2, 2.
    decode_padding = [0, 1, 2, 2]
    assert len(records) == 1 + 4
    assert [r.padding_tokens for r in records] == [prefill_padding, *decode_padding]
    assert sum(r.padding_tokens for r in records) == 9 + 5
    assert records[0].prefill_tokens == 4 + 7 + 10 and records[0].decode_tokens == 0
    assert [r.decode_tokens for r in records[1:]] == [3, 2, 1, 1]
    assert [r.num_seqs for r in records] == [3, 3, 2, 1, 1]
    # The same requests under continuous batching compute no padding.
    outs_c, records_c = run(make(max_num_seqs=3), prompts, [greedy(n) for n in (2, 5, 3)])
    assert [o.token_ids for o in outs_c] == [o.token_ids for o in outs]
    assert sum(r.padding_tokens for r in records_c) == 0


def test_static_padding_without_kv_cache() -> None:
    """kv_cache=none recomputes every row each step, padded to the longest live context; a
    finished member's row is all padding."""
    llm = make(batching="static", kv_cache="none", max_num_seqs=3)
    prompts = [[100 + j for j in range(n)] for n in (4, 7, 10)]
    outs, records = run(llm, prompts, [greedy(n) for n in (2, 5, 3)])
    assert [len(o.token_ids) for o in outs] == [2, 5, 3]
    # Step k (0 = prefill) computes contexts prompt + k for live members; width = the longest.
    expected = []
    for k, live in enumerate([(0, 1, 2), (0, 1, 2), (1, 2), (1,), (1,)]):
        lens = {i: (4, 7, 10)[i] + k for i in live}
        width = max(lens.values())
        expected.append(sum(width - n for n in lens.values()) + width * (3 - len(live)))
    assert [r.padding_tokens for r in records] == expected
    assert [r.prefill_tokens for r in records] == [21, 24, 21, 10, 11]


def test_static_admits_the_next_batch_only_when_the_whole_batch_finished() -> None:
    llm = make(batching="static", max_num_seqs=3)
    lens, outs = (6, 9, 4, 5, 7, 3, 8), (3, 8, 2, 4, 1, 6, 2)
    requests = [
        (f"r{i}", [200 + i + j for j in range(n)], greedy(m))
        for i, (n, m) in enumerate(zip(lens, outs, strict=True))
    ]
    events, records = run_events(llm, requests)
    scheduled = {e.request_id: e.step for e in events if isinstance(e, Scheduled)}
    finished = {e.request_id: e.step for e in events if isinstance(e, Finished)}
    position = {(type(e), e.request_id): i for i, e in enumerate(events)}
    batches = [("r0", "r1", "r2"), ("r3", "r4", "r5"), ("r6",)]
    for i, batch in enumerate(batches):
        assert {scheduled[r] for r in batch} == {scheduled[batch[0]]}  # admitted together
        if i == 0:
            assert scheduled[batch[0]] == 0
            continue
        previous = batches[i - 1]
        # admitted in the step after the previous batch's last member finished, not before
        assert scheduled[batch[0]] == max(finished[r] for r in previous) + 1
        assert min(position[Scheduled, r] for r in batch) > max(
            position[Finished, r] for r in previous
        )
        assert all(
            e.step >= scheduled[batch[0]]
            for e in events
            if e.request_id in batch and isinstance(e, (Scheduled, PrefillChunk, Tokens, Finished))
        )
    # every step of a batch reserves every member's slot, finished or not
    bpt = kv_bytes_per_token(llm.engine.model_config, 4)
    slot = 256 * bpt
    for record in records:
        batch = next(
            b
            for b in batches
            if scheduled[b[0]] <= record.step and record.step <= max(finished[r] for r in b)
        )
        last_step = max(finished[r] for r in batch)
        expected = 0 if record.step == last_step else len(batch) * slot
        assert record.kv_bytes_reserved == expected
    # the token events of each request are one per step, from its prefill on
    for request_id, _, params in requests:
        steps = [e.step for e in events if isinstance(e, Tokens) and e.request_id == request_id]
        start = scheduled[request_id]
        assert steps == list(range(start, start + params.max_tokens))
    assert llm.engine.kv.num_live == 0


def test_static_batch_respects_queue_order_kv_slots_and_token_budget() -> None:
    # Priority decides the batch: lower value first, FCFS within a priority.
    llm = make(batching="static", max_num_seqs=2)
    engine = llm.engine
    for i, priority in enumerate((1, 0, 1, 0)):
        engine.add_request(f"p{i}", [300 + i, 301, 302], greedy(2), priority=priority)
    events = []
    while engine.has_unfinished_requests():
        events += engine.step()
    first = [e.request_id for e in events if isinstance(e, Scheduled) and e.step == 0]
    assert first == ["p1", "p3"]
    # A KV budget of two contiguous slots caps the batch at two sequences.
    bpt = kv_bytes_per_token(make().engine.model_config, 4)
    llm = make(batching="static", kv_cache_memory_bytes=2 * 256 * bpt + 1)
    _, records = run(llm, PROMPTS[:5], [greedy(3)] * 5)
    assert max(r.num_seqs for r in records) == 2
    # The padded prefill must fit max_num_batched_tokens: 3 x 100 > 256, so two per batch.
    llm = make(batching="static", max_num_batched_tokens=256, max_num_seqs=8)
    prompts = [[400 + i + j for j in range(100)] for i in range(3)]
    _, records = run(llm, prompts, [greedy(2)] * 3)
    assert [r.prefill_tokens + r.padding_tokens for r in records if r.prefill_tokens] == [200, 100]


def test_static_abort_keeps_the_row_until_the_batch_ends() -> None:
    llm = make(batching="static", max_num_seqs=3)
    engine = llm.engine
    records: list[StepRecord] = []
    engine.step_observers.append(records.append)
    engine.add_request("a", [10, 11, 12], greedy(6))
    engine.add_request("b", [20, 21], greedy(6))
    engine.add_request("c", [30, 31, 32, 33], greedy(2))
    engine.step()
    engine.step()
    engine.abort_request("a")
    assert engine.kv.num_live == 3  # reserved until the batch ends
    events = engine.step()
    assert [e.finish_reason for e in events if isinstance(e, Finished)] == ["abort"]
    assert not any(isinstance(e, Tokens) and e.request_id == "a" for e in events)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_live == 0
    # c finished at step 1 (2 tokens), a aborted before step 2: both pad until b is done
    assert [r.padding_tokens for r in records] == [1 + 2, 0, 2, 2, 2, 2]


# ---- chunked prefill ------------------------------------------------------------------------


def test_chunked_prefill_splits_long_prompts_and_shares_steps_with_decodes(alone) -> None:
    budget = 16
    llm = make(enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=4)
    short, long_ = PROMPTS[0], PROMPTS[1]  # 5 and 90 tokens
    requests = [("short", short, greedy(30)), ("long", long_, greedy(MAX_TOKENS[1]))]
    events, records = run_events(llm, requests)
    chunks = [e for e in events if isinstance(e, PrefillChunk) and e.request_id == "long"]
    # step 0: 5 + 11; then one decode and a 15-token chunk per step: 11 + 5 x 15 = 86, then 4
    assert [c.num_tokens for c in chunks] == [11, 15, 15, 15, 15, 15, 4]
    assert sum(c.num_tokens for c in chunks) == len(long_)
    assert [c.num_computed_before for c in chunks] == [0, 11, 26, 41, 56, 71, 86]
    assert [c.step for c in chunks] == list(range(7))
    # its first token comes from the step of its last chunk, not before
    long_tokens = [e for e in events if isinstance(e, Tokens) and e.request_id == "long"]
    assert long_tokens[0].step == chunks[-1].step
    assert [t for e in long_tokens for t in e.token_ids] == alone[1]
    # the short request decodes in every one of those steps
    by_step = {r.step: r for r in records}
    for chunk in chunks[1:]:
        record = by_step[chunk.step]
        assert record.prefill_tokens == chunk.num_tokens and record.decode_tokens == 1
    assert all(r.prefill_tokens + r.decode_tokens <= budget for r in records)
    short_steps = [e.step for e in events if isinstance(e, Tokens) and e.request_id == "short"]
    assert short_steps == list(range(30))  # never stalled by the long prompt


def test_long_prefill_token_threshold_caps_each_prompt_s_chunk(alone) -> None:
    # budget 64: without the threshold the 90-token prompt takes the whole first step and the
    # 40-token one waits; with 16 each prompt takes 16 a step, so both prefill side by side
    requests = [("long", PROMPTS[1], greedy(MAX_TOKENS[1])), ("mid", PROMPTS[3], greedy(5))]
    plain, _ = run_events(make(enable_chunked_prefill=True, max_num_batched_tokens=64), requests)
    capped, records = run_events(
        make(
            enable_chunked_prefill=True, max_num_batched_tokens=64, long_prefill_token_threshold=16
        ),
        requests,
    )

    def chunks(events, request_id: str) -> list[tuple[int, int]]:
        return [
            (e.step, e.num_tokens)
            for e in events
            if isinstance(e, PrefillChunk) and e.request_id == request_id
        ]

    assert chunks(plain, "long") == [(0, 64), (1, 26)]
    assert chunks(plain, "mid") == [(1, 38), (2, 2)]
    assert chunks(capped, "long") == [(s, 16) for s in range(5)] + [(5, 10)]
    assert chunks(capped, "mid") == [(0, 16), (1, 16), (2, 8)]
    assert all(r.prefill_tokens <= 32 for r in records)
    for events, tag in ((plain, "plain"), (capped, "capped")):
        tokens = {
            r: [
                t
                for e in events
                if isinstance(e, Tokens) and e.request_id == r
                for t in e.token_ids
            ]
            for r in ("long", "mid")
        }
        assert tokens["long"] == alone[1], tag
        assert tokens["mid"] == alone[3][:5], tag


def test_chunked_prefill_one_token_last_chunk_and_partial_admission() -> None:
    llm = make(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4)
    # a: 5 tokens; b: 11 + 15 + 1 = 27 tokens (its last chunk is a single prompt token);
    # c waits until b's prefill leaves budget, then gets a partial first chunk.
    requests = [
        ("a", list(range(50, 55)), greedy(12)),
        ("b", list(range(60, 87)), greedy(4)),
        ("c", list(range(90, 130)), greedy(3)),
    ]
    events, records = run_events(llm, requests)
    chunks = {
        r: [
            (e.step, e.num_tokens)
            for e in events
            if isinstance(e, PrefillChunk) and e.request_id == r
        ]
        for r in "abc"
    }
    assert chunks["a"] == [(0, 5)]
    assert chunks["b"] == [(0, 11), (1, 15), (2, 1)]
    # step 2: a decodes (1), b's last chunk (1), c's first chunk takes the remaining 14
    assert chunks["c"][0] == (2, 14)
    assert sum(n for _, n in chunks["c"]) == 40
    record = next(r for r in records if r.step == 2)
    assert (record.prefill_tokens, record.decode_tokens) == (1 + 14, 1)
    alone = make(max_num_seqs=1)
    outs = {
        r: [t for e in events if isinstance(e, Tokens) and e.request_id == r for t in e.token_ids]
        for r in "abc"
    }
    for request_id, prompt, params in requests:
        assert outs[request_id] == alone.generate(prompt, params)[0].token_ids


def test_chunked_prefill_budget_defaults_and_limits() -> None:
    llm = make(enable_chunked_prefill=True, max_model_len=512)
    assert llm.engine.limits.max_num_batched_tokens == 2048
    assert make().engine.limits.max_num_batched_tokens == 2048  # max(256, 2048) unchanged
    assert make(max_model_len=1024).engine.limits.max_num_batched_tokens == 2048
    # a budget below max_model_len is fine with chunked prefill, refused without it
    llm = make(enable_chunked_prefill=True, max_num_batched_tokens=8)
    assert llm.engine.limits.max_num_batched_tokens == 8
    out = llm.generate([list(range(10, 60))], greedy(3))[0]
    assert len(out.token_ids) == 3
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=8 is smaller than"):
        make(max_num_batched_tokens=8)


# ---- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        (
            dict(batching="static", enable_chunked_prefill=True),
            r"enable_chunked_prefill=true cannot be combined with engine\.batching=static",
        ),
        (
            dict(kv_cache="none", enable_chunked_prefill=True),
            r"enable_chunked_prefill=true needs a KV cache, but engine\.kv_cache=none",
        ),
        (dict(enable_chunked_prefill="yes"), r"engine\.enable_chunked_prefill: 'yes' is invalid"),
        (
            dict(long_prefill_token_threshold=512),
            r"engine\.long_prefill_token_threshold limits a prompt's chunk, and needs "
            r"engine\.enable_chunked_prefill=true",
        ),
        (
            dict(enable_chunked_prefill=True, long_prefill_token_threshold=-1),
            r"engine\.long_prefill_token_threshold: -1 is invalid; allowed: an integer >= 0",
        ),
        (dict(batching="dynamic"), r"engine\.batching: 'dynamic' is invalid; allowed: static\|"),
    ],
)
def test_invalid_combinations_are_refused_by_name(options, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        EngineConfig.from_dict({"model": "tiny", **options})
    with pytest.raises(ConfigError, match=pattern):
        make(**options)


def test_static_and_chunked_are_accepted() -> None:
    assert EngineConfig.from_dict({"batching": "static"}).batching == "static"
    assert EngineConfig.from_dict(
        {"enable_chunked_prefill": True, "max_model_len": 4096, "max_num_batched_tokens": 512}
    ).enable_chunked_prefill


# ---- logits against Hugging Face --------------------------------------------------------------


def _module_at(path: Path) -> ModuleType:
    if path.stem in sys.modules:  # collected already: one module, one set of fixtures
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory: pytest.TempPathFactory):
    """The HF references of tests/engines/hf/test_hf_parity.py (a checkpoint, its greedy
    continuations and its no-cache logits), built for the variants used here."""
    pytest.importorskip("transformers")
    # by its path: its folder is on sys.path only once pytest has collected a test there
    parity = _module_at(Path(__file__).parents[1] / "hf" / "test_hf_parity.py")

    cache = {}

    def get(kind: str):
        if kind not in cache:
            seed = parity.SEEDS[kind]
            model = parity.build_hf_model(kind, seed)
            folder = parity.save_checkpoint(model, tmp_path_factory.mktemp(kind))
            cache[kind] = parity.hf_reference(model, folder, parity.make_prompts(seed))
        return cache[kind]

    return get, parity


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("llama_gqa", dict(batching="static")),
        ("llama_gqa", dict(batching="static", kv_cache="none")),
        # window 8 < chunk 7..: chunks attend through the sliding window into the cache
        ("mistral_swa", dict(enable_chunked_prefill=True, max_num_batched_tokens=7)),
        (
            "qwen2",
            dict(enable_chunked_prefill=True, max_num_batched_tokens=10, attention_backend="torch"),
        ),
    ],
)
def test_logits_match_hf(hf_reference, kind: str, options: dict[str, Any]) -> None:
    """Every real token's logits (padding rows are not shown to the observer) and the greedy
    continuation match HF's, with static padding and with prompts split into chunks."""
    get, parity = hf_reference
    ref = get(kind)
    parity.check_against_hf(ref, parity.run_engine(ref, **options))


@pytest.mark.parametrize("chunked", [False, True])
def test_preemption_with_a_token_capped_cache_keeps_outputs(alone, chunked: bool) -> None:
    """A KV manager that caps the tokens reserved over all sequences (as a block pool does)
    forces recompute preemptions, also of sequences mid-prefill or mid-recompute under chunked
    prefill; every request still gets its tokens-alone."""
    options = dict(enable_chunked_prefill=True, max_num_batched_tokens=16) if chunked else {}
    llm = make(max_num_seqs=8, **options)
    kv, cap, held = llm.engine.kv, 140, {}
    can_allocate, allocate, free = kv.can_allocate, kv.allocate, kv.free

    def capped_can_allocate(seq_id: int, n: int) -> bool:
        others = sum(v for k, v in held.items() if k != seq_id)
        return others + n <= cap and can_allocate(seq_id, n)

    def tracked_allocate(seq_id: int, n: int) -> list[int]:
        held[seq_id] = max(held.get(seq_id, 0), n)
        return allocate(seq_id, n)

    def tracked_free(seq_id: int) -> list[int]:
        held.pop(seq_id, None)
        return free(seq_id)

    kv.can_allocate, kv.allocate, kv.free = capped_can_allocate, tracked_allocate, tracked_free
    requests = [
        (str(i), p, greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))
    ]
    events, records = run_events(llm, requests)
    assert sum(r.num_preempted for r in records) > 0
    # the running count a server's /metrics reads (vLLM's num_preemptions)
    assert llm.engine.gauges().num_preemptions == sum(r.num_preempted for r in records)
    outs = [
        [t for e in events if isinstance(e, Tokens) and e.request_id == str(i) for t in e.token_ids]
        for i in range(len(PROMPTS))
    ]
    assert outs == alone
    budget = llm.engine.limits.max_num_batched_tokens
    assert all(r.prefill_tokens + r.decode_tokens <= budget for r in records)


def test_a_preempted_sequence_goes_to_the_front_of_its_priority_class_only() -> None:
    """A recompute preemption requeues the sequence ahead of its own priority class (it
    arrived before the rest of it), never ahead of a more urgent class."""
    llm = make(max_num_seqs=1)
    engine, scheduler = llm.engine, llm.engine.scheduler
    engine.add_request("running", [300, 301, 302], greedy(8), priority=1)
    engine.step()  # "running" runs; the others arrive after it
    engine.add_request("urgent", [310, 311], greedy(2), priority=0)
    engine.add_request("later", [320, 321], greedy(2), priority=1)
    [victim] = scheduler.running
    scheduler._preempt(victim, StepPlan(step=1))
    assert [s.request_id for s in scheduler.waiting] == ["urgent", "running", "later"]
