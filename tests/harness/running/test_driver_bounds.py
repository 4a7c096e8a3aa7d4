"""The driver's cancellation and bounds, in virtual time against scripted backends: a request
the workload cancels has its stream closed on time and a `cancelled` row with its tokens so
far; run.max_duration_s (open loop, closed loop, sessions), run.max_errors (a count, a
fraction) and the over-saturation stop end a run early with every sent request's row, the
in-flight ones given the grace, the rest counted unsent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from engines.base import (
    Backend,
    Failed,
    Finished,
    GenerationRequest,
    RequestEvent,
    Scheduled,
    Tokenized,
    Tokens,
)
from engines.sampling_params import SamplingParams
from harness.running.driver import Clock, Driver, RunBounds
from harness.running.saturation import SaturationConfig
from workloads.request import WorkloadRequest


class StreamingBackend(Backend):
    """One token every `token_s` (max_tokens of them) after `wait_s`; a server of
    `capacity` requests at a time (FIFO) when given one; every `fail_every`-th request fails
    (0: none). Records the streams closed before their end."""

    name = "streaming"

    def __init__(
        self,
        clock: Clock,
        token_s: float = 0.1,
        capacity: int | None = None,
        fail_every: int = 0,
    ) -> None:
        super().__init__()
        self.clock = clock
        self.token_s = token_s
        self.capacity = capacity
        self.fail_every = fail_every
        self.count = 0
        self.closed_early: list[str] = []
        self._slots: asyncio.Semaphore | None = None

    def load(self) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        rid, count = request.request_id, request.sampling.max_tokens
        self.count += 1
        ended = False
        try:
            yield Tokenized(rid, 0, self.clock(), 1)
            if self.fail_every and self.count % self.fail_every == 0:
                await asyncio.sleep(self.token_s)
                ended = True
                yield Failed(rid, 0, self.clock(), "scripted failure")
                return
            if self.capacity is not None:
                if self._slots is None:
                    self._slots = asyncio.Semaphore(self.capacity)
                await self._slots.acquire()
            try:
                yield Scheduled(rid, 0, self.clock())
                for i in range(count):
                    await asyncio.sleep(self.token_s)
                    yield Tokens(rid, i, self.clock(), (100 + i,), "x")
                ended = True
                yield Finished(rid, count, self.clock(), "length", 1, count, text="x" * count)
            finally:
                if self._slots is not None and self.capacity is not None:
                    self._slots.release()
        finally:
            if not ended:
                self.closed_early.append(rid)


def item(
    rid: str,
    arrival: float = 0.0,
    max_tokens: int = 5,
    cancel_after_s: float | None = None,
    follows: str | None = None,
) -> WorkloadRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return WorkloadRequest(
        GenerationRequest(rid, [1], params),
        arrival,
        follows=follows,
        cancel_after_s=cancel_after_s,
    )


def drive(
    backend: Backend,
    workload: list[WorkloadRequest],
    clock: Clock,
    bounds: RunBounds | None = None,
    **options: Any,
) -> tuple[Driver, dict[str, dict], list[dict]]:
    rows: dict[str, dict] = {}
    tokens: list[dict] = []

    def sink(table: str, row: dict) -> None:
        if table == "requests":
            rows[row["request_id"]] = row
        elif table == "tokens":
            tokens.append(row)

    driver = Driver(backend, sink, clock=clock, bounds=bounds)
    driver.run(workload, **options)
    return driver, rows, tokens


def statuses(rows: dict[str, dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows.values():
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return counts


# ---- cancellation -------------------------------------------------------------------------


def test_a_cancelled_request_closes_its_stream_on_time_and_keeps_its_tokens(
    virtual_time: Clock,
) -> None:
    backend = StreamingBackend(virtual_time, token_s=0.1)
    workload = [
        item("cut", max_tokens=10, cancel_after_s=0.25),
        item("whole", max_tokens=10),
        item("done-first", max_tokens=2, cancel_after_s=5.0),  # finishes at 0.2: simply ok
    ]
    driver, rows, tokens = drive(backend, workload, virtual_time)
    cut = rows["cut"]
    assert cut["status"] == "cancelled"
    assert cut["error"] == "cancelled by the workload 0.25 s after it was sent"
    assert cut["finished_s"] == 0.25 and cut["output_tokens"] == 2
    assert [t["index"] for t in tokens if t["request_id"] == "cut"] == [0, 1]
    assert cut["decode_s"] is None  # a cut request's phases do not add up to a latency
    assert rows["whole"]["status"] == "ok" and rows["whole"]["output_tokens"] == 10
    assert rows["done-first"]["status"] == "ok" and rows["done-first"]["finished_s"] == 0.2
    assert backend.closed_early == ["cut"]
    assert (driver.num_cancelled, driver.num_unsent, driver.stopped_by) == (1, 0, None)


def test_a_cancelled_turn_lets_its_session_go_on(virtual_time: Clock) -> None:
    backend = StreamingBackend(virtual_time, token_s=0.1)
    workload = [
        item("t0", max_tokens=10, cancel_after_s=0.25),
        item("t1", arrival=0.5, max_tokens=2, follows="t0"),
    ]
    _, rows, _ = drive(backend, workload, virtual_time)
    assert rows["t0"]["status"] == "cancelled" and rows["t1"]["status"] == "ok"
    assert rows["t1"]["sent_s"] == 0.75  # think time after the cancelled turn ended


# ---- run.max_duration_s -----------------------------------------------------------------


def test_max_duration_stops_an_open_loop_grace_then_cancel(virtual_time: Clock) -> None:
    """A request every 0.1 s, 0.5 s each; the bound at 1.95 s, a grace of 0.2 s: those sent
    by 1.6 s finish by 2.1 s; 1.7, 1.8 and 1.9 are cancelled at 2.15 s; 80 never go."""
    backend = StreamingBackend(virtual_time, token_s=0.1)
    workload = [item(f"r{i:03}", arrival=i / 10) for i in range(100)]
    bounds = RunBounds(max_duration_s=1.95, grace_s=0.2)
    driver, rows, _ = drive(backend, workload, virtual_time, bounds)
    assert len(rows) == 20 and driver.num_unsent == 80
    assert statuses(rows) == {"ok": 17, "cancelled": 3}
    for rid in ("r017", "r018", "r019"):
        assert rows[rid]["error"] == "run.max_duration_s=1.95 reached"
        assert rows[rid]["finished_s"] == pytest.approx(2.15)
    assert (driver.stopped_by, driver.stop_reason) == (
        "max_duration_s",
        "run.max_duration_s=1.95 reached",
    )


def test_max_duration_stops_a_closed_loop(virtual_time: Clock) -> None:
    """Two slots, 0.5 s each: sends at 0, 0.5 and 1.0 s; at 1.2 s (no grace) the two sent at
    1.0 are cancelled and the 14 left never go."""
    backend = StreamingBackend(virtual_time, token_s=0.1)
    workload = [item(f"r{i:02}") for i in range(20)]
    driver, rows, _ = drive(
        backend, workload, virtual_time, RunBounds(max_duration_s=1.2, grace_s=0), concurrency=2
    )
    assert statuses(rows) == {"ok": 4, "cancelled": 2} and driver.num_unsent == 14
    assert sorted(backend.closed_early) == ["r04", "r05"]


def test_max_duration_leaves_later_turns_of_sessions_unsent(virtual_time: Clock) -> None:
    """Three sessions of three turns (0.5 s each, 0.1 s think time): the second turns, sent
    at 0.6 s before the bound (0.8 s), finish in the grace; the third turns never go."""
    backend = StreamingBackend(virtual_time, token_s=0.1)
    workload = []
    for s in range(3):
        workload += [
            item(f"s{s}-t0"),
            item(f"s{s}-t1", arrival=0.1, follows=f"s{s}-t0"),
            item(f"s{s}-t2", arrival=0.1, follows=f"s{s}-t1"),
        ]
    driver, rows, _ = drive(backend, workload, virtual_time, RunBounds(max_duration_s=0.8))
    assert sorted(rows) == [f"s{s}-t{t}" for s in range(3) for t in (0, 1)]
    assert statuses(rows) == {"ok": 6} and driver.num_unsent == 3


def test_a_cap_wait_past_the_bound_is_unsent(virtual_time: Clock) -> None:
    """At most one in flight, all due at 0: one is sent; the others wait for its slot, which
    frees after the bound (and the grace: it is cancelled), so they never go."""
    backend = StreamingBackend(virtual_time, token_s=0.1)
    workload = [item(f"r{i}", max_tokens=10) for i in range(5)]
    bounds = RunBounds(max_duration_s=0.5, grace_s=0.1)
    driver, rows, _ = drive(backend, workload, virtual_time, bounds, max_concurrency=1)
    assert list(rows) == ["r0"] and rows["r0"]["status"] == "cancelled"
    assert rows["r0"]["finished_s"] == pytest.approx(0.6) and driver.num_unsent == 4


# ---- run.max_errors -----------------------------------------------------------------------


def test_max_errors_as_a_count(virtual_time: Clock) -> None:
    backend = StreamingBackend(virtual_time, token_s=0.01, fail_every=1)
    workload = [item(f"r{i:02}", arrival=i / 10) for i in range(50)]
    driver, rows, _ = drive(backend, workload, virtual_time, RunBounds(max_errors=3))
    assert statuses(rows) == {"failed": 3} and driver.num_unsent == 47
    assert driver.stopped_by == "max_errors"
    # the count, and the first failure's error: the cause, not only the count
    assert driver.stop_reason.startswith(
        "run.max_errors=3 reached: 3 requests failed; the first, r00: "
    )
    assert (
        driver.stop_reason.removeprefix(
            "run.max_errors=3 reached: 3 requests failed; the first, r00: "
        )
        == rows["r00"]["error"]
    )


@pytest.mark.parametrize(("fraction", "stops"), [(0.5, True), (0.6, False)])
def test_max_errors_as_a_fraction_waits_for_a_sample(
    virtual_time: Clock, fraction: float, stops: bool
) -> None:
    """Every other request fails: a bound of half stops the run once 20 have finished; one
    of 0.6 never does."""
    backend = StreamingBackend(virtual_time, token_s=0.01, fail_every=2)
    workload = [item(f"r{i:02}", arrival=i / 10, max_tokens=1) for i in range(60)]
    driver, rows, _ = drive(backend, workload, virtual_time, RunBounds(max_errors=fraction))
    if stops:
        assert driver.stopped_by == "max_errors" and 20 <= len(rows) <= 22
        assert driver.stop_reason is not None and "finished requests failed" in driver.stop_reason
        assert len(rows) + driver.num_unsent == 60
    else:
        assert driver.stopped_by is None and len(rows) == 60


# ---- the over-saturation stop ---------------------------------------------------------------


def poisson(rate: float, duration_s: float, seed: int = 0) -> list[WorkloadRequest]:
    gaps = np.random.default_rng(seed).exponential(1 / rate, size=int(rate * duration_s * 1.5))
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < duration_s]
    return [item(f"r{i:05}", arrival=float(a), max_tokens=4) for i, a in enumerate(arrivals)]


def test_an_overloaded_server_stops_the_run_early_and_flags_it(virtual_time: Clock) -> None:
    """A server of 4 at a time, 0.2 s a request (20 requests/s), offered 40/s for 120 s."""
    backend = StreamingBackend(virtual_time, token_s=0.05, capacity=4)
    workload = poisson(40.0, 120.0)
    saturation = SaturationConfig()
    bounds = RunBounds(grace_s=1.0, saturation=saturation)
    driver, rows, _ = drive(backend, workload, virtual_time, bounds)
    assert driver.stopped_by == "saturation" and driver.saturation is not None
    detected = driver.saturation["detected_at_s"]
    assert detected <= saturation.min_duration_s + saturation.window_s
    assert driver.stop_reason is not None and "run.stop_on_saturation" in driver.stop_reason
    # nothing sent after the verdict; every sent request has its row; the rest are unsent
    assert max(r["sent_s"] for r in rows.values()) <= detected
    assert len(rows) + driver.num_unsent == len(workload) and driver.num_unsent > 3000
    counts = statuses(rows)
    assert counts["ok"] > 0 and counts["cancelled"] > 0  # the queue left after the grace
    assert set(counts) == {"ok", "cancelled"}


@pytest.mark.parametrize(("rate", "seed"), [(14.0, 0), (18.0, 0), (18.0, 1)])
def test_a_load_the_server_sustains_runs_to_the_end(
    virtual_time: Clock, rate: float, seed: int
) -> None:
    """The same server offered 70% and 90% of what it can do, Poisson, for 90 s: at 90% its
    queue wanders for tens of seconds, which is no overload."""
    backend = StreamingBackend(virtual_time, token_s=0.05, capacity=4)
    workload = poisson(rate, 90.0, seed)
    bounds = RunBounds(saturation=SaturationConfig())
    driver, rows, _ = drive(backend, workload, virtual_time, bounds)
    assert driver.stopped_by is None and driver.saturation is None
    assert statuses(rows) == {"ok": len(workload)}


class InterruptedBackend(StreamingBackend):
    """Ctrl-C arrives (a KeyboardInterrupt out of a stream) once `at_s` has passed."""

    def __init__(self, clock: Clock, at_s: float, **options: Any) -> None:
        super().__init__(clock, **options)
        self.at_ns = int(at_s * 1e9)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        async for event in super().generate(request):
            if self.clock() >= self.at_ns:
                raise KeyboardInterrupt("SIGTERM")
            yield event


def test_an_interrupt_in_the_grace_keeps_the_bound_and_counts_the_sent(
    virtual_time: Clock,
) -> None:
    """max_duration_s stops sending at 0.35 s (4 of 10 sent); Ctrl-C comes 2 s into the grace,
    with all 4 in flight. The stop is kept (`stopped_by`), and the 4 sent are not counted as
    unsent (num_unsent was planned - rows: 10 of 10)."""
    backend = InterruptedBackend(virtual_time, at_s=2.0, token_s=0.1)
    workload = [item(f"r{i}", arrival=i / 10, max_tokens=100) for i in range(10)]
    driver = Driver(backend, lambda table, row: None, clock=virtual_time,
                    bounds=RunBounds(max_duration_s=0.35, grace_s=60))  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        driver.run(workload)
    assert driver.stopped_by == "max_duration_s" and driver.num_rows == 0
    assert driver.num_sent == 4 and driver.num_unsent == 6
