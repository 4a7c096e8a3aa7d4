"""One experiment run, independent of Hydra: build the backend and workload from a plain config,
warm up, drive the measured workload, and leave a complete (or honestly partial) run folder."""

from __future__ import annotations

import copy
import gc
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from engines.backends import build_backend
from engines.base import Backend, ConfigError, now_ns
from harness.measuring import hardware, provenance, roofline
from harness.measuring.accuracy import AccuracyTracker
from harness.measuring.monitors import MonitorTracker
from harness.measuring.profiling import ProfileTracker
from harness.measuring.quality import QualityTracker
from harness.measuring.timeslices import timeslices
from harness.measuring.trackers import Tracker
from harness.run_folder import (
    RunRecorder,
    TablesNotWritten,
    remove_summary,
    table_path,
    write_config,
    write_provenance,
    write_timeslices,
)
from harness.running import heap
from harness.running.clients import ClientPool
from harness.running.driver import Driver
from harness.running.interrupts import interruption, interrupts
from harness.running.progress import RunProgress
from harness.running.run_config import RunConfig, checked_run, make_workload
from harness.running.window import summarize
from workloads import WorkloadRequest


def warmup_requests(requests: list[WorkloadRequest], count: int) -> list[WorkloadRequest]:
    """Copies of the first `count` first-turn requests of the measured ones, renamed and all
    due at once (copies: the measured requests go out as they were built)."""
    first_turns = [w for w in requests if not w.follows][:count]
    return [
        replace(w, arrival_s=0.0, request=replace(w.request, request_id=f"warmup-{w.request_id}"))
        for w in copy.deepcopy(first_turns)
    ]


class RunFolderError(OSError):
    """The run folder could not be written, not even a failed summary.json. `summary` is what
    it would have held; no `running` summary is left behind where it could be removed."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


def run_experiment(
    config: dict[str, Any],
    run_dir: str | Path,
    progress: bool = True,
    provenance_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one configuration into `run_dir`; return the summary (also in summary.json).
    `provenance_extra`: keys added to provenance.json (a sweep job's placement).

    A folder that cannot be written raises OSError: at the start, before any summary (so
    nothing claims to be running), or RunFolderError when not even a failed summary.json
    could be written at the end."""
    try:
        return _run(config, Path(run_dir), progress, provenance_extra or {})
    finally:
        # The engine sits in reference cycles (generator frames, closures) that refcounting
        # does not free: collect them once the run's frame is gone, or the next run in this
        # process (an A/B worker, an in-process sweep) builds its model and KV cache while
        # this run's are still held (measured: A/B workers at 7.5 GB instead of ~4).
        gc.collect()


#: info keys that summarize() reads and summary.json leaves out
_INFO_ONLY = ("load_s", "cold_start_s", "harness_overhead_fraction", "samples", "server_series")


@dataclass
class RunContext:
    """One run as its phases share it: the config, the run folder, what the phases built, and
    what summary.json will say."""

    config: dict[str, Any]
    run_dir: Path
    recorder: RunRecorder
    shown: RunProgress
    cfg: RunConfig = field(default_factory=RunConfig)  # until read: the window and SLO defaults
    hardware: Any = None  # the `hardware` section, checked
    trackers: list[Tracker] = field(default_factory=list)
    workload: Any = None  # the workload dataclass, built once (prepare or load)
    backend: Backend | None = None
    requests: list[WorkloadRequest] = field(default_factory=list)  # the measured ones
    driver: Driver | ClientPool | None = None
    first_steps: list[dict[str, Any]] = field(default_factory=list)
    # until the measured requests are built: a ValueError is the configuration refused (an
    # option out of range, a checkpoint's config.json), not a failure of the run
    setting_up: bool = True
    status: str = "complete"
    error: str | None = None
    stopped_by: str | None = None  # the bound that stopped the run early, if one did
    stop_reason: str | None = None
    saturation: dict[str, Any] | None = None  # the detector's evidence, if it fired
    info: dict[str, Any] = field(default_factory=dict)  # the summary's extra keys: JSON-like

    def keep_first_step(self, table: str, row: dict[str, Any]) -> None:
        if table == "steps" and not self.first_steps:
            self.first_steps.append(row)

    def failed(self, exc: BaseException) -> None:
        """The run failed with `exc`, raised before the finish."""
        self.status, self.error = "failed", _one_line(exc)
        # a path the configuration names that is not there (a checkpoint folder without its
        # config.json, a trace file) is a configuration error like a value out of range
        if self.setting_up and isinstance(exc, ValueError | FileNotFoundError):
            self.info["error_kind"] = "config"
            # its message names the key or file and what is allowed, as the errors refused
            # while composing do; the exception's class is no news to the user
            self.error = str(exc) or self.error
        self.info["traceback"] = traceback.format_exc()

    def failed_writing(self, exc: BaseException) -> None:
        """A run whose folder could not be written whole did not end well, whatever it ran."""
        message = f"writing the run folder failed: {_one_line(exc)}"
        if self.status == "failed":
            self.info.setdefault("finalize_errors", []).append(message)
        else:
            self.status = "failed"
            self.error = message if self.error is None else f"{message} ({self.error})"

    def guarded(self, name: str, action: Callable[[], Any], writes: bool = False) -> Any:
        """A clean-up step: whatever fails, the rows are kept and summary.json is written, with
        the failure named under `finalize_errors`; a step that writes files and hits an OSError
        (a full disk) fails the run too."""
        try:
            return action()
        except Exception as exc:
            self.info.setdefault("finalize_errors", []).append(f"{name}: {exc!r}")
            if writes and isinstance(exc, OSError):
                self.failed_writing(exc)
            return None


def _one_line(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(exc)).strip()


def _run(
    config: dict[str, Any], run_dir: Path, progress: bool, provenance_extra: dict[str, Any]
) -> dict[str, Any]:
    run = _open(config, run_dir, progress, provenance_extra)
    try:
        with interrupts():
            _prepare(run)
            _load(run)
            _warm_up(run)
            _measure(run)
    except KeyboardInterrupt as exc:
        run.status, run.error = "incomplete", interruption(exc)
        _keep_stop(run)  # a bound hit before the interrupt still stopped the run
    except Exception as exc:  # recorded, then re-raised by the caller if it wants
        run.failed(exc)
    finally:
        summary = _finish(run)
    return summary


def _open(
    config: dict[str, Any], run_dir: Path, progress: bool, provenance_extra: dict[str, Any]
) -> RunContext:
    """The run folder's first files: config.yaml, provenance.json and a `running` summary. An
    unwritable folder raises: nothing ran, nothing claims to be running."""
    recorder = RunRecorder(run_dir)
    try:
        write_config(run_dir, config)
        write_provenance(run_dir, {**provenance.collect(config), **provenance_extra})
        recorder.write_summary({"status": "running"})
    except OSError:
        with suppress(OSError):
            recorder.close()
        raise
    return RunContext(config, run_dir, recorder, RunProgress(progress))


def _prepare(run: RunContext) -> None:
    """Phase prepare: the run's sections checked and the trackers built, before anything
    loads."""
    run.cfg, run.workload = checked_run(run.config)
    run.hardware = hardware.validate_config(run.config.get("hardware"))
    run.trackers = _trackers(run.config, run.cfg, run.run_dir)


def _trackers(config: dict[str, Any], cfg: RunConfig, run_dir: Path) -> list[Tracker]:
    """The trackers the configuration asks for (harness/measuring/trackers.py), in the order
    their hooks are called: the one place a tracker is added."""
    asked = (
        QualityTracker.from_config(asdict(cfg.quality)),
        AccuracyTracker.from_config(asdict(cfg.accuracy), config.get("model")),
        ProfileTracker.from_config(config, run_dir),
        MonitorTracker.from_config(cfg.monitor),  # last: its RSS baseline right before the load
    )
    return [tracker for tracker in asked if tracker is not None]


def _backend_label(config: dict[str, Any]) -> str:
    engine, model = config.get("engine") or {}, config.get("model") or {}
    name = model.get("name") or model.get("path") or "?"
    return f"the {engine.get('backend', 'builtin')} backend, model {name}"


def _load(run: RunContext) -> None:
    """Phase load: the backend built and loaded (timed), its facts and the hardware recorded,
    the trackers told, the measured requests built for its tokenizer and context."""
    start = now_ns()
    run.shown.phase(f"loading {_backend_label(run.config)}")
    run.backend = backend = build_backend(run.config["engine"], run.config["model"])
    backend.files_dir = run.run_dir
    backend.load()
    info = run.info
    info["load_s"] = (now_ns() - start) / 1e9
    run.shown.phase(f"loaded in {info['load_s']:.1f} s")
    engine = info["engine"] = backend.describe()
    # the threads as the engine set them at load (provenance.json predates the load)
    provenance.record_threads(run.run_dir)
    provenance.record_server(run.run_dir, engine.get("launched_server"))
    # after load: a CPU probe runs at the engine's thread count (cached per machine)
    info["hardware"] = hardware.describe_for_run(
        *hardware.resolve(run.hardware, engine.get("device"))
    )
    for tracker in run.trackers:  # after the probe, whose buffers are no part of the run
        tracker.loaded(backend, engine)
    if run.workload is None:
        run.workload = make_workload(run.config["workload"])
    tokenizer = getattr(backend, "tokenizer", None)
    run.requests = run.workload.build(tokenizer, engine.get("max_model_len"))
    _check_adapters(run.requests, backend)
    run.setting_up = False
    info["workload"] = dict(getattr(run.workload, "info", {}) or {})


def _check_adapters(requests: list[WorkloadRequest], backend: Backend) -> None:
    """Every adapter the workload names must be one the backend serves, or the run would
    measure the rest of its requests only (they would fail one by one)."""
    served = backend.served_adapters()
    asked = sorted({r.request.lora for r in requests if r.request.lora is not None})
    unknown = [name for name in asked if served is not None and name not in served]
    if unknown:
        allowed = ", ".join(served or ()) or (
            f"none (engine={backend.name} serves no adapters here: engine.enable_lora and "
            "engine.lora_modules, or lora_dummy_adapters, on engine=builtin)"
        )
        raise ConfigError(f"workload.lora_adapters: {unknown} are not served; allowed: {allowed}")


def _warm_up(run: RunContext) -> None:
    """Phase warm-up: the first requests once, left out of every metric (their first engine
    step is the cold start's)."""
    assert run.backend is not None  # loaded
    warm = warmup_requests(run.requests, run.cfg.warmup_requests)
    if warm:
        run.shown.phase(f"warm-up: {len(warm)} requests")
        Driver(run.backend, run.keep_first_step).run(warm)


def _measure(run: RunContext) -> None:
    """Phase measure: the measured requests driven into the run's tables between the
    trackers' start and stop."""
    backend, engine, info = run.backend, run.info["engine"], run.info
    assert backend is not None  # loaded
    run.shown.start_requests(len(run.requests))
    run.driver = driver = _driver(run, backend)
    concurrency = getattr(run.workload, "concurrency", None)
    max_concurrency = getattr(run.workload, "max_concurrency", None)
    info["closed_loop"] = concurrency is not None
    info["workload"]["max_concurrency"] = max_concurrency
    backend.start_measuring()
    for tracker in run.trackers:
        tracker.start(backend, engine)
    with heap.frozen():
        driver.run(run.requests, concurrency=concurrency, max_concurrency=max_concurrency)
    failure = backend.failure()
    if failure is not None:  # the requests after it failed one by one; so does the run
        raise RuntimeError(f"the backend failed during the run: {failure}")
    info["harness_overhead_fraction"] = driver.overhead_fraction
    if _keep_stop(run):
        run.shown.phase(f"stopped early: {run.stop_reason}")
    for tracker in run.trackers:
        tracker.stop(backend, engine)
    if run.first_steps:
        step = run.first_steps[0]
        info["first_step_s"] = step["end_s"] - step["start_s"]
        info["cold_start_s"] = info["load_s"] + info["first_step_s"]
    if run.stopped_by == "max_errors":  # the others stop a run that did what was asked
        run.status, run.error = "failed", run.stop_reason


def _keep_stop(run: RunContext) -> bool:
    """The run's `stopped_by` from its driver's, if a bound stopped it."""
    driver = run.driver
    if not isinstance(driver, Driver) or driver.stopped_by is None:
        return False
    run.stopped_by, run.stop_reason = driver.stopped_by, driver.stop_reason
    run.saturation = driver.saturation
    return True


def _driver(run: RunContext, backend: Backend) -> Driver | ClientPool:
    """What sends the measured requests: this process, or `run.num_clients` client processes."""
    sink = _tee(run.recorder.append, run.keep_first_step)

    def done(_: Any) -> None:
        run.shown.request_done()

    if run.cfg.num_clients > 1:
        on_ray = run.cfg.clients_on == "ray"
        return ClientPool(run.config, run.cfg.num_clients, backend, sink, done, on_ray=on_ray)
    return Driver(backend, sink, on_request_done=done, bounds=run.cfg.bounds)


def _finish(run: RunContext) -> dict[str, Any]:
    """Phase finish, always: the trackers stopped, the backend closed, the tables, the
    trackers' results and summary.json written, each step guarded."""
    if isinstance(run.driver, ClientPool):  # also after a client died or Ctrl-C
        run.info.update(run.driver.info)
    for tracker in run.trackers:
        run.guarded(tracker.name, tracker.close, writes=True)
    run.shown.close()
    if run.backend is not None:
        _close_backend(run, run.backend)
    try:
        frames = run.recorder.finalize()
    except TablesNotWritten as exc:  # readers fall back to the JSONL rows
        frames = exc.frames
        run.failed_writing(exc.cause)
    t0_ns = run.driver.t0 if run.driver is not None else None
    for tracker in run.trackers:
        results = run.guarded(tracker.name, partial(tracker.results, run.run_dir, t0_ns), True)
        run.info.update(results or {})
    _annotate_roofline(run, frames)
    if len(frames["requests"]):  # a run refused or failed before its requests has no timeline
        run.guarded("timeslices", partial(_write_timeslices, run, frames), writes=True)
    _fail_if_every_request_failed(run, frames["requests"])
    summary = {
        "status": run.status,
        "error": run.error,
        # how the run ended besides its status (docs/run_folder.md)
        "stopped_by": run.stopped_by,
        "stop_reason": run.stop_reason,
        "saturated": run.saturation is not None,
        "saturation": run.saturation,
        # the measured requests without a row: never sent because the run stopped early
        # (the driver counts what it sent: an interrupt drops the rows of those in flight)
        "num_unsent": run.driver.num_unsent
        if isinstance(run.driver, Driver) and run.driver.num_planned
        else max(0, len(run.requests) - len(frames["requests"])),
        **summarize(frames, run.info, asdict(run.cfg.slo), run.cfg.window, run.cfg.percentiles),
        "run_dir": str(run.run_dir),
        **{k: v for k, v in run.info.items() if k not in _INFO_ONLY},
    }
    return _write_final_summary(run.recorder, summary)


def _close_backend(run: RunContext, backend: Backend) -> None:
    if "engine" in run.info:  # counters some backends keep updating during the run
        run.info["engine"] = run.guarded("describe", backend.describe) or run.info["engine"]
    run.guarded("backend.close", backend.close)


def _annotate_roofline(run: RunContext, frames: dict[str, Any]) -> None:
    try:
        frames["steps"] = roofline.annotate_run(run.run_dir, frames["steps"], run.info)
    except Exception as exc:
        run.info.setdefault("finalize_errors", []).append(f"roofline: {exc!r}")
        if isinstance(exc, OSError):  # steps.parquet may be torn mid-rewrite
            run.failed_writing(exc)
            with suppress(OSError):  # readers fall back to steps.jsonl, the same rows
                table_path(run.run_dir, "steps", "parquet").unlink(missing_ok=True)


def _write_timeslices(run: RunContext, frames: dict[str, Any]) -> None:
    table = timeslices(frames["requests"], frames["tokens"], run.cfg.timeslice_s)
    write_timeslices(run.run_dir, table)


def _fail_if_every_request_failed(run: RunContext, requests: Any) -> None:
    # a cancelled request was stopped by the harness (a run bound), not refused by the backend:
    # a run that measured nothing because every other request failed still failed
    attempted = requests[requests["status"] != "cancelled"] if len(requests) else requests
    if run.status == "complete" and len(attempted) and (attempted["status"] == "failed").all():
        first = attempted.iloc[0]
        cancelled = len(requests) - len(attempted)
        also = f", {cancelled} cancelled" if cancelled else ""
        run.status, run.error = (
            "failed",
            (
                f"every measured request failed ({len(attempted)} of {len(attempted)}{also}); "
                f"the first, {first['request_id']}: {first['error']}"
            ),
        )


def _write_final_summary(recorder: RunRecorder, summary: dict[str, Any]) -> dict[str, Any]:
    """Write the run's last summary.json and return it. When that fails (a full disk), the run
    is `failed` with the OSError, written if it still can be; when not even that can be
    written, the `running` summary is removed and RunFolderError raised."""
    try:
        recorder.write_summary(summary)
        return summary
    except OSError as exc:
        reason = "".join(traceback.format_exception_only(exc)).strip()
    message = f"writing summary.json failed: {reason}"
    if summary.get("error"):
        message += f" (after: {summary['error']})"
    failed = {**summary, "status": "failed", "error": message}
    try:
        recorder.write_summary(failed)
        return failed
    except OSError:
        pass
    with suppress(OSError):  # a stale `running` would say the run is still going
        remove_summary(recorder.run_dir)
    raise RunFolderError(f"{recorder.run_dir}: {message}", failed)


def _tee(*sinks: Any) -> Any:
    def sink(table: str, row: dict[str, Any]) -> None:
        for s in sinks:
            s(table, row)

    return sink
