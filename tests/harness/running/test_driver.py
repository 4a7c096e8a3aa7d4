"""The driver: open, capped and closed loops, multi-turn sessions, lateness, against a scripted
backend (in real time, or in virtual time for exact times) and the built-in engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from engines.base import (
    Backend,
    Finished,
    GenerationRequest,
    RequestEvent,
    Scheduled,
    Tokenized,
    Tokens,
    now_ns,
)
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.sampling_params import SamplingParams
from harness.running.driver import Clock, Driver
from workloads.request import WorkloadRequest


class ScriptedBackend(Backend):
    """Each request takes `service_s` and yields `max_tokens` tokens; records concurrency."""

    name = "scripted"

    def __init__(self, service_s: float = 0.02, clock: Clock = now_ns) -> None:
        super().__init__()
        self.service_s = service_s
        self.clock = clock
        self.in_flight = 0
        self.max_in_flight = 0
        self.prompts: dict[str, object] = {}

    def load(self) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        self.prompts[request.request_id] = request.prompt
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        rid = request.request_id
        try:
            n = len(request.prompt)
            yield Tokenized(rid, 0, self.clock(), n)
            yield Scheduled(rid, 0, self.clock())
            await asyncio.sleep(self.service_s)
            count = request.sampling.max_tokens
            yield Tokens(rid, 1, self.clock(), tuple(range(100, 100 + count)), "x" * count)
            yield Finished(rid, 1, self.clock(), "length", n, count, text="x" * count)
        finally:
            self.in_flight -= 1


def item(
    rid: str, prompt: object, arrival: float = 0.0, follows: str | None = None, max_tokens: int = 2
) -> WorkloadRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return WorkloadRequest(GenerationRequest(rid, prompt, params), arrival, follows=follows)


def run(
    backend: Backend,
    workload: list[WorkloadRequest],
    concurrency: int | None = None,
    max_concurrency: int | None = None,
    clock: Clock = now_ns,
) -> dict[str, dict]:
    rows: dict[str, dict] = {}

    def sink(table: str, row: dict) -> None:
        if table == "requests":
            rows[row["request_id"]] = row

    Driver(backend, sink, clock=clock).run(
        workload, concurrency=concurrency, max_concurrency=max_concurrency
    )
    return rows


def test_closed_loop_keeps_exactly_c_in_flight() -> None:
    backend = ScriptedBackend()
    rows = run(backend, [item(f"r{i}", [1, 2, 3]) for i in range(12)], concurrency=3)
    assert backend.max_in_flight == 3 and len(rows) == 12
    sends = sorted(r["sent_s"] for r in rows.values())
    # 12 requests, 3 at a time, 0.02 s each: the last wave starts after three waves
    assert sends[-1] >= 3 * backend.service_s * 0.9


def test_open_loop_sends_at_arrival_times_and_records_lateness() -> None:
    backend = ScriptedBackend(service_s=0.001)
    arrivals = [0.0, 0.05, 0.1]
    rows = run(backend, [item(f"r{i}", [1], a) for i, a in enumerate(arrivals)])
    for i, a in enumerate(arrivals):
        row = rows[f"r{i}"]
        assert row["arrival_s"] == pytest.approx(a, abs=1e-6)
        assert 0 <= row["sent_s"] - row["arrival_s"] < 0.02  # lateness, recorded


@pytest.mark.parametrize("concurrency", [None, 1])
def test_a_given_t0_is_waited_for_and_is_the_rows_origin(concurrency: int | None) -> None:
    """Drivers in several processes start together (run.num_clients): each waits for the
    shared t0, and its rows count from it."""
    rows: dict[str, dict] = {}
    driver = Driver(ScriptedBackend(service_s=0.001), lambda t, row: rows.update({t: row}))
    t0 = now_ns() + 50_000_000
    assert driver.run([item("r0", [1], 0.01)], concurrency=concurrency, t0=t0) == t0
    sent_s = rows["requests"]["sent_s"]
    assert sent_s >= (0.01 if concurrency is None else 0.0)  # not before t0 (+ its arrival)
    assert sent_s < 0.04  # counted from t0, not from the call 50 ms before it


def test_sessions_send_follow_ups_after_the_turn_with_history() -> None:
    backend = ScriptedBackend()
    chat = [{"role": "user", "content": "hi"}]
    workload = [
        item("s0-t0", chat),
        item("s0-t1", [{"role": "user", "content": "more"}], arrival=0.03, follows="s0-t0"),
        item("ids-t0", [5, 6]),
        item("ids-t1", [7], arrival=0.0, follows="ids-t0"),
    ]
    rows = run(backend, workload)
    assert backend.prompts["s0-t1"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "xx"},
        {"role": "user", "content": "more"},
    ]
    assert backend.prompts["ids-t1"] == [5, 6, 100, 101, 7]
    # the follow-up became due think time after the previous turn finished
    assert rows["s0-t1"]["arrival_s"] == pytest.approx(rows["s0-t0"]["finished_s"] + 0.03, abs=1e-6)
    assert rows["s0-t1"]["sent_s"] >= rows["s0-t1"]["arrival_s"]


def test_follow_up_of_a_failed_turn_fails_and_orphans_are_refused() -> None:
    backend = BuiltinBackend(EngineConfig(model="tiny", max_model_len=32))
    backend.load()
    rows = run(backend, [item("a", list(range(10, 60))), item("b", [11], follows="a")])
    assert rows["a"]["status"] == "failed" and rows["b"]["status"] == "failed"
    assert "previous turn a failed" in rows["b"]["error"]
    with pytest.raises(ValueError, match="follow requests that are not in the workload"):
        run(backend, [item("c", [11], follows="nope")])


def test_sessions_on_the_engine_grow_the_prompt() -> None:
    backend = BuiltinBackend(EngineConfig(model="tiny"))
    backend.load()
    rows = run(
        backend,
        [item("t0", [10, 11, 12], max_tokens=4), item("t1", [13, 14], follows="t0", max_tokens=3)],
        concurrency=1,
    )
    assert rows["t0"]["prompt_tokens"] == 3
    assert rows["t1"]["prompt_tokens"] == 3 + 4 + 2  # previous prompt + reply + new message
    assert rows["t1"]["output_tokens"] == 3


def test_every_turn_after_a_failed_turn_keeps_a_failed_row() -> None:
    backend = BuiltinBackend(EngineConfig(model="tiny", max_model_len=32))
    backend.load()
    rows = run(
        backend,
        [
            item("t0", list(range(10, 60))),
            item("t1", [11], follows="t0"),
            item("t2", [12], follows="t1"),
        ],
    )
    assert [rows[r]["status"] for r in ("t0", "t1", "t2")] == ["failed"] * 3


# ---- virtual time: exact times for the capped open loop ------------------------------------


def most_in_flight(rows: dict[str, dict]) -> int:
    """The most requests in flight at once by the rows (sent, finished), a finish at the
    instant of a send counting as before it."""
    events = sorted(
        [(r["sent_s"], 1) for r in rows.values()] + [(r["finished_s"], -1) for r in rows.values()],
        key=lambda event: (event[0], event[1]),
    )
    count = peak = 0
    for _, step in events:
        count += step
        peak = max(peak, count)
    return peak


def test_a_cap_makes_arrivals_wait_for_a_slot_first_come_first_served(
    virtual_time: Clock,
) -> None:
    """Rate 4 (a request every 0.25 s), 0.75 s each, at most 2 in flight."""
    backend = ScriptedBackend(service_s=0.75, clock=virtual_time)
    workload = [item(f"r{i}", [1], arrival=i * 0.25) for i in range(6)]
    rows = run(backend, workload, max_concurrency=2, clock=virtual_time)
    # r2 arrives at 0.5 with r0 and r1 in flight and takes r0's slot at 0.75; r3 (0.75) comes
    # after r2 and takes r1's at 1.0; r4 (1.0) gets r2's at 1.5, r5 (1.25) r3's at 1.75
    sent = {"r0": 0.0, "r1": 0.25, "r2": 0.75, "r3": 1.0, "r4": 1.5, "r5": 1.75}
    for rid, row in rows.items():
        assert row["arrival_s"] == int(rid[1]) * 0.25  # the schedule, untouched by the wait
        assert row["sent_s"] == sent[rid]
        assert row["finished_s"] == sent[rid] + 0.75
    assert backend.max_in_flight == 2 and most_in_flight(rows) == 2
    uncapped = run(ScriptedBackend(0.75, virtual_time), workload, clock=virtual_time)
    assert [r["sent_s"] for r in uncapped.values()] == [i * 0.25 for i in range(6)]
    assert most_in_flight(uncapped) == 3


def test_under_a_cap_every_turn_waits_for_a_slot_of_its_own(virtual_time: Clock) -> None:
    backend = ScriptedBackend(service_s=0.5, clock=virtual_time)
    workload = [
        item("s0-t0", [1]),
        item("s0-t1", [2], arrival=0.125, follows="s0-t0"),  # due 0.5 + 0.125
        item("s1-t0", [3], arrival=0.25),
    ]
    rows = run(backend, workload, max_concurrency=1, clock=virtual_time)
    # s1-t0 waits for s0-t0's slot (0.5); s0-t1, due at 0.625, for s1-t0's (1.0)
    assert [(r["arrival_s"], r["sent_s"]) for r in rows.values()] == [
        (0.0, 0.0),
        (0.25, 0.5),
        (0.625, 1.0),
    ]
    assert list(rows) == ["s0-t0", "s1-t0", "s0-t1"]
    assert backend.prompts["s0-t1"] == [1, 100, 101, 2]  # the history, as without a cap
    assert backend.max_in_flight == 1


def test_a_cap_that_never_binds_changes_no_row(virtual_time: Clock) -> None:
    """Poisson arrivals and two-turn sessions: rows with a cap of 1000 equal those without."""
    arrivals = np.cumsum(np.random.default_rng(0).exponential(0.01, size=20))
    workload = []
    for i, arrival in enumerate(arrivals):
        workload.append(item(f"s{i}-t0", [1, 2], arrival=float(arrival)))
        workload.append(item(f"s{i}-t1", [3], arrival=0.005, follows=f"s{i}-t0"))
    rows = [
        run(ScriptedBackend(0.03, virtual_time), workload, max_concurrency=cap, clock=virtual_time)
        for cap in (None, 1000)
    ]
    assert len(rows[0]) == 40 and list(rows[0].items()) == list(rows[1].items())
    assert most_in_flight(rows[0]) > 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_concurrency": 0}, r"^max_concurrency: 0 is invalid; allowed: an integer >= 1$"),
        ({"max_concurrency": -1}, r"^max_concurrency: -1 is invalid; allowed: an integer >= 1$"),
        (
            {"concurrency": 2, "max_concurrency": 4},
            r"^max_concurrency: 4 is invalid; allowed: None with a closed loop",
        ),
    ],
)
def test_the_driver_refuses_a_bad_cap(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Driver(ScriptedBackend(), lambda table, row: None).run([item("r", [1])], **options)
