"""Cancellation over HTTP: with engine=openai against `inferlab serve` (model=tiny, in a
thread), a request the workload cancels has its response closed; the server takes the
client as gone, aborts the engine request and frees its KV blocks; the row is `cancelled` and
the client's figures count it closed, not failed."""

from __future__ import annotations

import time
from collections.abc import Callable

from engines.backends import build_backend
from engines.base import GenerationRequest
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.builtin.kv_cache import PagedKVCacheManager
from engines.openai.backend import OpenAIBackend
from engines.sampling_params import SamplingParams
from harness.running.driver import Driver
from serving.testing import serve_in_thread
from workloads.request import WorkloadRequest


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_a_cancelled_request_closes_the_response_and_the_server_aborts_it() -> None:
    served = BuiltinBackend(EngineConfig(model="tiny", kv_cache="paged"))
    served.load()
    with serve_in_thread(served) as server:
        metrics = server.serving.metrics
        aborted_before = metrics.requests_aborted.get()
        client = build_backend(
            {"backend": "openai", "base_url": f"{server.base_url}/v1", "server": "vllm"},
            {"name": "tiny"},
        )
        assert isinstance(client, OpenAIBackend)
        client.load()
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        workload = [
            WorkloadRequest(
                GenerationRequest(f"r{i}", list(range(10, 30)), params),
                0.0,
                cancel_after_s=0.3 if i % 2 else None,
            )
            for i in range(4)
        ]
        rows: dict[str, dict] = {}
        Driver(
            client,
            lambda table, row: (
                rows.update({row["request_id"]: row}) if table == "requests" else None
            ),
        ).run(workload)
        assert {rid: row["status"] for rid, row in rows.items()} == {
            "r0": "ok",
            "r1": "cancelled",
            "r2": "ok",
            "r3": "cancelled",
        }
        for rid in ("r1", "r3"):
            assert rows[rid]["error"] == "cancelled by the workload 0.3 s after it was sent"
            assert 0 < rows[rid]["output_tokens"] < 400
        assert rows["r0"]["output_tokens"] == 400
        # the server saw both clients go and aborted their requests; no block is left held
        assert wait_until(lambda: metrics.requests_aborted.get() == aborted_before + 2)
        engine = server.serving.engine
        kv = engine.kv
        assert isinstance(kv, PagedKVCacheManager)
        assert wait_until(lambda: kv.pool.num_in_use == 0 and not engine.has_unfinished_requests())
        figures = client.stats.snapshot()
        assert (figures["requests_finished"], figures["requests_closed"]) == (2, 2)
        assert figures["requests_failed"] == 0
        client.close()
    served.close()
