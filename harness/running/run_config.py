"""The `run` section of an experiment's config, declared once: its options (`RunConfig`, with
its sub-sections `run.slo`, `run.search`, `run.quality`, ...), each with its type, default,
allowed values and help, checked once at the edge and against the workload's in-flight limits
(`run_config`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import workloads
from engines.options import option
from harness.config_section import ConfigSection, holds_a_float
from harness.measuring.checks import Check, contradictions, parse_checks
from harness.measuring.metrics import (
    DEFAULT_PERCENTILES,
    LATENCY_FAMILIES,
    PERCENTILE_DECIMALS,
    family_stats,
    percentile_stat,
    stat_percentile,
)
from harness.measuring.monitors import MonitorConfig
from harness.running.capacity_search import ANSWER_KEY, OVER, SearchSettings
from harness.running.clients import client_limits
from harness.running.driver import MAX_ERRORS_MIN_FINISHED, RunBounds
from harness.running.saturation import SaturationConfig
from harness.running.window import WindowConfig


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
class AccuracyConfig(ConfigSection):
    """`run.accuracy`: an lm-eval task (multiple_choice or generate_until) scored on the run's
    backend after its measured requests (harness/measuring/accuracy.py, docs/accuracy.md)."""

    section = "run.accuracy"

    task: str | None = option(
        None,
        allowed="null, a task of data/tasks (inferlab_mc, inferlab_gen) or the path of an "
        "lm-eval task YAML (output_type multiple_choice or generate_until)",
        help="the task whose accuracy becomes the run's `accuracy` metric (null: none)",
    )
    limit: int | None = option(None, ge=1, help="the task's first items only (null: all)")
    apply_chat_template: bool = option(
        False,
        help="lm-eval's --apply_chat_template: each context is a user message under the "
        "model's chat template (generate_until: sent as chat messages through the backend's "
        "own prompt path; multiple_choice: rendered by the backend's tokenizer, no delimiter "
        "before the choice)",
    )


@dataclass(frozen=True)
class QualityConfig(ConfigSection):
    """`run.quality`: the quality probe (harness/measuring/quality.py), this engine against the
    fp32 unquantized one on the same weights (or on `reference_model`'s)."""

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
    reference_model: str | None = option(
        None,
        allowed="null or a model name, checkpoint folder or .gguf file of the same tokenizer",
        help="the reference's weights (float32, unquantized); null: the measured model's own, "
        "dequantized; e.g. smollm2-135m-f16, the file the K-quant mixes were made from",
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
    accuracy: AccuracyConfig = option(
        default_factory=AccuracyConfig, help="a task's accuracy beside the speed"
    )
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
        if self.search.enabled:
            for check in self.search.checks:
                why = unmeasured(check.metric, self.percentiles, self.slo)
                if why:
                    raise self.error(f"run.search.slo: {check}: {why}")

    @property
    def bounds(self) -> RunBounds:
        """What the driver stops on."""
        return RunBounds(
            max_duration_s=self.max_duration_s,
            grace_s=self.max_duration_grace_s,
            max_errors=self.max_errors,
            saturation=self.saturation if self.stop_on_saturation else None,
        )


#: the metrics `run.slo`'s bounds define: a run has them only where one of those is set
SLO_METRICS = ("slo_attainment", "goodput_req_per_s")


def unmeasured(metric: str, percentiles: list[float], slo: SloConfig) -> str | None:
    """Why no run of this configuration will hold `metric` in its summary (its check could
    only ever miss, as "no value"), else None: the search's own answers (a sweep's, not a
    run's), SLO figures without a `run.slo` bound, a percentile `run.percentiles` leaves out."""
    if metric in ANSWER_KEY.values():
        return (
            "is the capacity search's answer (the sweep's), not a run's metric; allowed: a "
            "run's metric, e.g. ttft_p99_s, tpot_p99_s, slo_attainment"
        )
    if metric in SLO_METRICS and all(
        getattr(slo, key) is None for key in ("ttft_s", "tpot_s", "e2e_s")
    ):
        return (
            f"a run has {metric} only under a per-request bound; allowed: with run.slo.ttft_s, "
            "run.slo.tpot_s or run.slo.e2e_s set"
        )
    match = re.fullmatch(r"([a-z0-9]+)_(p\d+)_s", metric)
    family = LATENCY_FAMILIES.get(match[1]) if match else None
    if match and family and match[2] not in family_stats(family, percentiles):
        q = stat_percentile(match[2])
        listed = ", ".join(f"{p:g}" for p in percentiles)
        return (
            f"run.percentiles [{listed}] has no {q:g}, so no run measures {metric}; "
            f"allowed: a percentile of run.percentiles, or add {q:g} to it"
        )
    return None


#: the backends that `run.num_clients` > 1 can split over client processes: HTTP clients of a
#: server that every process can reach (an in-process engine would load N models)
MANY_CLIENT_BACKENDS = ("openai",)


def run_config(config: dict[str, Any]) -> RunConfig:
    """The `run` section, checked whole and against the engine and the workload's in-flight
    limits (`run.num_clients`)."""
    return checked_run(config)[0]


def checked_run(config: dict[str, Any]) -> tuple[RunConfig, Any]:
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
