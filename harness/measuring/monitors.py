"""Background sampling of the process and the GPU during a run, and the metrics computed from
the samples: `samples.parquet`, peak memory, utilization, energy, the memory breakdown.

A daemon thread reads every `interval_s`: process RSS and CPU time (psutil); GPU utilization,
memory in use, power and the total-energy counter (NVML, `nvidia-ml-py`); torch's CUDA
allocator peaks (reset after each read, so every row holds the peak of its own interval).
Each source that is missing or raises (no GPU, no NVML, AccessDenied, NotImplementedError)
leaves its columns NaN and a note in summary.json; nothing here crashes a run.
Definitions: docs/monitoring.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd

from engines.base import Backend, now_ns
from engines.options import option
from harness.config_section import ConfigSection
from harness.measuring.server_scrape import (
    SCRAPE_INDEX,
    SERVER_COLUMNS,
    DcgmScrape,
    ServerScrape,
    server_figures,
)
from harness.measuring.trackers import Tracker
from harness.run_folder import SAMPLES_FILE, SERVER_METRICS_FILE, write_parquet_atomic

#: 20 Hz: NVML refreshes utilization and power over windows of about 1/6 s to 1 s, so faster
#: sampling adds little; slower sampling misses RSS and allocator peaks of short runs. A sample
#: costs tens of microseconds of mostly GIL-free calls (<0.1% of one core at this rate).
DEFAULT_INTERVAL_S = 0.05
#: A server's page is tens of kB (vLLM: ~1,500 samples), kept for parsing after the run: once
#: a second bounds that work and the memory, plus a scrape at the measured run's start and end.
DEFAULT_SERVER_INTERVAL_S = 1.0

SAMPLE_COLUMNS = [
    "time_s",
    "rss_bytes",
    "cpu_util",
    "gpu_util",
    "gpu_mem_used_bytes",
    "gpu_power_w",
    "gpu_energy_j",
    "torch_cuda_allocated_bytes",
    "torch_cuda_reserved_bytes",
    *SERVER_COLUMNS,
]
# Raw cumulative readings kept per sample and turned into rates / differences in `frame`.
_CPU_SECONDS = "_cpu_seconds"
_ENERGY_MJ = "_gpu_energy_mj"

Reader = Callable[[], dict[str, float]]


@dataclass
class _Source:
    columns: tuple[str, ...]
    read: Reader
    every_ns: int = 0  # 0: every sample; else at most this often, and when forced
    due_ns: int = 0


@dataclass(frozen=True)
class MonitorConfig(ConfigSection):
    section = "run.monitor"

    enabled: bool = option(True, help="the background sampler: memory, CPU and GPU readings")
    interval_s: float = option(
        DEFAULT_INTERVAL_S, ge=0.001, le=60, unit="seconds", help="the sampler's period"
    )
    server_metrics: bool = option(
        True,
        help="engine=openai: scrape the server's /metrics (engine.metrics_url) every "
        "server_interval_s, and at the measured run's start and end; false: never",
    )
    server_interval_s: float = option(
        DEFAULT_SERVER_INTERVAL_S,
        ge=0.05,
        le=3600,
        unit="seconds",
        help="how often a server (and a dcgm-exporter) is scraped",
    )
    dcgm_url: str | None = option(
        None,
        valid=lambda url: url.startswith(("http://", "https://")),
        allowed="null or an http:// or https:// URL of a dcgm-exporter's /metrics",
        help="a remote server's GPU: an NVIDIA dcgm-exporter's /metrics",
    )
    dcgm_gpu: int = option(
        0,
        ge=0,
        allowed="a GPU index >= 0 (the exporter's `gpu` label)",
        help="the GPU's `gpu` label in the exporter's samples",
    )

    def _check_together(self) -> None:
        self._keep_floats("interval_s", "server_interval_s")


def watch_servers(monitor: Monitor, config: MonitorConfig, metrics_url: str | None) -> None:
    """Have `monitor` scrape the backend's server (its /metrics, where the backend names one)
    and a dcgm-exporter, as `config` says."""
    if config.server_metrics and metrics_url:
        monitor.watch_server(ServerScrape(metrics_url), config.server_interval_s)
    if config.dcgm_url:
        monitor.watch_dcgm(DcgmScrape(config.dcgm_url, config.dcgm_gpu), config.server_interval_s)


def import_nvml() -> ModuleType:
    """The NVML bindings (a seam: tests replace it with a fake)."""
    import pynvml

    return pynvml


def import_psutil() -> ModuleType:
    """psutil (a seam: tests replace it with one whose calls raise)."""
    import psutil

    return psutil


def gpu_index_for(device: str | None) -> int | None:
    """The GPU to sample for an engine on `device`: cuda[:N] -> N, cpu -> None; a backend that
    names no device (an HTTP server, probably on this machine) -> GPU 0."""
    if device is None:
        return 0
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        if index:
            return int(index)
        try:
            import torch

            return torch.cuda.current_device() if torch.cuda.is_available() else 0
        except Exception:  # fall back to the first GPU
            return 0
    return None


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Monitor:
    """Samples in a background thread between `start()` and `stop()`."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.gpu_index: int | None = None
        self.notes: list[str] = []
        self.cpus = _cpu_count()
        self.rss_before_load_bytes: int | None = None
        self._readers: list[_Source] = []
        self.server: ServerScrape | None = None
        self.dcgm: DcgmScrape | None = None
        self._rows: list[dict[str, float]] = []
        self._times_ns: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: ModuleType | None = None
        self._lock = threading.Lock()
        self._psutil_process: Any = None
        self.server_series: pd.DataFrame | None = None  # set by write(): the scraped series
        try:
            self._psutil_process = import_psutil().Process(os.getpid())
        except Exception as exc:  # every failure is a note, never a crash
            self.notes.append(f"rss_bytes, cpu_util: psutil unavailable: {_why(exc)}")

    # ---- life cycle -----------------------------------------------------------------------

    def mark_before_load(self) -> None:
        """Read RSS before the model is built: the baseline of the CPU memory breakdown."""
        if self._psutil_process is None:
            return
        try:
            self.rss_before_load_bytes = int(self._psutil_process.memory_info().rss)
        except Exception:  # the rss reader notes it when it fails too
            self.rss_before_load_bytes = None

    def watch_server(self, scrape: ServerScrape, interval_s: float) -> None:
        """Also scrape a server's /metrics every `interval_s` (call before start)."""
        self.server = scrape
        self._readers.append(
            _Source((f"server_* (from {scrape.url})",), scrape.read, int(interval_s * 1e9))
        )

    def watch_dcgm(self, scrape: DcgmScrape, interval_s: float) -> None:
        """Read the GPU columns from a dcgm-exporter every `interval_s` instead of NVML (call
        before start). The exporter refreshes its counters every few seconds; parsing its page
        each sample would only take the client's GIL."""
        self.dcgm = scrape
        columns = ("gpu_util", "gpu_mem_used_bytes", "gpu_power_w", _ENERGY_MJ)
        self._readers.append(_Source(columns, scrape.read, int(interval_s * 1e9)))

    def start(self, gpu_index: int | None = None) -> None:
        """Sample now and then every interval; `gpu_index` (see gpu_index_for) picks the GPU,
        None samples none."""
        self.gpu_index = gpu_index
        self._add_process_readers()
        if self.dcgm is None:
            self._add_gpu_readers()
        else:
            self.gpu_index = None
            self.notes.append(
                f"gpu_util, gpu_mem_used_bytes, gpu_power_w, gpu_energy_j: from the "
                f"dcgm-exporter at {self.dcgm.url}, GPU {self.dcgm.gpu}"
            )
        self._sample(force=True)
        self._thread = threading.Thread(target=self._loop, name="inferlab-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and take a last sample; safe to call twice or without start."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample(force=True)
        if self._nvml is not None:
            with contextlib.suppress(Exception):  # nothing left to read anyway
                self._nvml.nvmlShutdown()
            self._nvml = None

    def sample_now(self) -> None:
        """A sample of every source now (the measured run's start: the server's counters
        there leave the warm-up out)."""
        if self._thread is not None:
            self._sample(force=True)

    def _loop(self) -> None:
        deadline = now_ns() + int(self.interval_s * 1e9)
        while not self._stop.wait(max(0.0, (deadline - now_ns()) / 1e9)):
            self._sample()
            deadline += int(self.interval_s * 1e9)
            if deadline < now_ns():  # fell behind (a stalled machine): do not burst
                deadline = now_ns() + int(self.interval_s * 1e9)

    # ---- readers --------------------------------------------------------------------------

    def _add_process_readers(self) -> None:
        process = self._psutil_process
        if process is None:
            return
        self._readers.append(
            _Source(("rss_bytes",), lambda: {"rss_bytes": float(process.memory_info().rss)})
        )

        def cpu_seconds() -> dict[str, float]:
            times = process.cpu_times()
            return {_CPU_SECONDS: float(times.user + times.system)}

        self._readers.append(_Source((_CPU_SECONDS,), cpu_seconds))

    def _add_gpu_readers(self) -> None:
        gpu_columns = "gpu_util, gpu_mem_used_bytes, gpu_power_w, gpu_energy_j"
        if self.gpu_index is None:
            self.notes.append(
                f"{gpu_columns}, torch_cuda_*: not sampled: the engine runs on the CPU"
            )
            return
        self._add_torch_cuda_reader()
        try:
            nvml = import_nvml()
            nvml.nvmlInit()
        except Exception as exc:
            self.notes.append(f"{gpu_columns}: NVML unavailable: {_why(exc)}")
            return
        try:
            handle = _nvml_handle(nvml, self.gpu_index)
        except Exception as exc:
            self.notes.append(f"{gpu_columns}: NVML has no GPU {self.gpu_index}: {_why(exc)}")
            with contextlib.suppress(Exception):  # a failing shutdown must not fail the run
                nvml.nvmlShutdown()
            return
        self._nvml = nvml

        def utilization() -> dict[str, float]:
            return {"gpu_util": nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0}

        self._readers += [
            _Source(("gpu_util",), utilization),
            _Source(
                ("gpu_mem_used_bytes",),
                lambda: {"gpu_mem_used_bytes": float(nvml.nvmlDeviceGetMemoryInfo(handle).used)},
            ),
            _Source(
                ("gpu_power_w",),
                lambda: {"gpu_power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0},
            ),
            _Source(
                (_ENERGY_MJ,),
                lambda: {_ENERGY_MJ: float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))},
            ),
        ]

    def _add_torch_cuda_reader(self) -> None:
        assert self.gpu_index is not None  # called only by _add_gpu_readers, past its None check
        try:
            import torch

            if not torch.cuda.is_available():
                self.notes.append(
                    "torch_cuda_allocated_bytes, torch_cuda_reserved_bytes: "
                    "not sampled: torch has no CUDA"
                )
                return
            device = torch.device("cuda", self.gpu_index)
            torch.cuda.reset_peak_memory_stats(device)
        except Exception as exc:
            self.notes.append(f"torch_cuda_*: not sampled: {_why(exc)}")
            return

        def peaks() -> dict[str, float]:
            # the peak of this interval: read, then reset for the next one
            allocated = torch.cuda.max_memory_allocated(device)
            reserved = torch.cuda.max_memory_reserved(device)
            torch.cuda.reset_peak_memory_stats(device)
            return {
                "torch_cuda_allocated_bytes": float(allocated),
                "torch_cuda_reserved_bytes": float(reserved),
            }

        self._readers.append(
            _Source(("torch_cuda_allocated_bytes", "torch_cuda_reserved_bytes"), peaks)
        )

    def _sample(self, force: bool = False) -> None:
        with self._lock:  # the final sample (main thread) never overlaps the thread's
            time_ns = now_ns()
            row: dict[str, float] = {}
            failed = []
            for source in self._readers:
                if source.every_ns and not force and time_ns < source.due_ns:
                    continue
                source.due_ns = time_ns + source.every_ns
                try:
                    row.update(source.read())
                except Exception as exc:  # degrade this source only
                    failed.append(source)
                    names = ", ".join(_public(c) for c in source.columns)
                    when = (
                        f"stopped after {len(self._rows)} samples" if self._rows else "not sampled"
                    )
                    self.notes.append(f"{names}: {when}: {_why(exc)}")
            for entry in failed:
                self._readers.remove(entry)
            self._times_ns.append(time_ns)
            self._rows.append(row)

    # ---- results --------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return len(self._rows)

    def frame(self, t0_ns: int) -> pd.DataFrame:
        """The samples, `time_s` in seconds since `t0_ns` (the run's own time origin)."""
        raw = pd.DataFrame(self._rows, index=range(len(self._rows)), dtype="float64")
        times = np.asarray(self._times_ns, dtype=np.int64)
        out = pd.DataFrame({"time_s": (times - t0_ns) / 1e9})
        for column in SAMPLE_COLUMNS[1:]:
            out[column] = raw.get(column, np.nan)
        if _CPU_SECONDS in raw:
            wall = np.diff(times, prepend=times[:1]) / 1e9
            busy = raw[_CPU_SECONDS].diff().to_numpy()
            with np.errstate(divide="ignore", invalid="ignore"):
                out["cpu_util"] = np.where(wall > 0, busy / wall / self.cpus, np.nan)
        if SCRAPE_INDEX in raw and self.server is not None:
            scraped = self.server.parse()[0]
            pages = raw[SCRAPE_INDEX]
            at = pages.notna().to_numpy()
            for column in SERVER_COLUMNS:
                values = np.full(len(out), np.nan)
                values[at] = scraped[column].to_numpy()[pages[at].astype(int)]
                out[column] = values
        if _ENERGY_MJ in raw and raw[_ENERGY_MJ].notna().any():
            first = raw[_ENERGY_MJ].dropna().iloc[0]
            out["gpu_energy_j"] = (raw[_ENERGY_MJ] - first) / 1000.0
        return out

    def info(self) -> dict[str, Any]:
        """Facts for summary.json: what was sampled, how, and why a column is NaN."""
        rss = [row.get("rss_bytes") for row in self._rows[:1]]
        return {
            "interval_s": self.interval_s,
            "num_samples": self.num_samples,
            "gpu_index": self.gpu_index,
            "cpus": self.cpus,
            "rss_before_load_bytes": self.rss_before_load_bytes,
            "rss_after_load_bytes": int(rss[0]) if rss and rss[0] is not None else None,
            "notes": list(self.notes),
            **({"server": self.server.info()} if self.server is not None else {}),
        }

    def write(self, run_dir: str | Path, t0_ns: int | None) -> pd.DataFrame:
        """samples.parquet, times relative to `t0_ns` (the measured run's start; when the run
        never got there, the first sample)."""
        origin = t0_ns or (self._times_ns[0] if self._times_ns else 0)
        frame = self.frame(origin)
        try:
            write_parquet_atomic(frame, Path(run_dir) / SAMPLES_FILE)
        except Exception as exc:  # the summary matters more than this file
            self.notes.append(f"samples.parquet not written: {_why(exc)}")
        if self.server is not None and self.server.num_scrapes:
            self.server_series = self.server.series(origin)
            try:
                write_parquet_atomic(self.server_series, Path(run_dir) / SERVER_METRICS_FILE)
            except Exception as exc:
                self.notes.append(f"{SERVER_METRICS_FILE} not written: {_why(exc)}")
        return frame


class MonitorTracker(Tracker):
    """`run.monitor`: a Monitor over the run, from before the load (its RSS baseline) to the
    end; samples.parquet (and server_metrics.parquet) and summary.json's `monitor`."""

    name = "monitor"

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.monitor = Monitor(config.interval_s)
        self.monitor.mark_before_load()

    @classmethod
    def from_config(cls, config: MonitorConfig) -> MonitorTracker | None:
        return cls(config) if config.enabled else None

    def loaded(self, backend: Backend, engine: dict[str, Any]) -> None:
        watch_servers(self.monitor, self.config, engine.get("metrics_url"))
        self.monitor.start(gpu_index_for(engine.get("device")))

    def start(self, backend: Backend, engine: dict[str, Any]) -> None:
        self.monitor.sample_now()  # the server's counters here leave the warm-up out

    def close(self) -> None:
        self.monitor.stop()

    def results(self, run_dir: Path, t0_ns: int | None) -> dict[str, Any]:
        # samples on the run's clock: seconds since the driver's t0
        samples = self.monitor.write(run_dir, t0_ns)
        return {
            "samples": samples,
            "monitor": self.monitor.info(),
            "server_series": self.monitor.server_series,
        }


def _nvml_handle(nvml: ModuleType, index: int) -> Any:
    """NVML numbers GPUs apart from CUDA (CUDA_VISIBLE_DEVICES, MIG): match by UUID when torch
    can tell it, else take NVML's index."""
    try:
        import torch

        if torch.cuda.is_available():
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            for prefix in ("GPU-", "MIG-"):
                try:
                    return nvml.nvmlDeviceGetHandleByUUID(prefix + uuid)
                except Exception:  # try the other prefix, then the index
                    continue
    except Exception:
        pass
    return nvml.nvmlDeviceGetHandleByIndex(index)


def _why(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _public(column: str) -> str:
    return {_CPU_SECONDS: "cpu_util", _ENERGY_MJ: "gpu_energy_j"}.get(column, column)


# ---- metrics from the samples ---------------------------------------------------------------


def whole_run_span(requests: pd.DataFrame) -> tuple[float, float] | None:
    """The whole-run span of the other metrics: first arrival -> last completion."""
    if not len(requests):
        return None
    ok = requests[requests["status"] == "ok"]
    end = ok["last_token_s"].max() if len(ok) else requests["finished_s"].max()
    start = requests["arrival_s"].min()
    if pd.isna(start) or pd.isna(end):
        return None
    return float(start), float(end)


def _overlap(samples: pd.DataFrame, span: tuple[float, float]) -> tuple[pd.DataFrame, np.ndarray]:
    """Rows whose interval (previous sample, this sample] overlaps the span, and the length
    of each overlap (the weight of interval averages). The first row is an instant."""
    start, end = span
    time = samples["time_s"].to_numpy(float)
    previous = np.concatenate([time[:1], time[:-1]])
    overlap = np.minimum(time, end) - np.maximum(previous, start)
    inside = (overlap > 0) | ((time >= start) & (time <= end))
    return samples[inside], np.clip(overlap[inside], 0.0, None)


def _weighted_mean(values: pd.Series, weights: np.ndarray) -> float | None:
    v = values.to_numpy(float)
    keep = ~np.isnan(v) & (weights > 0)
    if not keep.any():
        return None
    return float(np.average(v[keep], weights=weights[keep]))


def _peak(values: pd.Series) -> int | None:
    values = values.dropna()
    return int(values.max()) if len(values) else None


def energy_over(samples: pd.DataFrame, span: tuple[float, float]) -> float | None:
    """GPU energy in the span: the difference of the total-energy counter, interpolated at the
    span's ends; without a counter, power integrated over the sample intervals."""
    start, end = span
    counter = samples[["time_s", "gpu_energy_j"]].dropna()
    if len(counter) >= 2:
        t, e = counter["time_s"].to_numpy(float), counter["gpu_energy_j"].to_numpy(float)
        if t[0] <= start and end <= t[-1]:
            return float(np.interp(end, t, e) - np.interp(start, t, e))
        return None
    power = samples[["time_s", "gpu_power_w"]].dropna()
    if len(power) >= 2:
        t, p = power["time_s"].to_numpy(float), power["gpu_power_w"].to_numpy(float)
        if t[0] <= start and end <= t[-1]:
            lo, hi = np.maximum(t[:-1], start), np.minimum(t[1:], end)
            return float(np.sum(p[1:] * np.clip(hi - lo, 0.0, None)))
    return None


def monitor_metrics(
    run_info: dict[str, Any],
    summary: dict[str, Any],
    span: tuple[float, float] | None,
    output_tokens: int,
) -> dict[str, Any]:
    """The monitor's metrics and the memory breakdown over `span` (run time, seconds).

    `run_info` holds "samples" (the samples frame), "monitor" (Monitor.info()) and "engine"
    (describe()); `summary` the metrics computed so far over the same span (KV peaks)."""
    samples: pd.DataFrame = run_info["samples"]
    facts: dict[str, Any] = run_info.get("monitor") or {}
    engine: dict[str, Any] = run_info.get("engine") or {}
    if span is None:  # no request rows: everything the monitor saw after the run's start
        times = samples["time_s"]
        span = (0.0, float(times.max())) if len(times) and times.max() > 0 else None
    out: dict[str, Any] = {}
    if span is not None and len(samples):
        rows, weights = _overlap(samples, span)
        out["peak_rss_bytes"] = _peak(rows["rss_bytes"])
        out["cpu_util_mean"] = _weighted_mean(rows["cpu_util"], weights)
        # read only every server interval from a dcgm-exporter: each read weighs the time
        # since the previous read, not since the previous row
        gpu_rows, gpu_weights = _overlap(samples[["time_s", "gpu_util"]].dropna(), span)
        out["gpu_util_mean"] = _weighted_mean(gpu_rows["gpu_util"], gpu_weights)
        out["peak_vram_bytes"] = _peak(rows["gpu_mem_used_bytes"])
        energy = energy_over(samples, span)
        out["energy_j"] = energy
        out["j_per_output_token"] = (
            energy / output_tokens if energy is not None and output_tokens > 0 else None
        )
        out.update(memory_breakdown(rows, facts, engine, summary))
        series = run_info.get("server_series")
        server = (facts.get("server") or {}).get("server")
        if series is not None and server is not None:
            out.update(server_figures(series, samples, server, span))
    return {k: v for k, v in out.items() if v is not None and not _is_nan(v)}


def memory_breakdown(
    rows: pd.DataFrame, facts: dict[str, Any], engine: dict[str, Any], summary: dict[str, Any]
) -> dict[str, Any]:
    """Weights (and their packed copies), KV pool / reserved / used, the run's peak, and the
    rest (activations and workspace); the peak is the sum of weights, packed copies, KV and
    the rest.

    GPU: the peak is torch's allocated peak, which holds every tensor, the whole KV pool (one
    allocation at load) included, so other = peak - weights - packed - pool. CPU: RSS also
    holds the interpreter and libraries, so the run's growth is measured instead: growth = peak
    RSS - RSS after load (the first sample). With `kv_cache_prefault` (the engine's default)
    every page of the pool was mapped at load: peak = weights + packed + pool + growth and
    other = growth. Without it the pool is mapped lazily (pages appear as tokens are written):
    other = growth - KV in use at the peak, peak = weights + packed + growth. That `other` is an
    upper bound: it also holds KV pages written beyond the peak in use, allocator caches and the
    harness's own rows. A negative rest (memory freed earlier in the process reused) is
    reported as absent, never as a number."""
    weights = engine.get("weight_bytes")
    packed = engine.get("packed_weight_bytes")  # absent from backends that keep none
    pool = engine.get("kv_pool_bytes")
    kv_used = summary.get("kv_bytes_used_peak")
    out: dict[str, Any] = {
        "memory_weights_bytes": weights,
        "memory_packed_weights_bytes": packed,
        "memory_kv_pool_bytes": pool,
        "memory_kv_reserved_bytes": summary.get("kv_bytes_reserved_peak"),
        "memory_kv_used_bytes": kv_used,
    }
    if weights is None:
        return out
    gpu_peak = _peak(rows["torch_cuda_allocated_bytes"])
    rss_peak = _peak(rows["rss_bytes"])
    after_load = facts.get("rss_after_load_bytes")
    if gpu_peak is not None:
        other = gpu_peak - int(weights) - int(packed or 0) - int(pool or 0)
        out["memory_peak_bytes"] = gpu_peak
    elif rss_peak is not None and after_load is not None:
        growth = rss_peak - int(after_load)
        resident = int(weights) + int(packed or 0)  # at load, with the pool when prefaulted
        if engine.get("kv_cache_prefault"):
            resident += int(pool or 0)
            other = growth
        else:
            other = growth - int(kv_used or 0)
        out["memory_peak_bytes"] = resident + growth if growth >= 0 else None
    else:
        return out
    out["memory_other_bytes"] = other if other >= 0 else None
    return out


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)
