"""Speculative decoding in the engine: greedy output is token for token the output without it,
for every KV mode, batch sizes 1 and 8, chunked prefill, preemption, n > 1, stop conditions and
max_tokens edges; rejected drafts leave no KV behind; bad settings are clear errors."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engines.base import ConfigError
from engines.builtin import LLM, SamplingParams
from engines.builtin.config import EngineConfig
from engines.builtin.spec_decode.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
# A draft that mostly agrees with its target: the same dummy weights in float32 drafting for
# the target's INT4 copy (their argmax differs now and then: kept runs and rejections both)
DRAFT = {
    "method": "draft_model",
    "num_speculative_tokens": 4,
    "model": "tiny",
    "quantization": "none",
}
DRAFTED_TARGET = {"quantization": "int4", "quantization_group_size": 32}
PROPOSERS = {"ngram": (NGRAM, {}), "draft": (DRAFT, DRAFTED_TARGET)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Random prompts with a repeated stretch, so lookups find something to propose."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        stretch = [rng.randrange(10, 4000) for _ in range(6)]
        out.append([rng.randrange(10, 4000) for _ in range(5)] + stretch * 3)
    return out


def run(make_tiny: Any, batch: list[list[int]], params: SamplingParams, **options: Any):
    llm = make_tiny(**options)
    outs = llm.generate(batch, params)
    return llm, outs


KV_MODES = [
    dict(kv_cache="contiguous"),
    dict(kv_cache="paged", block_size=4),
    dict(kv_cache="paged", block_size=4, enable_prefix_caching=True),
    dict(kv_cache="paged", block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=24),
    dict(kv_cache="none"),
]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("kv", KV_MODES, ids=["contiguous", "paged", "prefix", "chunked", "none"])
def test_greedy_output_equals_decoding_without_speculation(
    make_tiny, kv, batch_size, proposer
) -> None:
    spec, target = PROPOSERS[proposer]
    batch = prompts(batch_size)
    if kv.get("enable_prefix_caching"):
        batch = batch + batch[:1]  # a hit on cached blocks too
    _, plain = run(make_tiny, batch, GREEDY, **kv, **target)
    llm, out = run(make_tiny, batch, GREEDY, speculative_config=spec, **kv, **target)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    drafts = sum(o.metrics.spec_draft_tokens for o in out)
    kept = sum(o.metrics.spec_accepted_tokens for o in out)
    assert 0 < kept < drafts  # both paths ran: drafts kept and drafts rejected
    if kv.get("kv_cache") == "paged":
        assert llm.engine.kv.num_blocks_in_use == 0  # every rollback gave its blocks back
    draft = llm.engine.proposer
    if proposer == "draft":  # the draft's cache is released with each finished sequence
        assert not draft.mirrors and draft.kv.num_blocks_in_use == 0


def test_preemption_and_parallel_samples(make_tiny) -> None:
    """A KV pool too small for the batch preempts sequences mid-speculation; n = 2 samples
    fork after the prompt and speculate each on its own."""
    batch = prompts(6, seed=1)
    small = dict(kv_cache="paged", block_size=4, kv_cache_memory_bytes=60 * 4 * 2 * 64 * 4)
    _, plain = run(make_tiny, batch, GREEDY, **small)
    llm, spec = run(make_tiny, batch, GREEDY, speculative_config=NGRAM, **small)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.kv.num_blocks_in_use == 0
    two = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    _, plain = run(make_tiny, batch[:2], two, kv_cache="paged")
    _, spec = run(make_tiny, batch[:2], two, kv_cache="paged", speculative_config=NGRAM)
    assert [[s.token_ids for s in o.outputs] for o in spec] == [
        [s.token_ids for s in o.outputs] for o in plain
    ]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 17])
def test_max_tokens_is_never_exceeded(make_tiny, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _, plain = run(make_tiny, prompts(4), params)
    _, spec = run(make_tiny, prompts(4), params, speculative_config=NGRAM)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in spec)


def test_a_stop_inside_a_kept_run_ends_the_sequence_there(make_tiny) -> None:
    """Stop ids and stop strings taken from the plain output, at a position where the
    speculative run keeps several drafts in one step: output and text end at the stop."""
    batch = prompts(4, seed=2)
    _, plain = run(make_tiny, batch, GREEDY)
    for out in plain:
        stop_id = out.token_ids[20]
        params = SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[stop_id])
        _, (ref,) = run(make_tiny, [out.prompt_token_ids], params)
        _, (got,) = run(make_tiny, [out.prompt_token_ids], params, speculative_config=NGRAM)
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason == "stop"
        stop_text = ref.text[len(ref.text) // 2 :][:3] if ref.text else ""
        if stop_text.strip():
            params = SamplingParams(temperature=0.0, max_tokens=48, stop=[stop_text])
            _, (ref,) = run(make_tiny, [out.prompt_token_ids], params)
            _, (got,) = run(make_tiny, [out.prompt_token_ids], params, speculative_config=NGRAM)
            assert (got.text, got.finish_reason) == (ref.text, ref.finish_reason)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampling_with_a_seed_is_reproducible(make_tiny, proposer: str) -> None:
    spec, target = PROPOSERS[proposer]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=7, ignore_eos=True)
    _, first = run(make_tiny, prompts(3), params, speculative_config=spec, **target)
    _, second = run(make_tiny, prompts(3), params, speculative_config=spec, **target)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(len(o.token_ids) == 32 for o in first)
    if proposer == "draft":  # q close to p: most sampled drafts are kept
        kept = sum(o.metrics.spec_accepted_tokens for o in first)
        assert kept > 0.5 * sum(o.metrics.spec_draft_tokens for o in first)


def test_events_give_each_kept_token_its_own_tokens_event(make_tiny) -> None:
    """Several Tokens events in one step, one token each, with the step's end time: ITL shows
    speculation's bursts as zero gaps."""
    llm = make_tiny(speculative_config=NGRAM)
    from engines.base import Tokens

    llm.engine.add_request("a", prompts(1)[0], GREEDY)
    per_step: dict[int, list[Tokens]] = {}
    while llm.engine.has_unfinished_requests():
        for event in llm.engine.step():
            if isinstance(event, Tokens):
                assert len(event.token_ids) == 1
                per_step.setdefault(event.step, []).append(event)
    bursts = [events for events in per_step.values() if len(events) > 1]
    assert bursts and all(len({e.time_ns for e in events}) == 1 for events in bursts)
    assert sum(len(events) for events in per_step.values()) == GREEDY.max_tokens


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens: 0 .*>= 1"),
        ({"method": "medusa", "num_speculative_tokens": 2}, r"method: 'medusa' .*allowed: ngram"),
        ({"method": "ngram"}, r"num_speculative_tokens: missing"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5},
            r"prompt_lookup_min: 5 is larger than prompt_lookup_max=4",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, r"unknown key\(s\) \['k'\]"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "tiny"}, r"model: 'tiny'"),
        ("ngram", r"speculative_config: 'ngram' is invalid"),
    ],
)
def test_bad_settings_are_clear_errors(options: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict({"speculative_config": options})


@pytest.mark.parametrize(
    ("key", "value"), [("dtype", "int3"), ("quantization", "int5")], ids=["dtype", "quantization"]
)
def test_a_bad_draft_dtype_names_the_speculative_key(key: str, value: str) -> None:
    # it named engine.dtype / engine.quantization, which the user had not set
    with pytest.raises(ConfigError, match=rf"^engine\.speculative_config\.{key}: '{value}'"):
        LLM("tiny", speculative_config={**DRAFT, key: value}, max_model_len=64)


def test_more_drafts_than_a_sequence_can_hold_are_refused() -> None:
    # k=100000 was served: one counter per position made /metrics 25 MB, 3.3 s a scrape
    spec = {"method": "ngram", "num_speculative_tokens": 64}
    with pytest.raises(
        ConfigError, match=r"num_speculative_tokens: 64 .*max_model_len=64.*allowed: 1\.\.63"
    ):
        LLM("tiny", speculative_config=spec, max_model_len=64)
    with LLM("tiny", speculative_config={**spec, "num_speculative_tokens": 63}, max_model_len=64):
        pass


def test_a_draft_must_share_the_targets_tokenizer_and_fit_its_vocabulary() -> None:
    with pytest.raises(
        ConfigError, match=r"speculative_config.model: 'small' has vocab_size=32000"
    ):
        LLM("tiny", speculative_config={**DRAFT, "model": "small"}, max_model_len=64)
    with pytest.raises(ConfigError, match=r"speculative_config.model: missing"):
        EngineConfig.from_dict(
            {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}}
        )


def test_a_draft_with_another_tokenizer_is_refused(smollm2_gguf) -> None:
    with pytest.raises(ConfigError, match=r"does not share the target's tokenizer"):
        LLM("tiny", speculative_config={**DRAFT, "model": str(smollm2_gguf)}, max_model_len=64)


def test_combinations_it_cannot_serve_are_refused() -> None:
    with pytest.raises(ConfigError, match="batching=continuous"):
        EngineConfig.from_dict({"speculative_config": NGRAM, "batching": "static"})
    with pytest.raises(ConfigError, match="sliding-window ring"):
        LLM(
            "tiny",
            kv_cache="contiguous",
            model_overrides={"sliding_window": 16},
            speculative_config=NGRAM,
        )


class Oracle:
    """A proposer that drafts the plain run's next token for one request only: every draft is
    right, so every one must be kept, whatever reads the cache. One draft a step: two rows of
    one sequence beside a gap in the others' slots look like a range of distinct blocks."""

    def __init__(self, reference: dict[str, list[int]], request_id: str) -> None:
        self.reference, self.request_id = reference, request_id

    def propose(self, seqs, limits):
        from engines.builtin.spec_decode.proposer import Proposal

        return [
            Proposal(
                self.reference[s.request_id][s.num_output_tokens : s.num_output_tokens + 1]
                if s.request_id == self.request_id
                else []
            )
            for s in seqs
        ]


@pytest.mark.parametrize("backend", ["torch", "sdpa", "cpu"])
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_right_drafts_are_all_kept_by_every_attention_backend(make_tiny, backend, kv) -> None:
    """Verification rows of one sequence share its blocks: an attention path that reads the
    cache in place must not mistake them for other sequences' (review of issue 19: the dense
    in-place decode read two rows from one slot)."""
    rng = random.Random(0)
    batch = [[rng.randrange(10, 4000) for _ in range(8)] for _ in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 3, 30)]
    options = dict(attention_backend=backend, kv_cache=kv, block_size=64, max_model_len=64)
    plain = make_tiny(**options).generate(batch, params)
    llm = make_tiny(speculative_config=NGRAM, **options)
    llm.engine.proposer.propose = Oracle({o.request_id: o.token_ids for o in plain}, "0").propose
    out = llm.generate(batch, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert 0 < out[0].metrics.spec_draft_tokens == out[0].metrics.spec_accepted_tokens


def test_a_draft_pool_smaller_than_the_targets_only_drafts_less(make_tiny) -> None:
    """A float32 draft for a bfloat16 target in the same KV bytes has half the blocks: rows
    whose draft cache cannot grow go without drafts, never fail."""
    batch = prompts(8)
    options = dict(
        dtype="bfloat16",
        kv_cache="paged",
        block_size=4,
        max_model_len=64,
        kv_cache_memory_bytes=320 * 256,
    )
    spec = {**DRAFT, "dtype": "float32", "quantization": None}
    plain = make_tiny(**options).generate(batch, SamplingParams(temperature=0.0, max_tokens=20))
    llm = make_tiny(speculative_config=spec, **options)
    assert llm.engine.proposer.kv.num_free_blocks < llm.engine.kv.num_free_blocks
    out = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=20))
    assert all(o.error is None for o in out)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert sum(o.metrics.spec_accepted_tokens for o in out) > 0


def test_drafts_never_preempt_a_sequence(make_tiny) -> None:
    """With one free block left, a decode's drafts give way to another decode's own token."""
    from engines.builtin.spec_decode.proposer import Proposal

    llm = make_tiny(
        kv_cache="paged", block_size=4, max_model_len=64, kv_cache_memory_bytes=40 * 4 * 512
    )
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("A", [11, 12, 13, 14, 15, 16], params)
    engine.add_request("B", [21, 22, 23, 24, 25, 26, 27], params)
    engine.step()
    a, b = engine.scheduler.running
    while not (b.num_computed_tokens % 4 == 0 and a.num_computed_tokens % 4 != 0):
        engine.step()  # until B's next token needs a new block and A's does not
    engine.kv.allocate(999, (engine.kv.num_free_blocks - 1) * 4)  # one free block left
    plan = engine.scheduler.schedule({a.seq_id: Proposal([5, 6, 7, 8])})
    assert not plan.preempted
    assert [s.seq.request_id for s in plan.scheduled] == ["A", "B"]


def test_the_methods_the_config_accepts_are_the_registered_proposers() -> None:
    from engines.builtin.spec_decode.methods import PROPOSERS

    with pytest.raises(ConfigError) as refused:
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 2})
    assert str(refused.value).endswith("allowed: " + "|".join(PROPOSERS.names()))
    assert PROPOSERS.names() == ["ngram", "draft_model"]  # the default method first


def test_step_records_count_drafts_by_position(make_tiny) -> None:
    """Per position, the rows that proposed a draft there and kept it: position 1 counts every
    verifying row, counts never grow with the position, and they add up to the step's drafts
    and kept drafts, and over the run to the requests' counters."""
    llm = make_tiny(speculative_config=NGRAM)
    records = []
    llm.engine.step_observers.append(records.append)
    out = llm.generate(prompts(4), GREEDY)
    verifying = [r for r in records if r.spec_draft_tokens]
    assert verifying and any(r.spec_accepted_tokens for r in verifying)
    for r in records:
        assert sum(r.spec_drafts_by_position) == r.spec_draft_tokens
        assert sum(r.spec_accepted_by_position) == r.spec_accepted_tokens
        for counts in (r.spec_drafts_by_position, r.spec_accepted_by_position):
            assert list(counts) == sorted(counts, reverse=True)
        assert all(
            kept <= drafted
            for kept, drafted in zip(
                r.spec_accepted_by_position, r.spec_drafts_by_position, strict=False
            )
        )
    assert sum(r.spec_drafts_by_position[0] for r in verifying) == sum(
        o.metrics.spec_steps for o in out
    )
    assert sum(r.spec_accepted_tokens for r in records) == sum(
        o.metrics.spec_accepted_tokens for o in out
    )
