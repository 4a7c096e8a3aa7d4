"""The disaggregated engine with its instance processes: the colocated engine's greedy tokens
over both connectors, and each fault ending in a clear error or a counted fallback, with no
process left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from engines.base import ConfigError, Failed, Finished, RequestEvent, Tokens
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.builtin.disaggregation.connectors import KV_CONNECTORS
from engines.builtin.disaggregation.router import DisaggregatedEngine
from engines.builtin.engine import EngineDeadError, LLMEngine
from engines.builtin.factory import build_engine
from engines.builtin.llm import LLM
from engines.sampling_params import SamplingParams
from engines.structured_outputs import StructuredOutputsParams as Constraint
from serving.testing import serve_engine

BASE = {"model": "tiny", "kv_cache": "paged", "block_size": 4, "num_threads": 1}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(7, 7 + n)) for n in (1, 5, 8, 31, 64)]


def collect(engine, deadline_s: float = 120.0) -> list[RequestEvent]:
    events: list[RequestEvent] = []
    stop = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < stop, "the engine hung"
        events += engine.step()
    return events


def until_first_token(engine: DisaggregatedEngine) -> None:
    events: list[RequestEvent] = []
    while not any(isinstance(e, Tokens) for e in events):
        events += engine.step()


def tokens_of(events: list[RequestEvent]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for event in events:
        if isinstance(event, Tokens):
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
    return tokens


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(**BASE))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    return tokens_of(collect(engine))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone too: it has exited and only waits to be reaped
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "zombie" in status.read_text()


def pids(engine: DisaggregatedEngine) -> list[int]:
    return [i.process.pid for i in engine.instances]


@pytest.mark.parametrize("connector", ["shm", "gloo"])
def test_disaggregated_tokens_equal_colocated(
    connector: str, expected: dict[str, list[int]]
) -> None:
    engine = build_engine(EngineConfig(**BASE, disaggregation="pd", kv_connector=connector))
    assert isinstance(engine, DisaggregatedEngine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    events = collect(engine)
    folder = getattr(engine._links, "folder", None)
    facts = engine.describe()["disaggregation"]
    engine.close()
    assert tokens_of(events) == expected
    finished = {e.request_id: e for e in events if isinstance(e, Finished)}
    one_token = finished["r0"].disaggregated
    assert one_token is not None and one_token.prefill_instance is None
    assert one_token.fallback == "a one-token prompt has no K/V to hand over"
    for i in range(1, len(PROMPTS)):
        pd = finished[f"r{i}"].disaggregated
        assert pd is not None and pd.prefill_instance == 0 and pd.fallback is None
        assert pd.kv_bytes == -(-(len(PROMPTS[i]) - 1) // 4) * 2048  # tiny: 512 B a token
        assert pd.kv_transfer_ns is not None and pd.kv_transfer_ns > 0
    assert facts["kv_handoffs_received"] == len(PROMPTS) - 1
    assert all(gone(pid) for pid in pids(engine))
    if folder is not None:
        assert not Path(folder).exists()


def test_a_dead_decode_instance_fails_its_requests_and_the_engine() -> None:
    engine = DisaggregatedEngine(EngineConfig(**BASE, disaggregation="pd"))
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PROMPTS[3], long)
    engine.add_request("b", PROMPTS[4], long)
    until_first_token(engine)
    decode = engine.instances[1]
    os.kill(decode.process.pid, signal.SIGKILL)
    events = collect(engine, 30)
    failed = [e for e in events if isinstance(e, Failed)]
    assert {e.request_id for e in failed} == {"a", "b"}
    assert all(f"decode instance 0 (pid {decode.process.pid}) exited" in e.error for e in failed)
    assert engine.failure is not None and "no decode instance is left" in engine.failure
    with pytest.raises(EngineDeadError, match="decode instance 0"):
        engine.add_request("c", PROMPTS[1], GREEDY)
    assert all(gone(pid) for pid in pids(engine))  # the prefill instance was ended too
    engine.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_hung_prefill_instance_is_timed_out(policy: str, expected: dict[str, list[int]]) -> None:
    """SIGSTOP: the prefill instance is alive and silent. Its requests are prefilled where they
    decode after kv_transfer_timeout_s (or fail, by policy), and no more go to it."""
    config = EngineConfig(
        **BASE, disaggregation="pd", kv_transfer_timeout_s=1.0, kv_load_failure_policy=policy
    )
    engine = DisaggregatedEngine(config)
    prefill = engine.instances[0]
    os.kill(prefill.process.pid, signal.SIGSTOP)
    try:
        for i in (1, 3):
            engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
        events = collect(engine, 60)
        engine.add_request("r4", PROMPTS[4], GREEDY)  # routed around the silent instance
        later = collect(engine, 60)
    finally:
        engine.close()
    assert gone(prefill.process.pid)  # killed while stopped
    assert tokens_of(later) == {"r4": expected["r4"]}
    after = next(e for e in later if isinstance(e, Finished)).disaggregated
    assert after is not None and after.fallback == "no prefill instance is answering"
    if policy == "fail":
        failed = [e for e in events if isinstance(e, Failed)]
        assert {e.request_id for e in failed} == {"r1", "r3"}
        assert all("kv_load_failure_policy=fail" in e.error for e in failed)
        return
    assert tokens_of(events) == {"r1": expected["r1"], "r3": expected["r3"]}
    for event in events:
        if isinstance(event, Finished):
            assert event.disaggregated is not None
            assert "kv_transfer_timeout_s=1" in str(event.disaggregated.fallback)
    assert engine.counters["kv_fallbacks"] == 2  # the decode side timed out r1 and r3
    assert engine.counters["colocated_requests"] == 1  # r4 never went to it
    assert engine.counters["prefill_instances_unresponsive"] == 1  # once per instance


def test_a_hung_decode_instance_is_killed_and_fails_its_requests() -> None:
    """SIGSTOP mid-stream: silent for 4 x kv_transfer_timeout_s with requests to run."""
    config = EngineConfig(**BASE, disaggregation="pd", kv_transfer_timeout_s=1.0)
    engine = DisaggregatedEngine(config)
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PROMPTS[3], long)
    until_first_token(engine)
    decode = engine.instances[1]
    os.kill(decode.process.pid, signal.SIGSTOP)
    began = time.monotonic()
    events = collect(engine, 30)
    waited = time.monotonic() - began
    engine.close()
    failed = [e for e in events if isinstance(e, Failed)]
    assert [e.request_id for e in failed] == ["a"]
    assert "decode instance 0" in failed[0].error and "killed" in failed[0].error
    assert 3.5 < waited < 15
    assert all(gone(pid) for pid in pids(engine))


def test_llm_generate_over_the_disaggregated_engine(expected: dict[str, list[int]]) -> None:
    with LLM(**{**BASE, "disaggregation": "pd"}) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
    tokens = {f"r{i}": list(out.outputs[0].token_ids) for i, out in enumerate(outputs)}
    assert tokens == expected
    assert [out.prompt_token_ids for out in outputs] == PROMPTS


def test_structured_outputs_are_checked_by_the_router_and_enforced_by_decode() -> None:
    """A constraint no instance could compile is refused at add_request naming the field (a
    400 from the server, as colocated); one it can is enforced, with colocated's tokens."""
    pattern = r"[0-9]{3}-[a-z]{2}"
    sampling = SamplingParams(
        max_tokens=12, temperature=0.0, structured_outputs=Constraint(regex=pattern)
    )
    with LLM(**BASE) as colocated:
        want = colocated.generate([PROMPTS[2]], sampling)[0].outputs[0]
    with LLM(**{**BASE, "disaggregation": "pd"}) as llm:
        got = llm.generate([PROMPTS[2]], sampling)[0].outputs[0]
        unclosed = SamplingParams(structured_outputs=Constraint(regex="(unclosed"))
        message = "structured_outputs.regex: xgrammar cannot compile"
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.engine.add_request("bad", PROMPTS[2], unclosed)
        assert not llm.engine.has_unfinished_requests()
    assert list(got.token_ids) == list(want.token_ids)
    assert re.fullmatch(pattern, got.text)


def test_sliding_window_models_are_refused_by_name() -> None:
    config = EngineConfig(**BASE, disaggregation="pd", model_overrides={"sliding_window": 8})
    with pytest.raises(ConfigError, match=r"engine\.disaggregation='pd': .*sliding window"):
        DisaggregatedEngine(config)


def test_a_killed_routers_shared_memory_is_cleared_by_the_next() -> None:
    stale = Path("/dev/shm") / "inferlab-pd-999999999-abcd"
    stale.mkdir()
    (stale / "0-0.kv").write_bytes(b"x" * 10)
    links = KV_CONNECTORS.get("shm").setup(1, 1)
    try:
        assert not stale.exists()
        assert Path(links.folder).is_dir()
    finally:
        KV_CONNECTORS.get("shm").cleanup(links)
    assert not Path(links.folder).exists()


def test_aborted_requests_leave_nothing_waiting() -> None:
    engine = DisaggregatedEngine(EngineConfig(**BASE, disaggregation="pd"))
    try:
        for i in range(1, 5):
            engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
        engine.step()
        for i in range(1, 5):
            engine.abort_request(f"r{i}")
        assert not engine.has_unfinished_requests()
        engine.add_request("again", PROMPTS[2], GREEDY)
        events = collect(engine)
    finally:
        engine.close()
    assert {e.request_id for e in events if isinstance(e, Finished)} == {"again"}


def test_the_harness_backend_drives_it() -> None:
    """BuiltinBackend (inferlab run, inferlab serve) over the disaggregated engine: a step
    record from each instance, labelled."""
    backend = BuiltinBackend(EngineConfig(**BASE, disaggregation="pd"))
    backend.load()
    records = []
    backend.step_observers.append(records.append)
    engine = backend.engine
    try:
        engine.add_request("x", PROMPTS[3], GREEDY)
        collect(engine)
        time.sleep(0.1)
        engine.step()
        assert backend.describe()["disaggregation"]["mode"] == "pd"
    finally:
        backend.close()
    assert {r.instance for r in records} == {"prefill0", "decode0"}


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"kv_cache": "contiguous"}, "kv_cache"),
        ({"enable_prefix_caching": True, "kv_host_tier_bytes": 1 << 20}, "kv_host_tier_bytes"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"kv_connector": "nccl"}, "kv_connector"),
        ({"kv_load_failure_policy": "ignore"}, "kv_load_failure_policy"),
    ],
)
def test_options_it_cannot_take_are_refused_by_name(options: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"engine.{key}"):
        EngineConfig(**{**BASE, "disaggregation": "pd", **options})


def test_inferlab_serve_answers_as_the_colocated_engine() -> None:
    """The OpenAI-compatible server over the disaggregated engine: the same greedy text as
    over a colocated one, streamed or not; a request that cannot fit refused with a 400."""
    body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 6, "temperature": 0}
    texts = []
    for options in ({}, {"disaggregation": "pd"}):
        with (
            serve_engine({**BASE, **options}) as running,
            httpx.Client(base_url=running.base_url, timeout=60) as client,
        ):
            whole = client.post("/v1/completions", json={**body, "ignore_eos": True}).json()
            streamed = client.post(
                "/v1/completions", json={**body, "ignore_eos": True, "stream": True}
            ).text
            too_long = client.post("/v1/completions", json={**body, "max_tokens": 5000})
        texts.append(whole["choices"][0]["text"])
        chunks = [line.removeprefix("data: ") for line in streamed.splitlines() if line]
        pieces = [json.loads(chunk)["choices"][0]["text"] for chunk in chunks[:-1]]
        assert chunks[-1] == "[DONE]" and "".join(pieces) == texts[-1]
        assert too_long.status_code == 400
    assert texts[0] == texts[1]
