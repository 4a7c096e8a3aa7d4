"""One experiment run, independent of Hydra: build the backend and workload from a plain config,
warm up, drive the measured workload, and leave a complete (or honestly partial) run folder."""

from __future__ import annotations

import gc
import math
import traceback
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import workloads
from engines.backends import build_backend
from engines.base import now_ns
from engines.builtin.backend import BuiltinBackend
from engines.openai.server_metrics import server_root
from harness.measuring import hardware, provenance, roofline
from harness.measuring.monitors import Monitor, MonitorConfig, gpu_index_for, watch_servers
from harness.measuring.profiling import StepProfiler, profiler_from_config
from harness.measuring.server_profile import ServerProfiler
from harness.run_folder import (
    RunRecorder,
    TablesNotWritten,
    remove_summary,
    table_path,
    write_config,
    write_provenance,
)
from harness.running import heap
from harness.running.clients import ClientPool, client_limits
from harness.running.driver import Driver
from harness.running.interrupts import interruption, interrupts
from harness.running.progress import RunProgress
from harness.running.window import WindowConfig, summarize
from workloads import WorkloadRequest


def _section(name: str, values: Any, fields: Iterable[str]) -> dict[str, Any]:
    """A config section as a dict of known keys (None: empty); any other key is named."""
    allowed = sorted(fields)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{name}: {values!r} is invalid; allowed: a mapping of {allowed}")
    unknown = sorted(set(values) - set(allowed), key=str)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; allowed: {allowed}")
    return dict(values)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: {value!r} is invalid; allowed: true|false")
    return value


def _integer(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: {value!r} is invalid; allowed: an integer >= {low}")
    return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}: {value!r} is invalid; allowed: {'|'.join(allowed)}")
    return str(value)


def _number(name: str, value: Any, what: str, positive: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value < math.inf  # also refuses NaN (every comparison with it is false)
        or (positive and value == 0)
    ):
        raise ValueError(f"{name}: {value!r} is invalid; allowed: {what}")
    try:
        return float(value)
    except OverflowError:  # an integer past float's range
        raise ValueError(f"{name}: {value!r} is invalid; allowed: {what}") from None


@dataclass(frozen=True)
class SloConfig:
    """`run.slo`: the bounds goodput counts against, in seconds (None: not bounded); goodput
    counts completed requests meeting every bound that is set."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def from_dict(cls, values: Any) -> SloConfig:
        given = _section("run.slo", values, cls.__dataclass_fields__)
        return cls(
            **{
                key: None
                if value is None
                else _number(
                    f"run.slo.{key}", value, "null or a number of seconds > 0", positive=True
                )
                for key, value in given.items()
            }
        )


@dataclass(frozen=True)
class QualityConfig:
    """`run.quality`: the quality probe (harness/measuring/quality.py), this engine against the
    fp32 unquantized one on the same weights."""

    enabled: bool = False
    num_prompts: int = 8
    prompt_len: int = 64
    text: str | None = None  # text file for the probe and perplexity (None: the shipped corpus)
    # prompt-set files (ShareGPT .json, MT-Bench .jsonl, else one prompt per line), each adding
    # num_prompts prompts of real chat text to the probe (harness/measuring/quality.py)
    prompt_sets: list[str] = field(default_factory=list)
    min_margin: float = 0.1  # top-1 agreement counts positions whose reference margin exceeds it

    @classmethod
    def from_dict(cls, values: Any) -> QualityConfig:
        given = _section("run.quality", values, cls.__dataclass_fields__)
        defaults = cls()
        text = given.get("text")
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"run.quality.text: {text!r} is invalid; allowed: null or the path of a text file"
            )
        prompt_sets = given.get("prompt_sets", defaults.prompt_sets)
        if isinstance(prompt_sets, str | bytes) or not (
            isinstance(prompt_sets, list | tuple) and all(isinstance(p, str) for p in prompt_sets)
        ):
            raise ValueError(
                f"run.quality.prompt_sets: {prompt_sets!r} is invalid; allowed: a list of paths "
                "of prompt-set files (ShareGPT .json, MT-Bench .jsonl, or one prompt per line)"
            )
        return cls(
            enabled=_flag("run.quality.enabled", given.get("enabled", defaults.enabled)),
            num_prompts=_integer(
                "run.quality.num_prompts", given.get("num_prompts", defaults.num_prompts), 1
            ),
            prompt_len=_integer(
                "run.quality.prompt_len", given.get("prompt_len", defaults.prompt_len), 2
            ),
            text=text,
            prompt_sets=list(prompt_sets),
            min_margin=_number(
                "run.quality.min_margin",
                given.get("min_margin", defaults.min_margin),
                "a number >= 0",
            ),
        )


@dataclass(frozen=True)
class RunConfig:
    """The `run` section, validated once at the edge: an unknown key or a bad value is an
    error that names it and the allowed values, before anything is loaded or written."""

    name: str = "default"  # the run folder's name ends with it
    # skip a run (or sweep job) whose folder already holds a complete run, and run the others
    # again; without it a folder that holds a run is refused (harness/running/folder_guard.py)
    resume: bool = False
    # a sweep with a failed job exits 1 (so CI notices) unless this is true
    allow_failed_jobs: bool = False
    warmup_requests: int = 0  # run first, left out of every metric (config.yaml sets 2)
    # phase lines on stderr (loading, warm-up, running), then a bar on a terminal or, without
    # one (make, CI logs), a line every 5 s; False: silent until the summary
    progress: bool = True
    window: WindowConfig = field(default_factory=WindowConfig)  # docs/metrics.md
    # a background sampler -> samples.parquet, memory/energy metrics (docs/monitoring.md)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    # N > 1: the requests are sent from N client processes (engine=openai only), each with its
    # own connection pool and event loop (harness/running/clients.py, docs/scaling.md)
    num_clients: int = 1
    # where the clients run: local processes, or Ray tasks on the cluster `ray.init()` joins
    # (RAY_ADDRESS, else a local one), which connect back to this process over TCP
    clients_on: str = "processes"

    @classmethod
    def from_dict(cls, values: Any) -> RunConfig:
        given = _section("run", values, cls.__dataclass_fields__)
        defaults = cls()
        name = given.get("name", defaults.name)
        if isinstance(name, bool) or not isinstance(name, str | int) or name == "":
            raise ValueError(f"run.name: {name!r} is invalid; allowed: a non-empty string")
        return cls(
            name=str(name),
            resume=_flag("run.resume", given.get("resume", defaults.resume)),
            allow_failed_jobs=_flag(
                "run.allow_failed_jobs", given.get("allow_failed_jobs", defaults.allow_failed_jobs)
            ),
            warmup_requests=_integer(
                "run.warmup_requests", given.get("warmup_requests", defaults.warmup_requests), 0
            ),
            progress=_flag("run.progress", given.get("progress", defaults.progress)),
            window=WindowConfig.from_dict(given.get("window")),
            monitor=MonitorConfig.from_dict(
                _section("run.monitor", given.get("monitor"), MonitorConfig.__dataclass_fields__)
            ),
            quality=QualityConfig.from_dict(given.get("quality")),
            slo=SloConfig.from_dict(given.get("slo")),
            num_clients=_integer(
                "run.num_clients", given.get("num_clients", defaults.num_clients), 1
            ),
            clients_on=_choice(
                "run.clients_on", given.get("clients_on", defaults.clients_on), CLIENTS_ON
            ),
        )


CLIENTS_ON = ("processes", "ray")

#: the backends that `run.num_clients` > 1 can split over client processes: HTTP clients of a
#: server that every process can reach (an in-process engine would load N models)
MANY_CLIENT_BACKENDS = ("openai",)


def run_config(config: dict[str, Any]) -> RunConfig:
    """The `run` section, checked whole and against the engine and the workload's in-flight
    limits (`run.num_clients`)."""
    run_cfg = RunConfig.from_dict(config.get("run"))
    backend = (config.get("engine") or {}).get("backend", "builtin")
    if run_cfg.num_clients > 1 and backend not in MANY_CLIENT_BACKENDS:
        raise ValueError(
            f"engine.backend: {backend!r} cannot run with run.num_clients="
            f"{run_cfg.num_clients}; allowed: {'|'.join(MANY_CLIENT_BACKENDS)} (client "
            "processes of one server), or run.num_clients=1"
        )
    if run_cfg.num_clients > 1 and isinstance(config.get("workload"), dict):
        # here, before the server is asked or warmed up, not once the clients are due to start
        try:
            workload = make_workload(config["workload"])
        except ValueError:  # the run reports the workload's own error where it always did
            return run_cfg
        client_limits(
            getattr(workload, "concurrency", None),
            getattr(workload, "max_concurrency", None),
            run_cfg.num_clients,
            config["workload"],
        )
    return run_cfg


def make_workload(workload: dict[str, Any]) -> Any:
    """The validated workload dataclass for `workload.type`, built from its config keys."""
    return workloads.from_config(workload)


def warmup_requests(
    workload: Any, tokenizer: Any, context_len: int | None, count: int
) -> list[WorkloadRequest]:
    """The first `count` first-turn requests of the same workload, all due at once."""
    if count <= 0:
        return []
    built = [w for w in workload.build(tokenizer, context_len) if not w.follows][:count]
    return [
        replace(w, arrival_s=0.0, request=replace(w.request, request_id=f"warmup-{w.request_id}"))
        for w in built
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


def _backend_label(config: dict[str, Any]) -> str:
    engine, model = config.get("engine") or {}, config.get("model") or {}
    name = model.get("name") or model.get("path") or "?"
    return f"the {engine.get('backend', 'builtin')} backend, model {name}"


def _run(
    config: dict[str, Any], run_dir: Path, progress: bool, provenance_extra: dict[str, Any]
) -> dict[str, Any]:
    recorder = RunRecorder(run_dir)
    try:
        write_config(run_dir, config)
        write_provenance(run_dir, {**provenance.collect(config), **provenance_extra})
        recorder.write_summary({"status": "running"})
    except OSError:  # an unwritable folder: nothing ran, nothing claims to be running
        with suppress(OSError):
            recorder.close()
        raise
    run_cfg = RunConfig()  # until the config's own is read: the window and SLO defaults
    info: dict[str, Any]  # the summary's extra keys: JSON-like values
    status, error, info, backend = "complete", None, {}, None
    # until the workload is built: a ValueError is the configuration refused (an option out
    # of range, a checkpoint's config.json), not a failure of the run
    setting_up = True
    shown = RunProgress(progress)
    monitor: Monitor | None = None
    profiler: StepProfiler | ServerProfiler | None = None
    driver = None

    def failed_writing(exc: BaseException) -> None:
        # A run whose folder could not be written whole did not end well, whatever it ran.
        nonlocal status, error
        message = (
            "writing the run folder failed: "
            + "".join(traceback.format_exception_only(exc)).strip()
        )
        if status == "failed":
            info.setdefault("finalize_errors", []).append(message)
        else:
            status, error = "failed", message if error is None else f"{message} ({error})"

    try:
        with interrupts():
            run_cfg = run_config(config)
            if run_cfg.quality.enabled:
                from harness.measuring.quality import check_inputs

                check_inputs(asdict(run_cfg.quality))
            hardware_cfg = hardware.validate_config(config.get("hardware"))
            monitor_cfg = run_cfg.monitor
            profiler = profiler_from_config(config, run_dir)
            if monitor_cfg.enabled:
                monitor = Monitor(monitor_cfg.interval_s)
                monitor.mark_before_load()
            start = now_ns()
            shown.phase(f"loading {_backend_label(config)}")
            backend = build_backend(config["engine"], config["model"])
            backend.load()
            info["load_s"] = (now_ns() - start) / 1e9
            shown.phase(f"loaded in {info['load_s']:.1f} s")
            info["engine"] = backend.describe()
            # the threads as the engine set them at load (provenance.json predates the load)
            provenance.record_threads(run_dir)
            # after load: a CPU probe runs at the engine's thread count (cached per machine)
            info["hardware"] = hardware.describe_for_run(
                *hardware.resolve(hardware_cfg, info["engine"].get("device"))
            )
            if monitor is not None:  # after the probe, whose buffers are no part of the run
                watch_servers(monitor, monitor_cfg, info["engine"].get("metrics_url"))
                monitor.start(gpu_index_for(info["engine"].get("device")))
            tokenizer = getattr(backend, "tokenizer", None)
            context_len = info["engine"].get("max_model_len")
            workload = make_workload(config["workload"])
            requests = workload.build(tokenizer, context_len)
            setting_up = False
            info["workload"] = dict(getattr(workload, "info", {}) or {})
            first_steps: list[dict[str, Any]] = []

            def keep_first_step(table: str, row: dict[str, Any]) -> None:
                if table == "steps" and not first_steps:
                    first_steps.append(row)

            warm = warmup_requests(
                make_workload(config["workload"]), tokenizer, context_len, run_cfg.warmup_requests
            )
            if warm:
                shown.phase(f"warm-up: {len(warm)} requests")
                Driver(backend, keep_first_step).run(warm)
            shown.start_requests(len(requests))
            sink = _tee(recorder.append, keep_first_step)
            driver = (
                ClientPool(
                    config,
                    run_cfg.num_clients,
                    backend,
                    sink,
                    lambda _: shown.request_done(),
                    on_ray=run_cfg.clients_on == "ray",
                )
                if run_cfg.num_clients > 1
                else Driver(backend, sink, on_request_done=lambda _: shown.request_done())
            )
            concurrency = getattr(workload, "concurrency", None)
            max_concurrency = getattr(workload, "max_concurrency", None)
            info["closed_loop"] = concurrency is not None
            info["workload"]["max_concurrency"] = max_concurrency
            if profiler is not None and info["engine"].get("base_url"):
                # a server backend: its engine is in another process, which profiles itself
                profiler = ServerProfiler(server_root(info["engine"]["base_url"]))
            if profiler is not None:
                profiler.attach(backend, cuda=str(info["engine"].get("device")).startswith("cuda"))
            backend.start_measuring()
            if monitor is not None:  # the server's counters here leave the warm-up out
                monitor.sample_now()
            with heap.frozen():
                driver.run(requests, concurrency=concurrency, max_concurrency=max_concurrency)
            failure = backend.failure()
            if failure is not None:  # the requests after it failed one by one; so does the run
                raise RuntimeError(f"the backend failed during the run: {failure}")
            info["harness_overhead_fraction"] = driver.overhead_fraction
            if run_cfg.quality.enabled and isinstance(backend, BuiltinBackend):
                from engines.builtin import LLM
                from harness.measuring.quality import run_quality

                assert backend.engine is not None
                info["quality"] = run_quality(
                    backend.config.to_dict(),
                    LLM.from_engine(backend.engine),
                    asdict(run_cfg.quality),
                )
            elif run_cfg.quality.enabled and hasattr(backend, "prompt_logits"):
                # a backend that gives logits itself (engine=llamacpp), against the built-in
                # engine's float32 on the same model file
                from harness.measuring.quality import LogitsBackend, run_quality_of_backend

                assert isinstance(backend, LogitsBackend)
                info["quality"] = run_quality_of_backend(backend, asdict(run_cfg.quality))
            if first_steps:
                step = first_steps[0]
                info["first_step_s"] = step["end_s"] - step["start_s"]
                info["cold_start_s"] = info["load_s"] + info["first_step_s"]
    except KeyboardInterrupt as exc:
        status, error = "incomplete", interruption(exc)
    except Exception as exc:  # recorded, then re-raised by the caller if it wants
        status, error = "failed", "".join(traceback.format_exception_only(exc)).strip()
        # a path the configuration names that is not there (a checkpoint folder without its
        # config.json, a trace file) is a configuration error like a value out of range
        if setting_up and isinstance(exc, ValueError | FileNotFoundError):
            info["error_kind"] = "config"
            # its message names the key or file and what is allowed, as the errors refused
            # while composing do; the exception's class is no news to the user
            error = str(exc) or error
        info["traceback"] = traceback.format_exc()
    finally:
        # Each clean-up step is guarded: whatever fails, the rows are kept and summary.json
        # is written, with the failure named under `finalize_errors`.
        # A step that writes files and hits an OSError (a full disk) fails the run too.
        def guarded(name: str, action: Any, writes: bool = False) -> Any:
            try:
                return action()
            except Exception as exc:
                info.setdefault("finalize_errors", []).append(f"{name}: {exc!r}")
                if writes and isinstance(exc, OSError):
                    failed_writing(exc)
                return None

        if isinstance(driver, ClientPool):  # also after a client died or Ctrl-C
            info.update(driver.info)
        if profiler is not None:
            info["profile"] = guarded("profiler", profiler.finish, writes=True)
        if monitor is not None:
            guarded("monitor", monitor.stop)
        shown.close()
        if backend is not None:
            if "engine" in info:  # counters some backends keep updating during the run
                info["engine"] = guarded("describe", backend.describe) or info["engine"]
            guarded("backend.close", backend.close)
        try:
            frames = recorder.finalize()
        except TablesNotWritten as exc:  # readers fall back to the JSONL rows
            frames = exc.frames
            failed_writing(exc.cause)
        if monitor is not None:  # samples on the run's clock: seconds since the driver's t0
            info["samples"] = guarded(
                "samples",
                lambda: monitor.write(run_dir, driver.t0 if driver is not None else None),
                writes=True,
            )
            info["monitor"] = guarded("monitor", monitor.info)
            info["server_series"] = monitor.server_series
        try:
            frames["steps"] = roofline.annotate_run(run_dir, frames["steps"], info)
        except Exception as exc:
            info.setdefault("finalize_errors", []).append(f"roofline: {exc!r}")
            if isinstance(exc, OSError):  # steps.parquet may be torn mid-rewrite
                failed_writing(exc)
                with suppress(OSError):  # readers fall back to steps.jsonl, the same rows
                    table_path(run_dir, "steps", "parquet").unlink(missing_ok=True)
        requests = frames["requests"]
        if status == "complete" and len(requests) and (requests["status"] == "failed").all():
            first = requests.iloc[0]
            status, error = (
                "failed",
                (
                    f"every measured request failed ({len(requests)} of {len(requests)}); the "
                    f"first, {first['request_id']}: {first['error']}"
                ),
            )
        summary = {
            "status": status,
            "error": error,
            **summarize(frames, info, asdict(run_cfg.slo), run_cfg.window),
            "run_dir": str(run_dir),
            **{
                k: v
                for k, v in info.items()
                if k
                not in (
                    "load_s",
                    "cold_start_s",
                    "harness_overhead_fraction",
                    "samples",
                    "server_series",
                )
            },
        }
        summary = _write_final_summary(recorder, summary)
    return summary


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
