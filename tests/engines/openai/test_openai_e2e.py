"""engine=openai end to end: `inferlab serve model=tiny` on a loopback port, a small harness
workload through run_experiment, and every output checked against the built-in engine's own
greedy output for the same prompts."""

from __future__ import annotations

import asyncio
import os
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
import engines.backends  # noqa: F401  (the engine groups' schemas, for compose)
from engines.backends import build_backend
from engines.base import Finished, Tokens
from engines.builtin.backend import BuiltinBackend
from engines.builtin.llm import LLM
from engines.openai.backend import OpenAIBackend
from engines.sampling_params import SamplingParams
from harness.running.experiment import run_experiment
from harness.running.run_config import make_workload

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[3]
ENGINE = [
    "model=tiny",
    "engine.device=cpu",
    "engine.dtype=float32",
    "engine.num_threads=1",
    "engine.max_model_len=256",
]
NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN = 4, 16, 8


def composed(*overrides: str) -> dict[str, Any]:
    cfg = configs.compose(overrides)
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    return config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """`inferlab serve` in its own process; yields its base URL (…/v1)."""
    yield from serving(ENGINE)


def serving(engine: list[str]) -> Iterator[str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "harness.cli",
        "serve",
        *engine,
        "host=127.0.0.1",
        f"port={port}",
        "log_level=warning",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"inferlab serve exited: {process.stdout.read()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("inferlab serve did not become healthy in 180 s")
            time.sleep(0.25)
        yield f"{base}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def server_returns_token_ids(base_url: str) -> bool:
    """Does the server take vLLM's `return_token_ids`? (Its OpenAI API may refuse the field.)"""
    body = {"model": "tiny", "prompt": [10, 11, 12], "max_tokens": 1, "return_token_ids": True}
    response = httpx.post(f"{base_url}/completions", json=body, timeout=60)
    return response.status_code == 200 and "token_ids" in response.json()["choices"][0]


def run_config(base_url: str, token_ids: bool) -> dict[str, Any]:
    return composed(
        "engine=openai",
        "model=tiny",
        f"engine.base_url={base_url}",
        "engine.server=vllm",
        f"engine.request_token_ids={str(token_ids).lower()}",
        f"workload.num_requests={NUM_REQUESTS}",
        f"workload.input_len={INPUT_LEN}",
        f"workload.output_len={OUTPUT_LEN}",
        "workload.arrival.process=closed",
        "workload.arrival.concurrency=1",
        "run.warmup_requests=1",
        "run.progress=false",
    )


def reference_outputs(prompts: list[list[int]]) -> list[Any]:
    """The built-in engine, configured as the server is, one greedy request at a time (the
    harness sends one at a time too, so both run the same batch-1 numerics)."""
    config = composed(*ENGINE)
    backend = build_backend(config["engine"], config["model"])
    assert isinstance(backend, BuiltinBackend)
    backend.load()
    try:
        assert backend.engine is not None
        llm = LLM.from_engine(backend.engine)
        params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
        return [llm.generate([prompt], params)[0] for prompt in prompts]
    finally:
        backend.close()


@pytest.mark.parametrize("with_ids", [True, False], ids=["server-ids", "counted"])
def test_harness_workload_through_inferlab_serve_matches_the_engine(
    server: str, tmp_path: Path, with_ids: bool
) -> None:
    # inferlab serve speaks vLLM's return_token_ids (docs/backends.md): both paths are tested,
    # never chosen by probing (a probe would quietly drop the id check if the server broke it)
    assert server_returns_token_ids(server)
    config = run_config(server, with_ids)
    summary = run_experiment(config, tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary.get("error")
    metrics = summary["metrics_whole_run"]
    assert (metrics["num_completed"], metrics["num_failed"]) == (NUM_REQUESTS, 0)
    engine = summary["engine"]
    assert engine["backend"] == "openai" and engine["served_model"] == "tiny"
    assert engine["max_model_len"] == 256  # from GET /v1/models
    # inferlab serve says who it is (owned_by) and speaks vLLM's dialect
    assert (engine["server"], engine["server_detected"]) == ("vllm", "vllm")
    assert engine["server_detection"].endswith("/v1/models: owned_by='inferlab'")

    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    tokens = pd.read_parquet(tmp_path / "run" / "tokens.parquet")
    assert (requests["status"] == "ok").all()
    assert (requests["output_tokens_requested"] == OUTPUT_LEN).all()
    # actual = requested, token by token: from the server's ids, or (without them) from the
    # one-chunk-per-token rule that agrees with the server's usage count
    assert (requests["output_tokens"] == OUTPUT_LEN).all()
    assert len(tokens) == NUM_REQUESTS * OUTPUT_LEN
    assert (requests["finish_reason"] == "length").all()
    assert (requests["prompt_tokens"] == INPUT_LEN).all()  # the server's usage
    assert (requests["first_token_s"] > requests["sent_s"]).all()
    server_side_view_is_the_measured_requests(tmp_path / "run", summary, requests)
    client = engine["client"]
    assert client["requests_finished"] == NUM_REQUESTS  # the warm-up request left out
    assert client["requests_with_usage"] == NUM_REQUESTS
    assert client["output_tokens_usage"] == NUM_REQUESTS * OUTPUT_LEN  # exact, from usage
    assert client["requests_usage_count_mismatch"] == 0
    assert client["client_overhead_per_chunk_mean_us"] > 0
    # without ids, inferlab serve's one-chunk-per-token stream is counted exactly by the
    # first rule (docs/backends.md)
    assert client["requests_by_count_rule"] == {"server" if with_ids else "chunk": NUM_REQUESTS}

    # the same workload, the same prompts: what the built-in engine answers greedily
    workload = make_workload(config["workload"])
    backend = build_backend(config["engine"], config["model"])
    assert isinstance(backend, OpenAIBackend)
    backend.load()
    items = workload.build(backend.tokenizer, engine["max_model_len"])
    prompts = [item.request.prompt for item in items]
    expected = reference_outputs(prompts)

    if with_ids:  # the server's ids, as recorded in tokens.parquet
        for item, reference in zip(items, expected, strict=True):
            ids = tokens[tokens["request_id"] == item.request_id].sort_values("index")
            assert list(ids["token_id"]) == reference.token_ids

    # the text, streamed chunk by chunk, is the engine's text
    async def collect_text() -> list[str]:
        texts = []
        for item in items:
            events = [e async for e in backend.generate(item.request)]
            [finished] = [e for e in events if isinstance(e, Finished)]
            assert finished.num_output_tokens == OUTPUT_LEN
            assert "".join(e.text for e in events if isinstance(e, Tokens)) == finished.text
            texts.append(finished.text)
        return texts

    texts = asyncio.run(collect_text())
    backend.close()
    assert texts == [reference.text for reference in expected]


def server_side_view_is_the_measured_requests(
    run: Path, summary: dict[str, Any], requests: pd.DataFrame
) -> None:
    """The server's /metrics, scraped around the measured requests: its counters count
    exactly them (the warm-up request left out), its TTFT sits inside the client's."""
    assert summary["monitor"]["server"]["server"] == "inferlab"
    metrics = summary["metrics_whole_run"]
    assert metrics["server_requests_finished"] == NUM_REQUESTS
    assert metrics["server_generation_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert metrics["server_prompt_tokens"] == NUM_REQUESTS * INPUT_LEN
    from_send = (requests["first_token_s"] - requests["sent_s"]).mean()
    assert 0 < metrics["server_ttft_mean_s"] < from_send
    assert metrics["ttft_outside_server_mean_s"] == pytest.approx(
        from_send - metrics["server_ttft_mean_s"]
    )
    assert metrics["server_e2e_mean_s"] > metrics["server_ttft_mean_s"]
    assert 0 <= metrics["server_num_requests_running_peak"] <= 1  # one request at a time
    samples = pd.read_parquet(run / "samples.parquet")
    # counters since the first scrape, which came before the warm-up request
    assert samples["server_generation_tokens"].max() == (NUM_REQUESTS + 1) * OUTPUT_LEN
    series = pd.read_parquet(run / "server_metrics.parquet")
    assert list(series.columns) == ["time_s", "name", "labels", "value"]
    assert "inferlab_generation_tokens_total" in set(series["name"])


def test_profile_against_a_server_that_does_not_profile_keeps_the_run(
    server: str, tmp_path: Path
) -> None:
    config = composed(
        "engine=openai",
        "model=tiny",
        f"engine.base_url={server}",
        "workload.num_requests=2",
        "workload.output_len=4",
        "run.warmup_requests=0",
        "run.progress=false",
        "profile=true",
    )
    summary = run_experiment(config, tmp_path, progress=False)
    assert summary["status"] == "complete", summary.get("error")
    profile = summary["profile"]
    assert profile["server"] == server.removesuffix("/v1")
    assert profile["error"].startswith("the server did not start profiling: HTTP 4")
    assert not (tmp_path / "profile").exists()  # the client's process was not profiled


def test_profile_calls_the_servers_profiler_around_the_measured_requests(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    for base_url in serving([*ENGINE, f"profile_dir={traces}"]):
        config = composed(
            "engine=openai",
            "model=tiny",
            f"engine.base_url={base_url}",
            "workload.num_requests=2",
            "workload.output_len=4",
            "run.warmup_requests=1",
            "run.progress=false",
            "profile=true",
        )
        summary = run_experiment(config, tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary.get("error")
    profile = summary["profile"]
    assert "error" not in profile, profile
    assert profile["start_profile"].startswith("HTTP 200")
    # the server says where it wrote the trace, on its side
    [trace] = list(traces.iterdir())
    assert profile["stop_profile"].startswith("HTTP 200") and str(trace) in profile["stop_profile"]
    assert trace.stat().st_size > 0


SPECULATIVE = [
    *ENGINE,
    "engine.speculative_config={method:ngram,num_speculative_tokens:3,prompt_lookup_min:1}",
]


def test_the_servers_speculative_counters_sit_beside_its_latency(tmp_path: Path) -> None:
    """inferlab serve with n-gram speculation exports vLLM's spec_decode counters (inferlab_
    prefix); engine=openai reads them before and after the measured requests, so the run's
    acceptance is the server's own, warm-up left out: equal to what the built-in engine
    counts for the same greedy workload in process."""
    workload = [
        "workload.num_requests=4",
        "workload.input_len=24",
        "workload.output_len=24",
        "workload.arrival.process=closed",
        "workload.arrival.concurrency=1",
        "run.warmup_requests=1",
        "run.progress=false",
    ]
    in_process = run_experiment(composed(*SPECULATIVE, *workload), tmp_path / "builtin")
    assert in_process["status"] == "complete", in_process.get("error")
    expected = in_process["metrics_whole_run"]
    assert expected["spec_acceptance_rate"] > 0
    for base_url in serving(SPECULATIVE):
        config = composed("engine=openai", "model=tiny", f"engine.base_url={base_url}", *workload)
        summary = run_experiment(config, tmp_path / "openai", progress=False)
    assert summary["status"] == "complete", summary.get("error")
    counts = summary["engine"]["server_spec_decode"]
    assert counts["server"] == "inferlab"
    requests = pd.read_parquet(tmp_path / "builtin" / "requests.parquet")
    assert counts["num_draft_tokens"] == requests["spec_draft_tokens"].sum()
    assert counts["num_accepted_tokens"] == requests["spec_accepted_tokens"].sum()
    # per request the client cannot know: null, not 0 (the server drafted)
    through_server = pd.read_parquet(tmp_path / "openai" / "requests.parquet")
    assert through_server[["spec_steps", "spec_draft_tokens"]].isna().all().all()
    metrics = summary["metrics_whole_run"]
    for name in ("spec_acceptance_rate", "spec_mean_accepted_length", "spec_acceptance_rate_pos1"):
        assert metrics[name] == pytest.approx(expected[name]), name
