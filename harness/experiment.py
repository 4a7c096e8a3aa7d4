"""One experiment run, independent of Hydra: build the backend and workload from a plain config,
warm up, drive the measured workload, and leave a complete (or honestly partial) run folder."""

from __future__ import annotations

import gc
import signal
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

import workloads
from engines.base import Backend, now_ns
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from harness import hardware, provenance, roofline
from harness.driver import Driver
from harness.monitors import Monitor, MonitorConfig, gpu_index_for
from harness.profiling import profiler_from_config
from harness.records import RunRecorder, write_json_atomic
from harness.window import WindowConfig, summarize
from workloads import WorkloadRequest

BACKENDS = ("builtin", "hf", "openai")


def build_backend(engine: dict[str, Any], model: dict[str, Any]) -> Backend:
    """The backend `engine.backend` names, for the model group's config.

    builtin: this repo's engine. hf: Hugging Face transformers in process, on the very same
    weights. openai: any OpenAI-compatible server (the model group names what it serves).
    """
    options = dict(engine)
    backend = options.pop("backend", "builtin")
    if backend not in BACKENDS:
        raise ValueError(f"engine.backend: {backend!r} is invalid; allowed: {'|'.join(BACKENDS)}")
    known_model_keys = {"name", "path", "tokenizer", "overrides"}
    unknown = sorted(set(model) - known_model_keys)
    if unknown:
        raise ValueError(f"model: unknown key(s) {unknown}; allowed: {sorted(known_model_keys)}")
    if backend == "openai":
        from engines.openai.backend import OpenAIBackend

        return OpenAIBackend.from_config(options, model)
    if model.get("name") == "hf" and not model.get("path"):
        raise ValueError("model.path: required for model=hf (a local Hugging Face checkpoint "
                         "folder with config.json and *.safetensors)")
    options["model"] = model.get("path") or model["name"]
    if options["model"] == "tiny-trained":  # a small model with learned weights, cached
        from harness.train_tiny import cached_tiny_model

        options["model"] = str(cached_tiny_model())
    options["model_overrides"] = dict(model.get("overrides") or {})
    options["tokenizer"] = model.get("tokenizer")
    if backend == "hf":
        from engines.hf.backend import HFBackend

        return HFBackend.from_config(options)
    return BuiltinBackend(EngineConfig.from_dict(options))


def make_workload(workload: dict[str, Any]) -> Any:
    """The validated workload dataclass for `workload.type`, built from its config keys."""
    return workloads.from_config(workload)


def warmup_requests(workload: Any, tokenizer: Any, context_len: int | None,
                    count: int) -> list[WorkloadRequest]:
    """The first `count` first-turn requests of the same workload, all due at once."""
    if count <= 0:
        return []
    built = [w for w in workload.build(tokenizer, context_len) if not w.follows][:count]
    return [replace(w, arrival_s=0.0, request=replace(w.request,
                                                      request_id=f"warmup-{w.request_id}"))
            for w in built]


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    # SIGTERM behaves like Ctrl-C: KeyboardInterrupt is what asyncio propagates out of
    # the event loop from any task, so the run stops, keeps its rows and says so.
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_experiment(config: dict[str, Any], run_dir: str | Path,
                   progress: bool = True) -> dict[str, Any]:
    """Run one configuration into `run_dir`; return the summary (also in summary.json)."""
    try:
        return _run(config, Path(run_dir), progress)
    finally:
        # The engine sits in reference cycles (generator frames, closures) that refcounting
        # does not free: collect them once the run's frame is gone, or the next run in this
        # process (an A/B worker, an in-process sweep) builds its model and KV cache while
        # this run's are still held (measured: A/B workers at 7.5 GB instead of ~4).
        gc.collect()


def _run(config: dict[str, Any], run_dir: Path, progress: bool) -> dict[str, Any]:
    recorder = RunRecorder(run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    write_json_atomic(run_dir / "provenance.json", provenance.collect(config))
    recorder.write_summary({"status": "running"})
    run_cfg = config.get("run", {})
    window_cfg = WindowConfig.from_dict(run_cfg.get("window"))
    slo = dict(run_cfg.get("slo") or {})
    status, error, info, backend, bar = "complete", None, {}, None, None
    monitor: Monitor | None = None
    profiler, driver = None, None
    try:
        with sigterm_interrupts():
            hardware_cfg = hardware.validate_config(config.get("hardware"))
            monitor_cfg = MonitorConfig.from_dict(run_cfg.get("monitor"))
            profiler = profiler_from_config(config, run_dir)
            if monitor_cfg.enabled:
                monitor = Monitor(monitor_cfg.interval_s)
                monitor.mark_before_load()
            start = now_ns()
            backend = build_backend(config["engine"], config["model"])
            backend.load()
            info["load_s"] = (now_ns() - start) / 1e9
            info["engine"] = backend.describe()
            # after load: a CPU probe runs at the engine's thread count (cached per machine)
            info["hardware"] = hardware.describe_for_run(
                *hardware.resolve(hardware_cfg, info["engine"].get("device")))
            if monitor is not None:  # after the probe, whose buffers are no part of the run
                monitor.start(gpu_index_for(info["engine"].get("device")))
            tokenizer = getattr(backend, "tokenizer", None)
            context_len = info["engine"].get("max_model_len")
            workload = make_workload(config["workload"])
            requests = workload.build(tokenizer, context_len)
            info["workload"] = dict(getattr(workload, "info", {}) or {})
            first_steps: list[dict[str, Any]] = []

            def keep_first_step(table: str, row: dict[str, Any]) -> None:
                if table == "steps" and not first_steps:
                    first_steps.append(row)

            warm = warmup_requests(make_workload(config["workload"]), tokenizer, context_len,
                                   int(run_cfg.get("warmup_requests", 0)))
            if warm:
                Driver(backend, keep_first_step).run(warm)
            bar = tqdm(total=len(requests), desc="requests", unit="req", delay=2.0,
                       disable=not progress, leave=False)
            driver = Driver(backend, _tee(recorder.append, keep_first_step),
                            on_request_done=lambda _: bar.update())
            concurrency = getattr(workload, "concurrency", None)
            info["closed_loop"] = concurrency is not None
            if profiler is not None:
                profiler.attach(backend, cuda=str(info["engine"].get("device")).startswith("cuda"))
            driver.run(requests, concurrency=concurrency)
            info["harness_overhead_fraction"] = driver.overhead_fraction
            quality = run_cfg.get("quality") or {}
            if quality.get("enabled") and isinstance(backend, BuiltinBackend):
                from engines.builtin import LLM
                from harness.quality import run_quality

                assert backend.engine is not None
                info["quality"] = run_quality(backend.config.to_dict(),
                                              LLM.from_engine(backend.engine), quality)
            if first_steps:
                step = first_steps[0]
                info["first_step_s"] = step["end_s"] - step["start_s"]
                info["cold_start_s"] = info["load_s"] + info["first_step_s"]
    except KeyboardInterrupt as exc:
        status, error = "incomplete", f"interrupted: {exc or 'SIGINT'}"
    except Exception as exc:  # recorded, then re-raised by the caller if it wants
        status, error = "failed", "".join(traceback.format_exception_only(exc)).strip()
        info["traceback"] = traceback.format_exc()
    finally:
        # Each clean-up step is guarded: whatever fails, the rows are kept and summary.json
        # is written, with the failure named under `finalize_errors`.
        def guarded(name: str, action: Any) -> Any:
            try:
                return action()
            except Exception as exc:
                info.setdefault("finalize_errors", []).append(f"{name}: {exc!r}")
                return None

        if profiler is not None:
            info["profile"] = guarded("profiler", profiler.finish)
        if monitor is not None:
            guarded("monitor", monitor.stop)
        if bar is not None:
            bar.close()
        if backend is not None:
            if "engine" in info:  # counters some backends keep updating during the run
                info["engine"] = guarded("describe", backend.describe) or info["engine"]
            guarded("backend.close", backend.close)
        frames = recorder.finalize()
        if monitor is not None:  # samples on the run's clock: seconds since the driver's t0
            info["samples"] = guarded("samples", lambda: monitor.write(
                run_dir, driver.t0 if driver is not None else None))
            info["monitor"] = guarded("monitor", monitor.info)
        annotated = guarded("roofline", lambda: roofline.annotate_run(run_dir, frames["steps"],
                                                                      info))
        if annotated is not None:
            frames["steps"] = annotated
        summary = {"status": status, "error": error,
                   **summarize(frames, info, slo, window_cfg), "run_dir": str(run_dir),
                   **{k: v for k, v in info.items() if k not in ("load_s", "cold_start_s",
                                                                "harness_overhead_fraction",
                                                                "samples")}}
        recorder.write_summary(summary)
    return summary


def _tee(*sinks: Any) -> Any:
    def sink(table: str, row: dict[str, Any]) -> None:
        for s in sinks:
            s(table, row)

    return sink
