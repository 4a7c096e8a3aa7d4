"""`profile=true`: torch.profiler over a window of engine steps, a Chrome trace, and the top
operators per step phase (prefill / decode / mixed).

The profiler is stepped by the backend's step observer (one call after every engine step of
the measured run), so its schedule counts engine steps: skip `start_step` steps, spend one
step warming the profiler up (its start-up cost would skew the first traced step), record
`num_steps`. The engine names each step's model execution `step:<phase>` with
`torch.profiler.record_function` while a profiler is on; an operator belongs to the phase of
the step annotation it runs under. Outputs go to `<run>/profile/` (docs/monitoring.md).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from engines.base import Backend, StepRecord
from engines.openai.server_metrics import server_root
from engines.options import option
from harness.config_section import ConfigSection
from harness.measuring.server_profile import ServerProfiler
from harness.measuring.trackers import Tracker
from harness.run_folder import PROFILE_DIR

PHASES = ("prefill", "decode", "mixed")
STEP_PREFIX = "step:"  # the engine's record_function names: step:prefill, step:decode, ...
OUTSIDE = "outside_step"  # operators traced outside any engine step's model execution
UNTRACED = "(step time outside any operator)"  # a step's own time minus its operators'
WARMUP_STEPS = 1
OPS_COLUMNS = [
    "phase",
    "phase_steps",
    "rank",
    "name",
    "calls",
    "self_cpu_s",
    "self_cpu_share",
    "self_device_s",
    "self_device_share",
]


@dataclass(frozen=True)
class ProfileConfig(ConfigSection):
    section = "profiling"

    start_step: int = option(2, ge=0, help="measured-run steps before the profiler's warm-up step")
    num_steps: int = option(16, ge=1, help="steps recorded")
    record_shapes: bool = option(False, help="torch.profiler's record_shapes")
    with_stack: bool = option(False, help="torch.profiler's with_stack")
    top_k: int = option(20, ge=1, help="operators per phase in the tables")


def profiler_from_config(config: dict[str, Any], run_dir: str | Path) -> StepProfiler | None:
    """The profiler `profile=true` asks for (None when off); validates `profiling`."""
    enabled = config.get("profile", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"profile: {enabled!r} is invalid; allowed: true|false")
    cfg = ProfileConfig.from_dict(config.get("profiling"))
    return StepProfiler(cfg, Path(run_dir) / PROFILE_DIR) if enabled else None


def step_phase(num_prefill_seqs: int, num_decode_seqs: int) -> str:
    if num_prefill_seqs and num_decode_seqs:
        return "mixed"
    return "prefill" if num_prefill_seqs else "decode"


class StepProfiler:
    """torch.profiler driven by engine steps. `attach` starts it and subscribes to the steps;
    `finish` stops it (also mid-window, for a short or interrupted run) and writes the outputs."""

    def __init__(self, cfg: ProfileConfig, out_dir: Path) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.cuda = False
        self.steps_seen = 0
        self.recorded: list[tuple[int, str]] = []  # (engine step, phase) inside the window
        self._observers: list[Any] | None = None
        self._prof: profile | None = None
        self._ready = False
        self.info: dict[str, Any] = {}

    @property
    def _first_recorded(self) -> int:
        return self.cfg.start_step + WARMUP_STEPS

    def attach(self, target: Backend | list[Any], cuda: bool = False) -> None:
        """Start the profiler and observe the steps of `target` (a backend or an observer
        list such as LLMEngine.step_observers); `cuda` adds the CUDA activity (kernels)."""
        self.cuda = cuda
        observers = target.step_observers if isinstance(target, Backend) else target
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(
                wait=self.cfg.start_step, warmup=WARMUP_STEPS, active=self.cfg.num_steps, repeat=1
            ),
            on_trace_ready=self._on_trace_ready,
            record_shapes=self.cfg.record_shapes,
            with_stack=self.cfg.with_stack,
        )
        self._prof.start()
        observers.append(self.on_step)
        self._observers = observers

    def on_step(self, record: StepRecord) -> None:
        index = self.steps_seen
        self.steps_seen += 1
        if self._first_recorded <= index < self._first_recorded + self.cfg.num_steps:
            self.recorded.append(
                (record.step, step_phase(record.num_prefill_seqs, record.num_decode_seqs))
            )
        if self._prof is not None and not self._ready:
            self._prof.step()

    def finish(self) -> dict[str, Any]:
        """Stop (also mid-window: a short or interrupted run keeps what was recorded), write
        the outputs, and return facts for summary.json. Writing waits until here so that it
        never stalls an engine step of the run."""
        if self._observers is not None and self.on_step in self._observers:
            self._observers.remove(self.on_step)
        prof, self._prof = self._prof, None
        if prof is None:
            self.info = {"note": "not started: the run stopped before its measured requests"}
        try:
            if prof is not None:
                prof.stop()  # a window cut short reaches _on_trace_ready here
            if self._ready and prof is not None:
                self._write(prof)
            elif prof is not None:
                self.info = {
                    "note": f"no step profiled: the run had {self.steps_seen} engine "
                    f"steps; the window starts at step {self._first_recorded} "
                    f"(profiling.start_step={self.cfg.start_step} + "
                    f"{WARMUP_STEPS} warm-up)"
                }
        except Exception as exc:  # never lose the run's summary to the profiler
            self.info = {"error": f"profile not written: {type(exc).__name__}: {exc}"}
        return self.info

    def _on_trace_ready(self, prof: profile) -> None:
        self._ready = True  # runs inside an engine step: the writing waits for finish()

    def _write(self, prof: profile) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "trace.json.gz"
        prof.export_chrome_trace(str(trace))
        phase_steps = {p: sum(1 for _, q in self.recorded if q == p) for p in PHASES}
        table = operator_table(prof.events(), phase_steps, self.cfg.top_k)
        table.to_csv(self.out_dir / "ops.csv", index=False)
        (self.out_dir / "ops.md").write_text(markdown(table, phase_steps, self.recorded))
        # paths relative to the run folder, which may move
        self.info = {
            "dir": self.out_dir.name,
            "trace": f"{self.out_dir.name}/{trace.name}",
            "steps": [step for step, _ in self.recorded],
            "phase_steps": phase_steps,
            "activities": ["cpu"] + (["cuda"] if self.cuda else []),
        }


class ProfileTracker(Tracker):
    """`profile=true`: the profiler over the measured run, into profile/ and summary.json's
    `profile`. A backend whose engine steps in this process is traced here (StepProfiler); a
    server's engine, in another process, profiles itself (ServerProfiler)."""

    name = "profiler"

    def __init__(self, profiler: StepProfiler) -> None:
        self.profiler: StepProfiler | ServerProfiler = profiler
        self.info: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], run_dir: str | Path) -> ProfileTracker | None:
        profiler = profiler_from_config(config, run_dir)
        return cls(profiler) if profiler is not None else None

    def start(self, backend: Backend, engine: dict[str, Any]) -> None:
        if not backend.capabilities.in_process:
            self.profiler = ServerProfiler(server_root(engine["base_url"]))
        self.profiler.attach(backend, cuda=str(engine.get("device")).startswith("cuda"))

    def close(self) -> None:
        self.info = self.profiler.finish()

    def results(self, run_dir: Path, t0_ns: int | None) -> dict[str, Any]:
        return {"profile": self.info}


def _phase_of(event: Any) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(STEP_PREFIX):
            return parent.name[len(STEP_PREFIX) :]
        parent = parent.cpu_parent
    return OUTSIDE


def operator_table(events: Any, phase_steps: dict[str, int], top_k: int) -> pd.DataFrame:
    """Per phase, the operators with the most self time (device time where a device ran,
    else CPU), from the profiler's events; one tidy frame (OPS_COLUMNS)."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for event in events:
        if getattr(event, "device_type", None) not in (None, torch.autograd.DeviceType.CPU):
            continue  # kernels: counted as their launching operator's self device time
        name = event.name
        if name.startswith("ProfilerStep"):
            continue
        if name.startswith(STEP_PREFIX):
            phase, name = name[len(STEP_PREFIX) :], UNTRACED
        else:
            phase = _phase_of(event)
        entry = totals[(phase, name)]
        entry[0] += 1
        entry[1] += event.self_cpu_time_total / 1e6  # profiler times are microseconds
        entry[2] += getattr(event, "self_device_time_total", 0.0) / 1e6
    rows = []
    for phase in (*PHASES, OUTSIDE):
        ops: list[tuple[str, float, float, float]] = [
            (name, v[0], v[1], v[2]) for (p, name), v in totals.items() if p == phase
        ]
        if not ops:
            continue
        cpu_total = sum(op[2] for op in ops) or 1.0
        device_total = sum(op[3] for op in ops)
        key: Literal[2, 3] = 3 if device_total > 0 else 2
        ops.sort(key=lambda op: op[key], reverse=True)
        for rank, (name, calls, self_cpu, self_device) in enumerate(ops[:top_k], start=1):
            rows.append(
                {
                    "phase": phase,
                    "phase_steps": phase_steps.get(phase, 0),
                    "rank": rank,
                    "name": name,
                    "calls": int(calls),
                    "self_cpu_s": self_cpu,
                    "self_cpu_share": self_cpu / cpu_total,
                    "self_device_s": self_device,
                    "self_device_share": self_device / device_total if device_total else None,
                }
            )
    return pd.DataFrame(rows, columns=OPS_COLUMNS)


def markdown(
    table: pd.DataFrame, phase_steps: dict[str, int], recorded: list[tuple[int, str]]
) -> str:
    steps = [step for step, _ in recorded]
    span = f"engine steps {steps[0]}-{steps[-1]}" if steps else "no engine steps"
    lines = [
        f"# Top operators per phase ({span})",
        "",
        "Self time: an operator's time minus its children's. "
        f"`{UNTRACED}` is Python and bookkeeping in the step's model execution.",
        "",
    ]
    for phase, rows in table.groupby("phase", sort=False):
        count = phase_steps.get(str(phase), 0)
        lines += [
            f"## {phase} ({count} steps)" if phase != OUTSIDE else f"## {phase}",
            "",
            "| # | operator | calls | self CPU ms | CPU share | self device ms |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for row in rows.itertuples():
            lines.append(
                f"| {row.rank} | `{row.name}` | {row.calls} | "
                f"{_ms(row.self_cpu_s)} | {row.self_cpu_share:.1%} | "
                f"{_ms(row.self_device_s) if row.self_device_share else '-'} |"
            )
        lines.append("")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"
