"""vLLM's profiler endpoints on `inferlab serve`: with `profile_dir`, POST /start_profile and
/stop_profile run torch.profiler on the engine thread and write a Chrome trace holding the
engine's steps and model operators; a double start, a stop without a start and a server
without `profile_dir` get clear errors; a shutdown while profiling writes the trace. A real
uvicorn server on loopback, model=tiny."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from engines.builtin import EngineConfig
from engines.builtin.backend import BuiltinBackend
from serving import ServerConfig
from serving.config import ServerConfigError
from serving.testing import serve_in_thread

OPTIONS: dict[str, Any] = dict(
    dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4, kv_cache="paged"
)
# torch's GEMMs, and the engine's own (fp32 on CPU with its C kernels)
MATMULS = {
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "aten::matmul",
    "aten::bmm",
    "inferlab::linear_f32",
    "inferlab::decode_layers_f32",
}


@pytest.fixture(scope="module")
def backend() -> Iterator[BuiltinBackend]:
    """One loaded engine for the module; each test serves it anew (the server leaves the
    backend, and its engine thread, open)."""
    loaded = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **OPTIONS}))
    loaded.load()
    yield loaded
    loaded.close()


def trace_names(path: Path) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {str(e.get("name")) for e in json.load(f)["traceEvents"]}


def generate(client: httpx.Client, prompt: str = "Once upon a time") -> None:
    payload = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    assert client.post("/v1/completions", json=payload).status_code == 200


def assert_error(response: httpx.Response, status: int, code: str, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert all(word in error["message"] for word in words), error["message"]


def test_start_requests_stop_writes_a_trace_of_the_engines_work(
    backend: BuiltinBackend, tmp_path: Path
) -> None:
    out = tmp_path / "profiles"  # created when profiling starts
    with (
        serve_in_thread(backend, ServerConfig(profile_dir=str(out))) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as client,
    ):
        assert_error(client.post("/stop_profile"), 409, "profiler_not_running", "/start_profile")
        # vllm bench posts a completion-shaped body to the endpoints: ignored
        started = client.post("/start_profile", json={"model": "tiny", "prompt": "x"})
        assert started.status_code == 200, started.text
        assert started.json()["status"] == "profiling"
        assert_error(client.post("/start_profile"), 409, "profiler_already_running", "stop")
        for prompt in ("Hello there", "A long time ago", "Once upon a time"):
            generate(client, prompt)
        stopped = client.post("/stop_profile")
        assert stopped.status_code == 200, stopped.text
        body = stopped.json()
        assert body["status"] == "stopped" and body["trace"] == started.json()["trace"]
        assert body["engine_steps"] >= 3 * 4  # each request: a prefill and three decodes
        assert body["seconds"] > 0
        assert_error(client.post("/stop_profile"), 409, "profiler_not_running")

        # a second session: a file of its own
        assert client.post("/start_profile").status_code == 200
        generate(client)
        second = client.post("/stop_profile").json()["trace"]
        assert client.get("/health").status_code == 200  # serving throughout

    trace = Path(body["trace"])
    assert trace.parent == out and trace.name.endswith(".json.gz")
    assert sorted(out.iterdir()) == sorted([trace, Path(second)])
    names = trace_names(trace)
    # the engine thread's work: its steps (named while a profiler runs on that thread) and the
    # model's operators inside them
    assert {"step:prefill", "step:decode"} <= names
    assert names & MATMULS, sorted(names)[:50]


def test_shutdown_while_profiling_writes_the_trace(
    backend: BuiltinBackend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        serve_in_thread(backend, ServerConfig(profile_dir=str(tmp_path))) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as client,
    ):
        trace = Path(client.post("/start_profile").json()["trace"])
        generate(client)
        assert not trace.exists()  # written at the stop; here, the shutdown
    assert trace.exists()
    assert "step:decode" in trace_names(trace)
    assert any("shutting down while profiling: trace written" in r.message for r in caplog.records)
    # the engine thread runs no profiler any more: a new server can profile it again
    with (
        serve_in_thread(backend, ServerConfig(profile_dir=str(tmp_path))) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as client,
    ):
        assert client.post("/start_profile").status_code == 200
        assert client.post("/stop_profile").status_code == 200


def test_without_profile_dir_the_endpoints_say_how_to_enable_them(
    backend: BuiltinBackend,
) -> None:
    with (
        serve_in_thread(backend, ServerConfig()) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as client,
    ):
        for path in ("/start_profile", "/stop_profile"):
            assert_error(
                client.post(path), 404, "profiler_not_enabled", "profile_dir=", "VLLM_TORCH"
            )
        assert client.get("/start_profile").status_code == 405  # POST only, as vLLM's


def test_the_api_key_guards_the_profiler(backend: BuiltinBackend, tmp_path: Path) -> None:
    config = ServerConfig(profile_dir=str(tmp_path), api_key="secret")
    with (
        serve_in_thread(backend, config) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as client,
    ):
        assert_error(client.post("/start_profile"), 401, "invalid_api_key")
        headers = {"Authorization": "Bearer secret"}
        assert client.post("/start_profile", headers=headers).status_code == 200
        assert client.post("/stop_profile", headers=headers).status_code == 200


def test_profile_dir_must_be_a_folder(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ServerConfigError, match=r"profile_dir: .* is invalid; allowed: null or a"):
        ServerConfig(profile_dir=str(file))
    with pytest.raises(ServerConfigError, match="profile_dir: '' is invalid"):
        ServerConfig(profile_dir="")
    assert ServerConfig(profile_dir=str(tmp_path / "new")).profile_dir


def test_a_web_page_of_another_origin_cannot_start_the_profiler(
    backend: BuiltinBackend, tmp_path: Path
) -> None:
    """The endpoints take no body, so a page the user opens could POST to a localhost server
    with profile_dir without a CORS preflight, and start (or stop) the profiler."""
    out = tmp_path / "profiles"
    with (
        serve_in_thread(backend, ServerConfig(profile_dir=str(out))) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as client,
    ):
        for endpoint in ("/start_profile", "/stop_profile"):
            refused = client.post(endpoint, headers={"Origin": "https://example.com"})
            assert_error(refused, 403, "cross_origin_refused", "https://example.com")
        assert not out.exists()  # nothing started
        # a page of the server's own origin, and clients that send no Origin, are served
        own = server.base_url.rstrip("/")
        started = client.post("/start_profile", headers={"Origin": own})
        assert started.status_code == 200, started.text
        assert client.post("/stop_profile").status_code == 200
        # DNS rebinding: a page of evil.example, its name re-pointed at 127.0.0.1, has the
        # origin of the Host it sends; it started the profiler (200)
        port = urlsplit(own).port
        rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
        refused = client.post("/start_profile", headers=rebound)
        assert_error(refused, 403, "cross_origin_refused", "http://evil.example")
        localhost = {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}
        assert client.post("/start_profile", headers=localhost).status_code == 200
        assert client.post("/stop_profile").status_code == 200
