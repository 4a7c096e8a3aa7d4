"""The monitor: real process columns on this machine, NaN GPU columns with a note, per-column
degradation when NVML or psutil fail, exact energy from a fake NVML, the metrics over a span,
the memory breakdown, and a tiny run that writes samples.parquet."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import psutil
import pytest
from omegaconf import OmegaConf

import configs
from engines.base import now_ns
from harness.measuring import monitors
from harness.measuring.metrics import REGISTRY
from harness.measuring.monitors import (
    SAMPLE_COLUMNS,
    Monitor,
    MonitorConfig,
    _Source,
    gpu_index_for,
    memory_breakdown,
    monitor_metrics,
)
from harness.running.experiment import run_experiment

GPU_COLUMNS = ["gpu_util", "gpu_mem_used_bytes", "gpu_power_w", "gpu_energy_j"]
MONITOR_METRICS = [
    "peak_vram_bytes",
    "gpu_util_mean",
    "energy_j",
    "j_per_output_token",
    "peak_rss_bytes",
    "cpu_util_mean",
]


def busy(seconds: float) -> None:
    """Keep this thread on the CPU (so cpu_util has something to measure)."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def sample_for(monitor: Monitor, seconds: float, gpu_index: int | None) -> pd.DataFrame:
    origin = now_ns()
    monitor.start(gpu_index)
    busy(seconds)
    monitor.stop()
    return monitor.frame(origin)


class FakeNVML:
    """NVML with known readings: 40% busy, a fixed memory, 250 W, and an energy counter that
    grows at exactly `watts` on the monitor's clock."""

    def __init__(self, watts: float = 300.0, fail: dict[str, Exception] | None = None) -> None:
        self.watts = watts
        self.fail = fail or {}
        self.origin_ns = now_ns()
        self.shutdown = 0
        self.energy_readings: list[int] = []

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    def nvmlInit(self) -> None:  # NVML's names
        self._maybe_fail("nvmlInit")

    def nvmlShutdown(self) -> None:
        self.shutdown += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        self._maybe_fail("util")
        return SimpleNamespace(gpu=40, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(used=3 << 30, total=80 << 30, free=77 << 30)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        self._maybe_fail("power")
        return 250_000  # mW

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        self._maybe_fail("energy")
        # mJ since "driver load": a large offset, then watts x seconds on the same clock
        reading = 7_000_000 + round(self.watts * (now_ns() - self.origin_ns) / 1e6)
        self.energy_readings.append(reading)
        return reading


class NVMLError(Exception):
    pass


def test_gpu_index_for_devices() -> None:
    assert gpu_index_for("cpu") is None
    assert gpu_index_for("cuda:1") == 1
    assert gpu_index_for(None) == 0  # a backend without a device (an HTTP server)


def test_cpu_machine_process_columns_real_gpu_columns_nan() -> None:
    monitor = Monitor(interval_s=0.01)
    frame = sample_for(monitor, 0.2, gpu_index=gpu_index_for("cpu"))
    assert list(frame.columns) == SAMPLE_COLUMNS
    assert len(frame) >= 5  # one at start, one at stop, the thread's in between
    assert (frame["rss_bytes"] > 10 << 20).all()  # a Python process with torch loaded
    util = frame["cpu_util"].iloc[1:]
    assert util.notna().all() and np.isnan(frame["cpu_util"].iloc[0])
    # one thread spun the whole time: about one CPU's worth of the machine. psutil's CPU times
    # tick every 10 ms, so one short interval (the stop sample's) can read far above 1; the
    # interval-weighted mean (how cpu_util_mean is computed) is total CPU time / total wall.
    wall = frame["time_s"].diff().iloc[1:]
    weighted = float((util * wall).sum() / wall.sum())
    assert 0.1 / monitor.cpus < weighted <= 1.05
    assert frame[[*GPU_COLUMNS, "torch_cuda_allocated_bytes"]].isna().all().all()
    assert any("not sampled: the engine runs on the CPU" in n for n in monitor.info()["notes"])
    assert frame["time_s"].is_monotonic_increasing


def test_nvml_unavailable_is_a_note_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML(fail={"nvmlInit": NVMLError("NVML Shared Library Not Found")})
    monkeypatch.setattr(monitors, "import_nvml", lambda: fake)
    monitor = Monitor(interval_s=0.01)
    frame = sample_for(monitor, 0.05, gpu_index=0)
    assert frame[GPU_COLUMNS].isna().all().all()
    assert frame["rss_bytes"].notna().all()
    assert any(
        "NVML unavailable: NVMLError: NVML Shared Library Not Found" in n
        for n in monitor.info()["notes"]
    )


def test_missing_gpu_with_failing_shutdown_is_a_note_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class NoSuchGPU(FakeNVML):
        def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
            raise NVMLError("Invalid Argument")

        def nvmlShutdown(self) -> None:
            raise NVMLError("Uninitialized")

    monkeypatch.setattr(monitors, "import_nvml", lambda: NoSuchGPU())
    monitor = Monitor(interval_s=0.01)
    frame = sample_for(monitor, 0.03, gpu_index=3)
    assert frame[GPU_COLUMNS].isna().all().all() and frame["rss_bytes"].notna().all()
    assert any(
        "NVML has no GPU 3: NVMLError: Invalid Argument" in n for n in monitor.info()["notes"]
    )


def test_fake_nvml_gives_known_columns_and_exact_energy(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML(watts=300.0)
    monkeypatch.setattr(monitors, "import_nvml", lambda: fake)
    monitor = Monitor(interval_s=0.01)
    frame = sample_for(monitor, 0.2, gpu_index=0)
    assert fake.shutdown == 1
    assert (frame["gpu_util"] == 0.4).all()
    assert (frame["gpu_mem_used_bytes"] == 3 << 30).all()
    assert (frame["gpu_power_w"] == 250.0).all()
    # energy since the monitor started: the counter's readings (mJ) less the first one
    readings = np.array(fake.energy_readings, dtype=float)
    assert len(readings) == len(frame)
    np.testing.assert_array_equal(frame["gpu_energy_j"], (readings - readings[0]) / 1000)
    # ... which grew at 300 W (a reading lags its time stamp by the reads before it)
    elapsed = frame["time_s"].iloc[-1] - frame["time_s"].iloc[0]
    assert frame["gpu_energy_j"].iloc[-1] / elapsed == pytest.approx(300.0, rel=0.05)

    t, energy = frame["time_s"].to_numpy(), frame["gpu_energy_j"].to_numpy()
    span = (float(t[1]), float(t[-2]))  # on sample times: the counter's own difference
    run_info = {"samples": frame, "monitor": monitor.info(), "engine": {}}
    metrics = monitor_metrics(run_info, {}, span, output_tokens=40)
    assert metrics["energy_j"] == pytest.approx(energy[-2] - energy[1])
    assert metrics["j_per_output_token"] == pytest.approx((energy[-2] - energy[1]) / 40)
    assert metrics["gpu_util_mean"] == pytest.approx(0.4)
    assert metrics["peak_vram_bytes"] == 3 << 30
    assert set(MONITOR_METRICS) <= set(metrics) <= set(REGISTRY)


def test_nvml_reader_failures_degrade_per_column(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML(fail={"energy": NVMLError("Not Supported"), "util": NVMLError("GPU lost")})
    monkeypatch.setattr(monitors, "import_nvml", lambda: fake)
    monitor = Monitor(interval_s=0.01)
    frame = sample_for(monitor, 0.1, gpu_index=0)
    assert frame["gpu_util"].isna().all() and frame["gpu_energy_j"].isna().all()
    assert (frame["gpu_power_w"] == 250.0).all() and frame["rss_bytes"].notna().all()
    notes = " | ".join(monitor.info()["notes"])
    assert "gpu_energy_j: not sampled: NVMLError: Not Supported" in notes
    assert "gpu_util: not sampled: NVMLError: GPU lost" in notes
    # without the counter, energy is power integrated over the span
    t = frame["time_s"]
    span = (float(t.iloc[1]), float(t.iloc[-1]))
    metrics = monitor_metrics({"samples": frame, "monitor": monitor.info()}, {}, span, 10)
    assert metrics["energy_j"] == pytest.approx(250.0 * (span[1] - span[0]))
    assert "gpu_util_mean" not in metrics  # absent, not 0


def test_a_reader_that_fails_mid_run_keeps_its_earlier_samples() -> None:
    monitor = Monitor(interval_s=0.01)
    calls = {"n": 0}

    def flaky() -> dict[str, float]:
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("device went away")
        return {"gpu_power_w": 100.0}

    monitor._readers.append(_Source(("gpu_power_w",), flaky))
    frame = sample_for(monitor, 0.15, gpu_index=None)
    power = frame["gpu_power_w"]
    assert power.iloc[:3].eq(100.0).all() and power.iloc[3:].isna().all()
    assert calls["n"] == 4  # dropped after the failure, not retried every sample
    assert any(
        "gpu_power_w: stopped after 3 samples: RuntimeError: device went away" in n
        for n in monitor.info()["notes"]
    )


class DeniedProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def memory_info(self) -> Any:
        raise psutil.AccessDenied(self.pid)

    def cpu_times(self) -> Any:
        raise NotImplementedError("cpu_times is not supported on this platform")


def test_psutil_failures_degrade_per_column(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(monitors, "import_psutil", lambda: SimpleNamespace(Process=DeniedProcess))
    monitor = Monitor(interval_s=0.01)
    monitor.mark_before_load()
    frame = sample_for(monitor, 0.05, gpu_index=None)
    assert len(frame) >= 2
    assert frame[["rss_bytes", "cpu_util"]].isna().all().all()
    notes = " | ".join(monitor.info()["notes"])
    assert "rss_bytes: not sampled: AccessDenied" in notes
    assert "cpu_util: not sampled: NotImplementedError: cpu_times is not supported" in notes
    metrics = monitor_metrics(
        {"samples": frame, "monitor": monitor.info()}, {}, (0.0, float(frame["time_s"].max())), 10
    )
    assert not set(MONITOR_METRICS) & set(metrics)  # nothing measured, nothing reported


def test_psutil_missing_entirely(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_psutil() -> Any:
        raise ImportError("No module named 'psutil'")

    monkeypatch.setattr(monitors, "import_psutil", no_psutil)
    monitor = Monitor(interval_s=0.01)
    frame = sample_for(monitor, 0.03, gpu_index=None)
    assert frame["rss_bytes"].isna().all()
    assert any("psutil unavailable: ImportError" in n for n in monitor.info()["notes"])


def handmade_samples(**columns: list[float]) -> pd.DataFrame:
    frame = pd.DataFrame({"time_s": [0.0, 1.0, 2.0, 3.0]})
    for name in SAMPLE_COLUMNS[1:]:
        frame[name] = columns.get(name, [np.nan] * 4)
    return frame


def test_span_metrics_weight_each_interval_by_its_overlap() -> None:
    samples = handmade_samples(
        cpu_util=[np.nan, 0.2, 0.4, 0.6],
        rss_bytes=[100.0, 300.0, 200.0, 900.0],
        gpu_energy_j=[0.0, 10.0, 30.0, 60.0],
    )
    run_info = {"samples": samples, "monitor": {}}
    metrics = monitor_metrics(run_info, {}, (0.5, 2.5), output_tokens=4)
    # intervals (0,1], (1,2], (2,3] overlap the span by 0.5, 1, 0.5
    assert metrics["cpu_util_mean"] == pytest.approx((0.5 * 0.2 + 0.4 + 0.5 * 0.6) / 2)
    # the row at t=3 holds the peak of (2, 3], which overlaps the span
    assert metrics["peak_rss_bytes"] == 900
    assert metrics["energy_j"] == pytest.approx(45.0 - 5.0)  # interpolated counter
    assert metrics["j_per_output_token"] == pytest.approx(10.0)
    # a span the samples do not bracket has no energy, rather than a partial one
    assert "energy_j" not in monitor_metrics(run_info, {}, (0.5, 3.5), 4)
    assert "j_per_output_token" not in monitor_metrics(run_info, {}, (0.5, 2.5), 0)


def test_memory_breakdown_gpu_and_cpu() -> None:
    engine = {"weight_bytes": 1000, "kv_pool_bytes": 5000}
    kv = {"kv_bytes_reserved_peak": 800, "kv_bytes_used_peak": 300}
    gpu = handmade_samples(torch_cuda_allocated_bytes=[6000.0, 6500.0, 6100.0, 6000.0])
    out = memory_breakdown(gpu, {}, engine, kv)
    assert out == {
        "memory_weights_bytes": 1000,
        "memory_packed_weights_bytes": None,
        "memory_kv_pool_bytes": 5000,
        "memory_kv_reserved_bytes": 800,
        "memory_kv_used_bytes": 300,
        "memory_peak_bytes": 6500,
        "memory_other_bytes": 500,
    }
    cpu = handmade_samples(rss_bytes=[10_000.0, 10_900.0, 10_500.0, 10_400.0])
    out = memory_breakdown(cpu, {"rss_after_load_bytes": 10_000}, engine, kv)
    # growth 900 above the post-load RSS: 300 of KV in use, 600 other
    assert out["memory_other_bytes"] == 600 and out["memory_peak_bytes"] == 1000 + 900
    shrunk = handmade_samples(rss_bytes=[10_000.0, 10_100.0, 9_000.0, 9_000.0])
    out = memory_breakdown(shrunk, {"rss_after_load_bytes": 10_000}, engine, kv)
    assert "memory_other_bytes" not in {k for k, v in out.items() if v is not None}
    # packed weight copies (prepack_weights) are a part of their own, resident from load
    packed = {**engine, "packed_weight_bytes": 400}
    out = memory_breakdown(gpu, {}, packed, kv)
    assert out["memory_packed_weights_bytes"] == 400 and out["memory_other_bytes"] == 100
    out = memory_breakdown(cpu, {"rss_after_load_bytes": 10_000}, packed, kv)
    assert out["memory_other_bytes"] == 600 and out["memory_peak_bytes"] == 1000 + 400 + 900
    # kv_cache_prefault mapped the whole pool at load: resident throughout, none of the growth
    prefaulted = {**packed, "kv_cache_prefault": True}
    out = memory_breakdown(cpu, {"rss_after_load_bytes": 10_000}, prefaulted, kv)
    assert out["memory_other_bytes"] == 900
    assert out["memory_peak_bytes"] == 1000 + 400 + 5000 + 900


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"interval_s": 0}, "run.monitor.interval_s"),
        ({"interval_s": "fast"}, "run.monitor.interval_s"),
        ({"enabled": "yes"}, "run.monitor.enabled"),
        ({"rate": 10}, "run.monitor: unknown key(s) ['rate']"),
        ({"server_metrics": "on"}, "run.monitor.server_metrics"),
        ({"server_interval_s": 0.001}, "run.monitor.server_interval_s"),
        ({"dcgm_url": "localhost:9400"}, "run.monitor.dcgm_url"),
        ({"dcgm_gpu": -1}, "run.monitor.dcgm_gpu"),
    ],
)
def test_monitor_config_errors_name_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match="allowed") as info:
        MonitorConfig.from_dict(values)
    assert field in str(info.value)


def tiny_config(*overrides: str) -> dict[str, Any]:
    cfg = configs.compose(
        [
            "model=tiny",
            "workload.num_requests=4",
            "workload.input_len=[8,24]",
            "workload.output_len=[3,12]",
            "run.warmup_requests=1",
            "run.progress=false",
            "engine.kv_cache_memory_bytes=4000000",
            "engine.device=cpu",
            "hardware=h100",
            "run.monitor.interval_s=0.01",
            *overrides,
        ]
    )
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    return config


def test_tiny_run_writes_samples_and_metrics(tmp_path: Path) -> None:
    summary = run_experiment(tiny_config(), tmp_path, progress=False)
    assert summary["status"] == "complete", summary["error"]
    samples = pd.read_parquet(tmp_path / "samples.parquet")
    assert list(samples.columns) == SAMPLE_COLUMNS and len(samples) >= 2
    requests = pd.read_parquet(tmp_path / "requests.parquet")
    # the run's clock: the samples bracket the measured requests
    assert samples["time_s"].min() <= requests["arrival_s"].min()
    assert samples["time_s"].max() >= requests["last_token_s"].max()
    assert (samples["rss_bytes"] > 0).all()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["monitor"]["num_samples"] == len(samples)
    assert any("GPU" in n or "gpu" in n for n in on_disk["monitor"]["notes"])
    for metrics in (on_disk["metrics"], on_disk["metrics_whole_run"]):
        # a peak over the window (or the run) is one of the sampled values; memory freed
        # after the first sample can leave the window's peak below that sample
        assert samples["rss_bytes"].min() <= metrics["peak_rss_bytes"] <= samples["rss_bytes"].max()
        # process CPU time ticks in 10 ms steps: a window of a few tens of ms can see none
        # (a clean-clone CI run did), or one tick more than it used (1.25 seen in another);
        # the CPU column is checked positive below
        shortest_s = float(samples["time_s"].diff().dropna().min())
        tick_over = 0.01 / (shortest_s * on_disk["monitor"]["cpus"])
        assert 0 <= metrics["cpu_util_mean"] <= 1.05 + tick_over
        assert metrics["memory_weights_bytes"] == on_disk["engine"]["weight_bytes"]
        assert metrics["memory_packed_weights_bytes"] == on_disk["engine"]["packed_weight_bytes"]
        assert metrics["memory_kv_used_bytes"] == metrics["kv_bytes_used_peak"]
        assert metrics["memory_kv_reserved_bytes"] == metrics["kv_bytes_reserved_peak"]
        assert metrics["memory_kv_pool_bytes"] == on_disk["engine"]["kv_pool_bytes"]
        # no GPU here: those metrics are missing, not zero
        assert not {"peak_vram_bytes", "gpu_util_mean", "energy_j", "j_per_output_token"} & set(
            metrics
        )
    # this run's requests last a few ms, under one 10 ms tick, so even the whole run's mean
    # can be 0 (a clean-clone CI run saw it); loading the model before t0 takes ~100 ms
    assert samples["cpu_util"].max() > 0


def test_monitor_disabled_writes_no_samples(tmp_path: Path) -> None:
    summary = run_experiment(tiny_config("run.monitor.enabled=false"), tmp_path, progress=False)
    assert summary["status"] == "complete"
    assert not (tmp_path / "samples.parquet").exists()
    assert "peak_rss_bytes" not in summary["metrics"] and "monitor" not in summary


def test_failed_run_still_writes_samples(tmp_path: Path) -> None:
    # fails after the model loaded and the monitor started: the finally block stops it
    summary = run_experiment(tiny_config("workload.type=bogus"), tmp_path, progress=False)
    assert summary["status"] == "failed"
    samples = pd.read_parquet(tmp_path / "samples.parquet")
    assert len(samples) >= 2 and samples["rss_bytes"].notna().all()
    assert not any(t.name == "inferlab-monitor" for t in threading.enumerate())


def test_bad_monitor_config_fails_the_run_naming_the_field(tmp_path: Path) -> None:
    summary = run_experiment(tiny_config("run.monitor.interval_s=-1"), tmp_path, progress=False)
    assert summary["status"] == "failed"
    assert "run.monitor.interval_s" in summary["error"]
