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

import workloads
from engines.backends import build_backend
from engines.base import Backend, now_ns
from engines.options import option
from harness.config_section import ConfigSection, holds_a_float
from harness.measuring import hardware, provenance, roofline
from harness.measuring.checks import Check, contradictions, parse_checks
from harness.measuring.metrics import (
    DEFAULT_PERCENTILES,
    PERCENTILE_DECIMALS,
    percentile_stat,
    stat_percentile,
)
from harness.measuring.monitors import MonitorConfig, MonitorTracker
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
from harness.running.capacity_search import OVER, SearchSettings
from harness.running.clients import ClientPool, client_limits
from harness.running.driver import MAX_ERRORS_MIN_FINISHED, Driver, RunBounds
from harness.running.interrupts import interruption, interrupts
from harness.running.progress import RunProgress
from harness.running.saturation import SaturationConfig
from harness.running.window import WindowConfig, summarize
from workloads import WorkloadRequest


def _slo_bound(what: str) -> Any:
    return option(
        None,
        gt=0,
        unit="seconds",
        valid=holds_a_float,
        help=f"the {what} a request may take and still count toward goodput",
    )


CLIENTS_ON = ("processes", "ray")

PERCENTILES_ALLOWED = (
    "a non-empty list of distinct numbers strictly between 0 and 100, at most "
    f"{PERCENTILE_DECIMALS} decimals each, e.g. [50, 90, 95, 99, 99.9]"
)


def _distinct_percentiles(values: list[float]) -> bool:
    """No two alike once named (50 and 50.0 are one), none with more decimals than a name
    spells (its name would round it)."""
    names = [percentile_stat(q) for q in values]
    return len(set(names)) == len(names) and all(
        stat_percentile(name) == float(q) for name, q in zip(names, values, strict=True)
    )


def _is_error_bound(value: Any) -> bool:
    """A count (a whole number >= 1) or a fraction in (0, 1)."""
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):
        return False
    return 0 < number < 1 or (number >= 1 and number.is_integer())


@dataclass(frozen=True)
class SloConfig(ConfigSection):
    """`run.slo`: the bounds goodput counts against, in seconds (None: not bounded); goodput
    counts completed requests meeting every bound that is set."""

    section = "run.slo"

    ttft_s: float | None = _slo_bound("time to first token")
    tpot_s: float | None = _slo_bound("time per output token")
    e2e_s: float | None = _slo_bound("end-to-end latency")

    def _check_together(self) -> None:
        self._keep_floats("ttft_s", "tpot_s", "e2e_s")


def _search_bound(end: str, instead: str) -> Any:
    return option(
        None,
        gt=0,
        valid=holds_a_float,
        help=f"the {end} end of the range, a rate or a whole concurrency as `over` says (null: "
        f"the {instead} run's load)",
    )


@dataclass(frozen=True)
class SearchConfig(ConfigSection):
    """`run.search`: the capacity search (docs/capacity.md), run by `inferlab run -m` when
    `slo` is set: the highest request rate or concurrency whose run meets every check of `slo`
    (harness/running/capacity_search.py)."""

    section = "run.search"

    slo: Any = option(
        None,
        allowed="null, a non-empty list of 'METRIC OP BOUND' strings or a mapping "
        "{METRIC: BOUND} (harness/measuring/checks.py)",
        help="the checks a run must meet, e.g. ['ttft_p99_s <= 2', 'tpot_p99_s <= 0.05'] "
        "(null: no search)",
    )
    over: str = option(
        "rate",
        choices=OVER,
        help="rate: Poisson arrivals at a request rate (open loop); concurrency: a closed "
        "loop keeping that many requests in flight",
    )
    max_points: int = option(6, ge=2, help="runs at most, the two bounding runs included")
    tolerance: float = option(
        0.1,
        gt=0,
        valid=holds_a_float,
        help="stop once (lowest miss - highest meet) / highest meet is at most this",
    )
    parallel: int = option(1, ge=1, help="runs launched at once per round (the launcher's)")
    min_load: float | None = _search_bound("low", "synchronous")
    max_load: float | None = _search_bound("high", "throughput")

    def _check_together(self) -> None:
        self._keep_floats("tolerance")
        if self.slo is None:
            return
        checks = self.checks
        if not checks:
            raise self.invalid("slo")
        clash = contradictions(checks)
        if clash:
            raise self.error(f"run.search.slo: contradictory: {'; '.join(clash)}")
        for name in ("min_load", "max_load"):
            value = getattr(self, name)
            if value is not None and self.over == "concurrency" and value != int(value):
                raise self.invalid(name, "null or a whole number with over=concurrency")
        if (
            self.min_load is not None
            and self.max_load is not None
            and self.min_load >= self.max_load
        ):
            raise self.error(
                f"run.search: min_load {self.min_load:g} is not below max_load "
                f"{self.max_load:g}; allowed: min_load < max_load"
            )

    @property
    def enabled(self) -> bool:
        return self.slo is not None

    @property
    def checks(self) -> tuple[Check, ...]:
        return parse_checks(self.slo, "run.search.slo")

    def settings(self) -> SearchSettings:
        return SearchSettings(
            self.over,  # type: ignore[arg-type]  # one of OVER, checked
            self.max_points,
            self.tolerance,
            self.parallel,
            self.min_load,
            self.max_load,
        )


@dataclass(frozen=True)
class QualityConfig(ConfigSection):
    """`run.quality`: the quality probe (harness/measuring/quality.py), this engine against the
    fp32 unquantized one on the same weights."""

    section = "run.quality"

    enabled: bool = option(False, help="run the probe after the measured run")
    num_prompts: int = option(8, ge=1, help="prompts from the text (and from each prompt set)")
    prompt_len: int = option(64, ge=2, help="tokens per prompt")
    text: str | None = option(
        None,
        allowed="null or the path of a text file",
        help="text file for the probe and perplexity (None: the shipped corpus)",
    )
    prompt_sets: list[str] = option(
        default_factory=list,
        empty=True,
        allowed="a list of paths of prompt-set files (ShareGPT .json, MT-Bench .jsonl, or one "
        "prompt per line)",
        help="prompt-set files, each adding num_prompts prompts of real chat text to the probe "
        "(harness/measuring/quality.py)",
    )
    min_margin: float = option(
        0.1,
        ge=0,
        valid=holds_a_float,
        help="top-1 agreement counts positions whose reference margin exceeds it",
    )

    def _check_together(self) -> None:
        self._keep_floats("min_margin")


@dataclass(frozen=True)
class RunConfig(ConfigSection):
    """The `run` section, validated once at the edge: an unknown key or a bad value is an
    error that names it and the allowed values, before anything is loaded or written."""

    section = "run"

    name: str = option(
        "default",
        valid=lambda name: name != "",
        allowed="a non-empty string",
        help="the run folder's name ends with it",
    )
    resume: bool = option(
        False,
        help="skip a run (or sweep job) whose folder already holds a complete run, and run the "
        "others again; without it a folder that holds a run is refused "
        "(harness/running/folder_guard.py)",
    )
    allow_failed_jobs: bool = option(
        False, help="a sweep with a failed job exits 1 (so CI notices) unless this is true"
    )
    warmup_requests: int = option(
        0, ge=0, help="run first, left out of every metric (config.yaml sets 2)"
    )
    progress: bool = option(
        True,
        help="phase lines on stderr (loading, warm-up, running), then a bar on a terminal or, "
        "without one (make, CI logs), a line every 5 s; false: silent until the summary",
    )
    window: WindowConfig = option(
        default_factory=WindowConfig, help="the steady-state window (docs/metrics.md)"
    )
    monitor: MonitorConfig = option(
        default_factory=MonitorConfig,
        help="a background sampler -> samples.parquet, memory/energy metrics (docs/monitoring.md)",
    )
    quality: QualityConfig = option(default_factory=QualityConfig, help="the quality probe")
    slo: SloConfig = option(default_factory=SloConfig, help="the bounds goodput counts against")
    search: SearchConfig = option(
        default_factory=SearchConfig,
        help="the capacity search: the highest load meeting an SLO (docs/capacity.md)",
    )
    percentiles: list[float] = option(
        default_factory=lambda: list(DEFAULT_PERCENTILES),
        gt=0,
        lt=100,
        valid=_distinct_percentiles,
        allowed=PERCENTILES_ALLOWED,
        help="the percentiles of every latency family (ttft, tpot, e2e, queue, itl), beside "
        "their mean and std: 99.9 is named p999 (ttft_p95_s, itl_p999_s). Whatever the list, "
        "the summary always holds ttft p50/p90/p99, tpot p50/p99, e2e p50/p99, queue p50/p99 "
        "and itl p50/p90/p99/p999/max/mean, which the report and the gate read",
    )
    timeslice_s: float | None = option(
        None,
        gt=0,
        unit="seconds",
        valid=holds_a_float,
        help="the length of a slice of timeslices.csv, the run over time (docs/metrics.md); "
        "null: about 20 slices over the run, rounded to 1, 2 or 5 x 10^k seconds",
    )
    num_clients: int = option(
        1,
        ge=1,
        help="N > 1: the requests are sent from N client processes (engine=openai only), each "
        "with its own connection pool and event loop (harness/running/clients.py, "
        "docs/scaling.md)",
    )
    clients_on: str = option(
        "processes",
        choices=CLIENTS_ON,
        help="where the clients run: local processes, or Ray tasks on the cluster `ray.init()` "
        "joins (RAY_ADDRESS, else a local one), which connect back to this process over TCP",
    )
    # Bounds on the measured run (harness/running/driver.py): when one is hit nothing more is
    # sent, the requests in flight get max_duration_grace_s, then are cancelled; summary.json
    # says which under `stopped_by` (docs/benchmarks.md, "Bounds on a run")
    max_duration_s: float | None = option(
        None,
        gt=0,
        unit="seconds",
        valid=holds_a_float,
        help="stop sending this long after the measured run's start (null: no bound)",
    )
    max_duration_grace_s: float = option(
        10.0,
        ge=0,
        unit="seconds",
        valid=holds_a_float,
        help="after any stop (a bound, saturation) the requests in flight may finish this long; "
        "then they are cancelled, the bound their row's error",
    )
    max_errors: float | None = option(
        None,
        valid=_is_error_bound,
        allowed="null, an integer >= 1 (stop once that many requests have failed) or a number "
        f"in (0, 1) (stop once that fraction of the finished requests has failed, counted from "
        f"the {MAX_ERRORS_MIN_FINISHED}th on)",
        help="stop a run whose requests fail; the run is then `failed`, its error naming the bound",
    )
    stop_on_saturation: bool = option(
        False,
        help="stop sending once the server stops keeping up (requests outstanding and TTFT "
        "growing over run.saturation.window_s; harness/running/saturation.py); the run stays "
        "`complete`, `saturated: true` in summary.json with the evidence",
    )
    saturation: SaturationConfig = option(
        default_factory=SaturationConfig, help="the over-saturation detector's thresholds"
    )

    def _normalise(self) -> None:
        if isinstance(self.name, int) and not isinstance(self.name, bool):
            self._set("name", str(self.name))  # `run.name=3` on the command line

    def _check_together(self) -> None:
        self._keep_floats("timeslice_s", "max_duration_s", "max_duration_grace_s", "max_errors")
        self._set("percentiles", [float(q) for q in self.percentiles])

    @property
    def bounds(self) -> RunBounds:
        """What the driver stops on."""
        return RunBounds(
            max_duration_s=self.max_duration_s,
            grace_s=self.max_duration_grace_s,
            max_errors=self.max_errors,
            saturation=self.saturation if self.stop_on_saturation else None,
        )


#: the backends that `run.num_clients` > 1 can split over client processes: HTTP clients of a
#: server that every process can reach (an in-process engine would load N models)
MANY_CLIENT_BACKENDS = ("openai",)


def run_config(config: dict[str, Any]) -> RunConfig:
    """The `run` section, checked whole and against the engine and the workload's in-flight
    limits (`run.num_clients`)."""
    return _checked_run(config)[0]


def _checked_run(config: dict[str, Any]) -> tuple[RunConfig, Any]:
    """run_config's checks, and the workload dataclass when they had to build it (the
    clients' limits), else None: the run builds it after the load, where a bad workload has
    always been named."""
    run_cfg = RunConfig.from_dict(config.get("run"))
    backend = (config.get("engine") or {}).get("backend", "builtin")
    if run_cfg.num_clients > 1 and run_cfg.bounds.any:
        # each client process drives a share alone: a bound would stop only its share
        raise ValueError(
            f"run.num_clients: {run_cfg.num_clients} is invalid with run.max_duration_s, "
            "run.max_errors or run.stop_on_saturation set; allowed: 1 (bounds are kept by "
            "the one driver)"
        )
    if run_cfg.num_clients > 1 and backend not in MANY_CLIENT_BACKENDS:
        raise ValueError(
            f"engine.backend: {backend!r} cannot run with run.num_clients="
            f"{run_cfg.num_clients}; allowed: {'|'.join(MANY_CLIENT_BACKENDS)} (client "
            "processes of one server), or run.num_clients=1"
        )
    if run_cfg.num_clients == 1 or not isinstance(config.get("workload"), dict):
        return run_cfg, None
    # here, before the server is asked or warmed up, not once the clients are due to start
    try:
        workload = make_workload(config["workload"])
    except ValueError:  # the run reports the workload's own error where it always did
        return run_cfg, None
    client_limits(
        getattr(workload, "concurrency", None),
        getattr(workload, "max_concurrency", None),
        run_cfg.num_clients,
        config["workload"],
    )
    return run_cfg, workload


def make_workload(workload: dict[str, Any]) -> Any:
    """The validated workload dataclass for `workload.type`, built from its config keys."""
    return workloads.from_config(workload)


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
    run.cfg, run.workload = _checked_run(run.config)
    run.hardware = hardware.validate_config(run.config.get("hardware"))
    run.trackers = _trackers(run.config, run.cfg, run.run_dir)


def _trackers(config: dict[str, Any], cfg: RunConfig, run_dir: Path) -> list[Tracker]:
    """The trackers the configuration asks for (harness/measuring/trackers.py), in the order
    their hooks are called: the one place a tracker is added."""
    asked = (
        QualityTracker.from_config(asdict(cfg.quality)),
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
    backend.load()
    info = run.info
    info["load_s"] = (now_ns() - start) / 1e9
    run.shown.phase(f"loaded in {info['load_s']:.1f} s")
    engine = info["engine"] = backend.describe()
    # the threads as the engine set them at load (provenance.json predates the load)
    provenance.record_threads(run.run_dir)
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
    run.setting_up = False
    info["workload"] = dict(getattr(run.workload, "info", {}) or {})


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
    if isinstance(driver, Driver) and driver.stopped_by is not None:
        run.stopped_by, run.stop_reason = driver.stopped_by, driver.stop_reason
        run.saturation = driver.saturation
        run.shown.phase(f"stopped early: {driver.stop_reason}")
    for tracker in run.trackers:
        tracker.stop(backend, engine)
    if run.first_steps:
        step = run.first_steps[0]
        info["first_step_s"] = step["end_s"] - step["start_s"]
        info["cold_start_s"] = info["load_s"] + info["first_step_s"]
    if run.stopped_by == "max_errors":  # the others stop a run that did what was asked
        run.status, run.error = "failed", run.stop_reason


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
        "num_unsent": max(0, len(run.requests) - len(frames["requests"])),
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
