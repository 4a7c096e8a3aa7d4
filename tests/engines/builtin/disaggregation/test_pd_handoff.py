"""A prompt's K/V computed by one engine (export_kv) and loaded by another (remote_kv), in one
process: the decode side's greedy tokens equal a colocated engine's, with chunked prefill,
prefix caching and preemption on either side."""

from __future__ import annotations

import pytest
import torch

from engines.base import Finished, Tokens
from engines.builtin.config import EngineConfig
from engines.builtin.engine import LLMEngine
from engines.sampling_params import SamplingParams

BASE = {"model": "tiny", "kv_cache": "paged", "block_size": 4, "num_threads": 1}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(7, 7 + n)) for n in (1, 2, 5, 8, 13, 31)]  # none, partial, full blocks


def run(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, Finished]]:
    tokens: dict[str, list[int]] = {}
    finished: dict[str, Finished] = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if isinstance(event, Tokens):
                tokens.setdefault(event.request_id, []).extend(event.token_ids)
            elif isinstance(event, Finished):
                finished[event.request_id] = event
    return tokens, finished


def colocated(prompts: list[list[int]], **options: object) -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(**{**BASE, **options}))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    return run(engine)[0]


def prefill(prompts: list[list[int]], **options: object) -> dict[str, torch.Tensor]:
    engine = LLMEngine(EngineConfig(**{**BASE, **options}))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1), export_kv=True)
    _, finished = run(engine)
    exported = {rid: engine.take_exported_kv(rid) for rid in finished}
    assert all(kv is not None for kv in exported.values())
    assert engine.take_exported_kv("r0") is None  # taken once
    return exported  # type: ignore[return-value]


def decode(
    prompts: list[list[int]], exported: dict[str, torch.Tensor], **options: object
) -> tuple[dict[str, list[int]], dict[str, Finished], int]:
    """The decode side's tokens, its Finished events, and the prompt tokens it computed."""
    engine = LLMEngine(EngineConfig(**{**BASE, **options}))
    computed: list[int] = []
    engine.step_observers.append(lambda record: computed.append(record.prefill_tokens))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY, remote_kv=exported[f"r{i}"])
    tokens, finished = run(engine)
    return tokens, finished, sum(computed)


@pytest.mark.parametrize(
    ("prefill_options", "decode_options"),
    [
        ({}, {}),
        ({"enable_chunked_prefill": True, "max_num_batched_tokens": 8}, {}),
        ({"enable_prefix_caching": True}, {"enable_prefix_caching": True}),
        ({}, {"enable_chunked_prefill": True, "max_num_batched_tokens": 8}),
    ],
    ids=["plain", "chunked-prefill", "prefix-caching", "chunked-decode"],
)
def test_handed_over_kv_decodes_the_colocated_tokens(
    prefill_options: dict[str, object], decode_options: dict[str, object]
) -> None:
    expected = colocated(PROMPTS)
    exported = prefill(PROMPTS, **prefill_options)
    for i, prompt in enumerate(PROMPTS):
        assert next(iter(exported[f"r{i}"].shape)) == -(-(len(prompt) - 1) // 4)
    tokens, finished, computed = decode(PROMPTS, exported, **decode_options)
    assert tokens == expected
    assert computed == len(PROMPTS)  # each prompt's last token only, to sample
    assert [f.num_prompt_tokens for f in finished.values()] == [len(p) for p in PROMPTS]


def test_decode_side_prefix_cache_shares_handed_over_blocks() -> None:
    """Two prompts with one 16-token head: the second finds the first's loaded blocks cached."""
    head = list(range(40, 56))
    prompts = [[*head, 3, 4, 5], [*head, 9, 8]]
    expected = colocated(prompts)
    exported = prefill(prompts)
    engine = LLMEngine(EngineConfig(**BASE, enable_prefix_caching=True))
    engine.add_request("r0", prompts[0], GREEDY, remote_kv=exported["r0"])
    first, _ = run(engine)
    engine.add_request("r1", prompts[1], GREEDY, remote_kv=exported["r1"])
    second, finished = run(engine)
    assert {**first, **second} == expected
    assert finished["r1"].cached_prompt_tokens == 16


def test_preempted_decode_reloads_the_handed_over_kv() -> None:
    """A decode pool too small for every request at once: preempted sequences are readmitted
    with their K/V loaded again (not recomputed), and their tokens do not change."""
    prompts = [list(range(10 + 30 * i, 30 + 30 * i)) for i in range(4)]  # 20 tokens each
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(**BASE))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    expected = run(engine)[0]
    exported = prefill(prompts)
    small = LLMEngine(EngineConfig(**BASE, kv_cache_memory_bytes=20 * 4 * 512))  # 20 blocks
    for i, prompt in enumerate(prompts):
        small.add_request(f"r{i}", prompt, sampling, remote_kv=exported[f"r{i}"])
    seqs = dict(small.sequences)
    tokens, finished = run(small)
    assert tokens == expected
    assert sum(f.num_preemptions for f in finished.values()) > 0
    for rid, seq in seqs.items():
        preemptions = finished[rid].num_preemptions
        assert seq.remote_prompt_tokens == 19 * (1 + preemptions)


def test_remote_kv_that_does_not_fit_is_refused_by_name() -> None:
    engine = LLMEngine(EngineConfig(**BASE))
    exported = prefill(PROMPTS[4:5])["r0"]
    with pytest.raises(
        ValueError,
        match=r"remote_kv: torch.uint8 \(3, \d+\) .* 17 prompt tokens.*allowed: uint8 \(5, ",
    ):
        engine.add_request("a", PROMPTS[4] + [1, 2, 3, 4, 5], GREEDY, remote_kv=exported)
    with pytest.raises(ValueError, match=r"remote_kv: .*prompt_logprobs"):
        engine.add_request(
            "b",
            PROMPTS[4],
            SamplingParams(max_tokens=2, prompt_logprobs=1),
            remote_kv=exported,
        )
    contiguous = LLMEngine(EngineConfig(**{**BASE, "kv_cache": "contiguous"}))
    with pytest.raises(ValueError, match=r"remote_kv: .*kv_cache=paged"):
        contiguous.add_request("c", PROMPTS[4], GREEDY, remote_kv=exported)
    assert not engine.has_unfinished_requests()
