"""Closing an LLM (the notebook path): `close()`, `with LLM(...)`, closing twice, using a closed
one, and what a closed engine lets go of (its model, its KV cache, the draft model's engine).
Tensor-parallel ranks: tests/engines/builtin/distributed/test_tp_lifetime.py."""

from __future__ import annotations

import gc
import weakref

import pytest

from engines.builtin import LLM, EngineClosedError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CLOSED = r"^the engine is closed \(close\(\), or the end of its `with` block\); build a new LLM"


def test_with_closes_the_llm_at_the_end_of_the_block() -> None:
    with LLM(model="tiny", num_threads=1) as llm:
        assert len(llm.generate("hello", GREEDY)[0].token_ids) == 4
    assert llm.engine.closed
    with pytest.raises(EngineClosedError, match=CLOSED):
        llm.generate("hello", GREEDY)


def test_closing_twice_is_harmless_and_a_closed_llm_refuses_every_use() -> None:
    llm = LLM(model="tiny", num_threads=1)
    llm.close()
    llm.close()
    for use in (
        lambda: llm.generate("hello", GREEDY),
        lambda: llm.generate([], GREEDY),  # nothing to queue: refused all the same
        llm.engine.step,
        llm.engine.describe,
        llm.engine.gauges,
        lambda: llm.engine.add_request("r", "hello"),
    ):
        with pytest.raises(EngineClosedError, match=CLOSED):
            use()


def test_a_closed_engine_lets_go_of_its_model_and_kv_cache() -> None:
    # a notebook keeps the variable: close() must free the weights and the KV pool (on a GPU,
    # most of its memory) without waiting for the LLM itself to go
    llm = LLM(model="tiny", num_threads=1)
    model = weakref.ref(llm.engine.runner.model)
    kv = weakref.ref(llm.engine.kv)
    llm.close()
    gc.collect()
    assert model() is None and kv() is None


def test_closing_a_speculative_llm_closes_its_draft_engine() -> None:
    llm = LLM(
        model="tiny",
        num_threads=1,
        speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2},
    )
    proposer = llm.engine.proposer
    draft = proposer.engine  # type: ignore[union-attr]
    draft_model = weakref.ref(draft.runner.model)
    llm.generate("hello there", GREEDY)
    llm.close()
    gc.collect()
    assert draft.closed
    assert draft_model() is None
