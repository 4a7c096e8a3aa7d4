"""profile=true: torch.profiler over a window of engine steps, a Chrome trace, and per-phase
top-operator tables with real operator names; short runs and bad options are handled."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from omegaconf import OmegaConf

import configs
from engines.builtin import LLM
from engines.sampling_params import SamplingParams
from harness.measuring.profiling import (
    OPS_COLUMNS,
    UNTRACED,
    ProfileConfig,
    StepProfiler,
    profiler_from_config,
    step_phase,
)
from harness.measuring.server_profile import ServerProfiler
from harness.running.experiment import run_experiment

pytestmark = pytest.mark.serial  # asserts timings: run alone (Makefile's `test`)

# torch's GEMMs, and the engine's own (fp32 on CPU with its C kernels)
MATMULS = {
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "aten::matmul",
    "aten::bmm",
    "inferlab::linear_f32",
}


def trace_names(path: Path) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {str(e.get("name")) for e in json.load(f)["traceEvents"]}


def test_step_phase() -> None:
    assert step_phase(2, 0) == "prefill"
    assert step_phase(0, 3) == "decode"
    assert step_phase(1, 3) == "mixed"


def test_engine_steps_are_attributed_to_their_phase(
    make_tiny: Callable[..., LLM], tmp_path: Path
) -> None:
    engine = make_tiny().engine
    profiler = StepProfiler(
        ProfileConfig(start_step=0, num_steps=50, top_k=50), tmp_path / "profile"
    )
    profiler.attach(engine.step_observers)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def run_until_idle() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    engine.add_request("a", list(range(3, 15)), params)
    engine.step()  # a's prefill: the profiler's warm-up step, not recorded
    engine.step()  # a decodes
    engine.add_request("b", list(range(20, 30)), params)
    engine.step()  # a decodes while b prefills: mixed
    run_until_idle()
    engine.add_request("c", list(range(40, 49)), params)
    engine.add_request("d", list(range(50, 60)), params)
    engine.step()  # c and d prefill together
    run_until_idle()
    info = profiler.finish()

    phases = [phase for _, phase in profiler.recorded]
    assert phases[:3] == ["decode", "mixed", "decode"] and "prefill" in phases
    assert info["phase_steps"] == {p: phases.count(p) for p in ("prefill", "decode", "mixed")}
    assert info["steps"] == [step for step, _ in profiler.recorded]

    out = tmp_path / "profile"
    names = trace_names(out / "trace.json.gz")
    assert {"step:prefill", "step:decode", "step:mixed"} <= names
    ops = pd.read_csv(out / "ops.csv")
    assert list(ops.columns) == OPS_COLUMNS
    for phase in ("prefill", "decode", "mixed"):
        rows = ops[ops["phase"] == phase]
        assert MATMULS & set(rows["name"]), phase  # real operators, in every phase
        if engine.describe()["prepacked_layout"] == "panels":  # fp32 CPU with the C kernels
            assert "inferlab::linear_f32" in set(rows["name"]), phase
        assert UNTRACED in set(rows["name"])
        assert (rows["self_cpu_s"] >= 0).all() and rows["self_cpu_share"].sum() <= 1 + 1e-9
        assert (rows["phase_steps"] == phases.count(phase)).all()
        if phase == "decode" and engine.describe()["native_decode_program"]:
            # a decode step's layers: one call into the C kernels (the decode program)
            assert "inferlab::decode_layers_f32" in set(rows["name"])
        # every profiled step runs the same layers: one call per step at least
        per_step = MATMULS | {"inferlab::linear_f32", "inferlab::decode_layers_f32"}
        assert rows[rows["name"].isin(per_step)]["calls"].max() >= phases.count(phase)
    markdown = (out / "ops.md").read_text()
    for phase in ("prefill", "decode", "mixed"):
        assert f"## {phase} ({phases.count(phase)} steps)" in markdown
    assert engine.step_observers == []  # finish unsubscribes


def test_steps_are_annotated_under_any_profiler(make_tiny: Callable[..., LLM]) -> None:
    from torch.profiler import ProfilerActivity, profile

    llm = make_tiny()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([list(range(3, 10))], params)
    assert {"step:prefill", "step:decode"} <= {e.name for e in prof.events()}


def tiny_config(*overrides: str) -> dict[str, Any]:
    cfg = configs.compose(
        [
            "model=tiny",
            "workload.num_requests=4",
            "workload.input_len=[8,24]",
            "workload.output_len=8",
            "run.warmup_requests=1",
            "run.progress=false",
            "engine.kv_cache_memory_bytes=4000000",
            "engine.max_num_seqs=2",
            "engine.device=cpu",
            "hardware=h100",
            "profile=true",
            *overrides,
        ]
    )
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    return config


def test_profile_true_on_a_tiny_run(tmp_path: Path) -> None:
    summary = run_experiment(
        tiny_config("profiling.start_step=1", "profiling.num_steps=6"), tmp_path, progress=False
    )
    assert summary["status"] == "complete", summary["error"]
    info = summary["profile"]
    assert len(info["steps"]) == 6 and sum(info["phase_steps"].values()) == 6
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    # the window counts measured-run steps: skip 1, warm up on 1, record the next 6
    assert info["steps"] == steps["step"].iloc[2:8].tolist()
    out = tmp_path / "profile"
    assert any(name.startswith("step:") for name in trace_names(out / "trace.json.gz"))
    ops = pd.read_csv(out / "ops.csv")
    assert MATMULS & set(ops["name"])
    assert set(ops["phase"]) <= {"prefill", "decode", "mixed", "outside_step"}
    assert (out / "ops.md").read_text().startswith("# Top operators per phase")


def test_run_shorter_than_the_window_says_so(tmp_path: Path) -> None:
    summary = run_experiment(tiny_config("profiling.start_step=1000"), tmp_path, progress=False)
    assert summary["status"] == "complete"
    assert "no step profiled" in summary["profile"]["note"]
    assert not (tmp_path / "profile" / "trace.json.gz").exists()


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"profile": "yes"}, "profile: 'yes' is invalid"),
        ({"profile": True, "profiling": {"num_steps": 0}}, "profiling.num_steps"),
        ({"profile": True, "profiling": {"start_step": -1}}, "profiling.start_step"),
        ({"profile": True, "profiling": {"record_shapes": "no"}}, "profiling.record_shapes"),
        ({"profile": True, "profiling": {"steps": 3}}, "profiling: unknown key(s) ['steps']"),
    ],
)
def test_profile_config_errors_name_the_field(
    config: dict[str, Any], field: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="allowed") as info:
        profiler_from_config(config, tmp_path)
    assert field in str(info.value)


def test_profile_off_is_none(tmp_path: Path) -> None:
    assert profiler_from_config({"profile": False}, tmp_path) is None
    assert profiler_from_config({}, tmp_path) is None


class _ProfilerEndpoints(BaseHTTPRequestHandler):
    """/trickle/start_profile: an answer sent a byte every 0.1 s (each read well inside any
    read timeout); /big/start_profile: a 1 MB answer; else a short JSON answer."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = b"x" * 1_000_000 if self.path.startswith("/big") else b'{"status":"ok"}'
        trickle = self.path.startswith("/trickle")
        self.send_response(200)
        self.send_header("Content-Length", str(10**6 if trickle else len(body)))
        self.end_headers()
        if not trickle:
            self.wfile.write(body)
            return
        for _ in range(300):
            try:
                self.wfile.write(b"x")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.1)


def test_a_server_profiler_answering_slowly_does_not_hold_the_run() -> None:
    """httpx's timeout bounds each read, not the POST: a /start_profile answer trickling in
    held the run before its first measured request for as long as the server went on."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ProfilerEndpoints)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        slow = ServerProfiler(f"{root}/trickle", timeout_s=0.5)
        began = time.monotonic()
        slow.attach([])
        assert time.monotonic() - began < 2.0
        assert not slow.started
        assert slow.info["error"].startswith("the server did not start profiling: ReadTimeout")
        big = ServerProfiler(f"{root}/big", timeout_s=5.0)
        big.attach([])
        assert big.started and len(big.info["start_profile"]) == len("HTTP 200: ") + 2000
        fine = ServerProfiler(root, timeout_s=5.0)
        fine.attach([])
        assert fine.finish()["stop_profile"] == 'HTTP 200: {"status":"ok"}'
    finally:
        server.shutdown()
        server.server_close()
