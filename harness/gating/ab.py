"""`inferlab gate ab`: run a baseline (A) and a candidate (B) configuration interleaved in one
job, then gate on the paired per-round ratios (docs/gate.md).

Rounds alternate which side goes first (round k: A then B when k is even, B then A when k is
odd), so a drift in machine speed, or an advantage of running second, falls on both sides
equally. Each run is a normal run folder (round-<k>-a/, round-<k>-b/); ab.json records the
plan, every round with its paired ratios, and the verdict, and is rewritten after each round.

Isolation: each side runs in its own long-lived worker process (harness.gating.ab_worker), started
once. A and B never share a process, so nothing one configuration leaves behind (torch's
global thread count, allocator and kernel caches, imported modules) can reach the other, yet
the start-up cost (interpreter and torch import, seconds on a small CPU) is paid once per side
instead of once per run. A warm-up round (not gated) runs first in each worker, so round 0 is
not the first run in a process. `--isolation process` starts a fresh process for every run
instead: cleaner still, but every run is then a cold first run, slower and noisier.

Code: by default both sides run this checkout and differ only in their overrides. With
--baseline-code / --candidate-code each side's worker imports its runs' code from, and
composes its configuration from the configs/ of, another checkout (e.g. a worktree of the main
branch against the pull request): A/B across code versions, with the same interpreter.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TypeGuard, cast

import configs
import engines.backends  # noqa: F401  (the engine groups' schemas, for compose)
import workloads  # noqa: F401  (the workload groups' schemas, for compose)
from harness import SOURCE_ROOT, source_env
from harness.gating.inputs import is_number, read_run
from harness.gating.rules import GateRules, RulesError, add_require_argument, load_rules
from harness.measuring.metrics import REGISTRY
from harness.run_folder import (
    AB_FILE,
    RunFileRefused,
    UnreadableFile,
    ab_round_dir,
    refuse_run_file,
    write_json_atomic,
)
from harness.running import config_schema  # noqa: F401  (the run section's, for compose)
from harness.running.interrupts import interrupts
from harness.running.launching import (
    LAUNCHER_EXTRAS,
    missing_launcher,
    ray_cluster_overrides,
    ray_connection_hint,
)
from models.files import UserFileError, given_output_path

MIN_ROUNDS = 9
ISOLATION = ("worker", "process")
WORKER_SOURCE = Path(__file__).with_name("ab_worker.py")
COMPOSER_SOURCE = Path(__file__).with_name("ab_compose.py")


class ABError(ValueError):
    """The A/B plan cannot run: a bad flag or configuration."""


@dataclass
class ABPlan:
    baseline: list[str]
    candidate: list[str]
    common: list[str]
    rounds: int
    out: Path
    warmup_rounds: int = 1
    isolation: str = "worker"
    baseline_code: Path = SOURCE_ROOT  # the checkout each side's runs import (and compose from)
    candidate_code: Path = SOURCE_ROOT
    launcher: str | None = None  # a Hydra launcher that runs the rounds as jobs (ab_rounds.py)
    launcher_options: list[str] = field(default_factory=list)  # its overrides (hydra.launcher.*)

    def code(self, side: str) -> Path:
        return self.baseline_code if side == "a" else self.candidate_code

    def to_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ABPlan:
        paths = ("out", "baseline_code", "candidate_code")
        fields: dict[str, Any] = {k: Path(v) if k in paths else v for k, v in data.items()}
        return cls(**fields)


PLAN_FILE = "ab_plan.json"
LAUNCHER_FOLDER = "launcher"  # the Hydra multirun's own folder and log, inside the A/B folder


def round_file(out: Path, k: int) -> Path:
    """Round k's record, written by the job that ran it under a launcher."""
    return out / f"round-{k}.json"


def compose_config(overrides: list[str], code: Path = SOURCE_ROOT) -> dict[str, Any]:
    """The run configuration `inferlab run <overrides>` would get in the checkout `code`
    (Hydra's compose API over code/configs, config_name "config")."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    config_dir = Path(code).resolve() / "configs"
    if not (config_dir / "config.yaml").is_file():
        raise ABError(f"{code}: not an inferlab checkout (no configs/config.yaml)")
    if Path(code).resolve() != SOURCE_ROOT:  # its groups' schemas are its own dataclasses
        return _compose_in_checkout(overrides, Path(code))
    try:
        cfg = configs.compose(overrides, config_dir)
        # a composed DictConfig's container: a dict with the YAML's str keys
        config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    except (configs.ComposeError, OmegaConfBaseException) as exc:
        raise ABError(f"overrides {overrides}: {exc}") from exc
    assert isinstance(config, dict)
    return config


def _compose_in_checkout(overrides: list[str], code: Path) -> dict[str, Any]:
    """compose_config in a process importing the checkout `code` (gating/ab_compose.py)."""
    done = subprocess.run(
        [sys.executable, "-c", COMPOSER_SOURCE.read_text(), str(code), json.dumps(overrides)],
        capture_output=True,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ABError(f"{code}: composing {overrides} there failed: {last}")
    reply = json.loads(lines[-1])
    if "error" in reply:
        raise ABError(f"overrides {overrides}: {reply['error']}")
    return cast(dict[str, Any], reply["config"])


def precheck(config: dict[str, Any], side: str) -> None:
    """Refuse a configuration that could only fail, before any round runs."""
    from engines.builtin.config import EngineConfig
    from harness.running.run_config import make_workload

    if int(config.get("repeats", 1) or 1) != 1:
        raise ABError(
            f"--{side}: repeats={config['repeats']}: the A/B rounds are the repeats; "
            "drop the repeats override"
        )
    engine = dict(config["engine"])
    try:
        if engine.pop("backend", "builtin") == "builtin":
            EngineConfig.from_dict({**engine, "model": "tiny"})  # the model resolves at load
        make_workload(config["workload"])
    except ValueError as exc:
        raise ABError(f"--{side}: {exc}") from exc


class Worker:
    """One side's process: started once (or per run with isolation=process)."""

    def __init__(self, side: str, log_path: Path, code: Path) -> None:
        self.side, self.log_path, self.code = side, log_path, code
        self.process: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None

    def start(self) -> None:
        self._log = self.log_path.open("a")
        # The worker's source runs with -c, so the side's checkout need not have it.
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER_SOURCE.read_text(), str(self.code)],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )

    def wait_ready(self) -> None:
        reply = self._read()
        if not reply.get("ready"):
            raise ABError(f"worker {self.side} did not start: {reply.get('error')}")

    def run(self, config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps({"config": config, "run_dir": str(run_dir)}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return self._died()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            return self._died()
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict):  # something wrote to the reply channel
            return {
                "status": "failed",
                "wall_s": None,
                "error": f"worker {self.side} replied {line[:200]!r}, not a JSON object; "
                f"see {self.log_path}",
            }
        return reply

    def _died(self) -> dict[str, Any]:
        assert self.process is not None
        code = self.process.wait()
        return {
            "status": "failed",
            "wall_s": None,
            "error": f"worker {self.side} exited with code {code}; see {self.log_path}",
        }

    def close(self) -> None:
        if self.process is not None:
            if self.process.stdin is not None:
                self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None


def round_order(k: int) -> tuple[str, str]:
    return ("a", "b") if k % 2 == 0 else ("b", "a")


def paired_ratios(a_dir: Path, b_dir: Path) -> dict[str, float]:
    """candidate / baseline for every timing metric both runs have (positive) values for."""

    def metrics(path: Path) -> dict[str, Any]:
        try:
            return read_run(path).metrics
        except UnreadableFile:  # the gate at the end names the file; the log line just omits it
            return {}

    def usable(value: Any) -> TypeGuard[float]:
        return is_number(value) and math.isfinite(value) and value > 0

    ma, mb = metrics(a_dir), metrics(b_dir)
    out = {}
    for name, metric in REGISTRY.items():
        va, vb = ma.get(name), mb.get(name)
        if metric.kind == "timing" and usable(va) and usable(vb):
            out[name] = vb / va
    return out


class ABRunner:
    def __init__(
        self,
        plan: ABPlan,
        rules: GateRules,
        log: IO[str] | None = None,
        configs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """`configs`: each side's composed configuration, when composed already (a round job
        of a launcher runs inside a Hydra app, where Hydra cannot compose again)."""
        self.plan, self.rules, self.log = plan, rules, log
        self.configs = configs or {
            "a": compose_config([*plan.common, *plan.baseline], plan.baseline_code),
            "b": compose_config([*plan.common, *plan.candidate], plan.candidate_code),
        }
        for side, name in (("a", "baseline"), ("b", "candidate")):
            if plan.code(side).resolve() == SOURCE_ROOT:  # another checkout's options may differ
                precheck(self.configs[side], name)
        self.workers = {
            side: Worker(side, plan.out / f"worker-{side}.log", plan.code(side)) for side in "ab"
        }
        self.record: dict[str, Any] = {
            "version": 1,
            "status": "running",
            "baseline_overrides": plan.baseline,
            "candidate_overrides": plan.candidate,
            "common_overrides": plan.common,
            "baseline_code": str(plan.baseline_code),
            "candidate_code": str(plan.candidate_code),
            "rounds_planned": plan.rounds,
            "warmup_rounds": plan.warmup_rounds,
            "isolation": plan.isolation,
            "identical_configs": self.configs["a"] == self.configs["b"],
            "order": "round k runs a then b when k is even, b then a when k is odd",
            "ratio": "candidate (b) / baseline (a), per round",
            "warmup": [],
            "rounds": [],
            "rules": rules.to_dict(),
        }

    def _run(self, side: str, run_dir: Path) -> dict[str, Any]:
        worker = self.workers[side]
        if self.plan.isolation == "process":
            worker.start()
            worker.wait_ready()
        reply = worker.run(self.configs[side], run_dir)
        if self.plan.isolation == "process":
            worker.close()
        return reply

    def _round(self, k: int, prefix: str) -> dict[str, Any]:
        order = round_order(k)
        entry: dict[str, Any] = {"round": k, "order": list(order)}
        for side in order:
            run_dir = ab_round_dir(self.plan.out, k, side, prefix)
            reply = self._run(side, run_dir)
            entry[side] = run_dir.name
            entry[f"{side}_status"] = reply["status"]
            entry[f"{side}_wall_s"] = reply.get("wall_s")
            if reply.get("error"):
                entry[f"{side}_error"] = reply["error"]
            if reply["status"] != "complete":
                break
        if entry.get("a_status") == entry.get("b_status") == "complete":
            entry["ratios"] = paired_ratios(self.plan.out / entry["a"], self.plan.out / entry["b"])
        return entry

    def _save(self) -> None:
        write_json_atomic(self.plan.out / AB_FILE, self.record)

    def _say(self, text: str) -> None:
        print(f"[gate ab] {text}", file=self.log or sys.stderr, flush=True)

    def run(self) -> int:
        """Warm-up rounds, then the rounds; returns the exit code (0, 1, 2; 130 if stopped)."""
        from harness.gating.cli import emit, gate_ab_dir

        plan = self.plan
        self._save()
        try:
            with interrupts():  # SIGTERM stops the job as Ctrl-C does
                stopped = self._run_launched() if plan.launcher else self._run_in_turn()
            if stopped is not None:
                return stopped
        except ABError as exc:  # a worker that cannot start
            self.record.update(status="stopped", stop_reason=str(exc))
            self._save()
            raise
        except KeyboardInterrupt:
            self.record["status"] = "incomplete"
            self._save()
            self._say(f"interrupted; the finished rounds are in {plan.out}")
            return 130
        finally:
            self._close_workers()
        result = gate_ab_dir(plan.out, self.rules)
        self.record.update(
            status="complete",
            verdict=result.verdict,
            exit_code=result.exit_code,
            result=result.to_dict(),
        )
        self._save()
        return emit(result, str(plan.out / "gate.md"), None, title="inferlab gate ab")

    def _start_workers(self) -> None:
        if self.plan.isolation == "worker":
            for worker in self.workers.values():
                worker.start()
            for worker in self.workers.values():
                worker.wait_ready()

    def _close_workers(self) -> None:
        for worker in self.workers.values():
            worker.close()

    def _run_in_turn(self) -> int | None:
        plan = self.plan
        self._start_workers()
        for k in range(plan.warmup_rounds):
            entry = self._round(k, "warmup")
            self.record["warmup"].append(entry)
            self._save()
            if stopped := self._stopped(entry, "warm-up"):
                return stopped
        for k in range(plan.rounds):
            start = time.perf_counter()
            entry = self._round(k, "round")
            self.record["rounds"].append(entry)
            self._save()
            self._say_round(entry, time.perf_counter() - start)
            if stopped := self._stopped(entry, f"round {k}"):
                return stopped
        return None

    def _say_round(self, entry: dict[str, Any], wall_s: float) -> None:
        ratio = entry.get("ratios", {}).get("output_tok_per_s")
        self._say(
            f"round {entry['round'] + 1}/{self.plan.rounds} ({''.join(entry['order'])}, "
            f"{wall_s:.1f} s): a {entry.get('a_status')}, b {entry.get('b_status')}"
            + (f", output_tok_per_s b/a = {ratio:.3f}" if ratio else "")
        )

    def run_one_round(self, k: int) -> dict[str, Any]:
        """Round k alone, as a launcher's job runs it: this job's own workers, its warm-up runs
        (warmup-<k * W + w>-<side>), then the round. Returns {"warmup": [...], "round": ...}."""
        plan = self.plan
        for side, worker in self.workers.items():  # rounds run side by side: a log each
            worker.log_path = plan.out / f"worker-{side}-round-{k}.log"
        try:
            self._start_workers()
            warmups = []
            for w in range(plan.warmup_rounds):
                warmups.append(self._round(k * plan.warmup_rounds + w, "warmup"))
                if self._failed(warmups[-1]):
                    return {"warmup": warmups, "round": None}
            return {"warmup": warmups, "round": self._round(k, "round")}
        finally:
            self._close_workers()

    @staticmethod
    def _failed(entry: dict[str, Any]) -> bool:
        return any(entry.get(f"{side}_status") not in (None, "complete") for side in "ab")

    def _run_launched(self) -> int | None:
        """Every round as a job of the launcher (ab_rounds.py), then their records in order."""
        plan = self.plan
        plan_file = plan.out / PLAN_FILE
        write_json_atomic(plan_file, {"plan": plan.to_json(), "configs": self.configs})
        rounds = ",".join(str(k) for k in range(plan.rounds))
        command = [
            sys.executable, "-m", "harness.gating.ab_rounds", "-m",
            f"hydra/launcher={plan.launcher}", *plan.launcher_options,
            *ray_cluster_overrides(plan.launcher, plan.launcher_options),
            f"plan={plan_file}", f"round={rounds}",
            f"hydra.sweep.dir={plan.out / LAUNCHER_FOLDER}",
        ]  # fmt: skip
        self._say(f"{plan.rounds} rounds as jobs of hydra/launcher={plan.launcher}")
        start = time.perf_counter()
        log_path = plan.out / f"{LAUNCHER_FOLDER}.log"
        with log_path.open("w") as log:
            launcher = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=source_env()
            )
            try:
                returncode = launcher.wait()
            except KeyboardInterrupt:
                _stop_launcher(launcher)
                raise
        self._say(
            f"the launcher ended (exit code {returncode}, {time.perf_counter() - start:.1f} s)"
        )
        if returncode != 0 and not any(
            round_file(plan.out, k).exists() for k in range(plan.rounds)
        ):
            # no round ran: a bad --launcher-options, or a launcher that cannot start; no run
            # failed, so no side is blamed
            error = _launcher_error(log_path)
            hint = ray_connection_hint(error) if plan.launcher == "ray" else ""
            raise ABError(
                f"--launcher {plan.launcher}: the launcher ran no round (exit code {returncode})"
                f": {error}{hint} (see {log_path})"
            )
        for k in range(plan.rounds):
            try:
                result = json.loads(round_file(plan.out, k).read_text())
            except (OSError, ValueError):
                result = {"warmup": [], "round": None}
            self.record["warmup"] += result["warmup"]
            entry = result["round"]
            if entry is None:
                lost = next((w for w in result["warmup"] if self._failed(w)), None)
                entry = lost or {
                    "round": k,
                    "order": list(round_order(k)),
                    "a": ab_round_dir(plan.out, k, "a").name,
                    "a_status": "failed",
                    "a_error": f"the launcher did not run round {k} (exit code "
                    f"{returncode}; see {log_path})",
                }
            else:
                entry["placement"] = result.get("placement")
                self._say_round(entry, result.get("wall_s") or 0.0)
            self.record["rounds"].append(entry)
            self._save()
            if stopped := self._stopped(entry, f"round {k}"):
                return stopped
        return None

    def _stopped(self, entry: dict[str, Any], label: str) -> int | None:
        """A failed run ends the job: the baseline's failure is inconclusive (exit 2), the
        candidate's alone is a regression (exit 1)."""
        a_ok = entry.get("a_status") in (None, "complete")
        b_ok = entry.get("b_status") in (None, "complete")
        if a_ok and b_ok:
            return None
        side = "a" if not a_ok else "b"
        status = entry[f"{side}_status"]
        error = entry.get(f"{side}_error")
        if status == "incomplete":
            self.record["status"] = "incomplete"
            self._save()
            self._say(f"{label}: run {entry[side]} was interrupted; stopping")
            return 130
        code = 2 if side == "a" else 1
        verdict = "inconclusive" if code == 2 else "regression"
        who = "baseline" if side == "a" else "candidate"
        self.record.update(
            status="stopped",
            verdict=verdict,
            exit_code=code,
            stop_reason=f"{label}: {who} run {entry[side]} {status}: {error}",
        )
        self._save()
        print(
            f"## inferlab gate ab: {verdict.upper()} (exit {code})\n\n"
            f"{label}: the {who} run {self.plan.out / entry[side]} {status}: {error}"
        )
        return code


LAUNCHER_STOP_TIMEOUT_S = 60.0  # after Ctrl-C, how long the launcher gets to stop its jobs


def _stop_launcher(launcher: subprocess.Popen[bytes]) -> None:
    """Ctrl-C or SIGTERM while the launcher runs the rounds: SIGINT to it, so that it stops its
    workers as on a Ctrl-C of its own (joblib ends its worker processes, Ray its local
    cluster), then SIGKILL if it has not ended in time or on a second Ctrl-C. Killing it at
    once would leave its workers running rounds after the gate said it stopped."""
    launcher.send_signal(signal.SIGINT)
    try:
        launcher.wait(timeout=LAUNCHER_STOP_TIMEOUT_S)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):  # a second Ctrl-C: now
        launcher.kill()
        launcher.wait()


def _launcher_error(log_path: Path) -> str:
    """The launcher's own error, from its log: the last lines that say something (Hydra's
    config errors, a traceback's exception), joined."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "its log cannot be read"
    said = [
        line.strip()
        for line in lines
        if line.strip() and not line.startswith("Set the environment variable HYDRA_FULL_ERROR")
    ]
    error = " ".join(said[-4:]) or "nothing in its log"
    return error if len(error) <= 400 else "... " + error[-400:]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferlab gate ab",
        description="Run baseline (A) and candidate (B) configurations interleaved, "
        "alternating which goes first each round, then gate on the paired "
        "per-round ratios. Exit 0 pass, 1 regression, 2 inconclusive.",
    )
    parser.add_argument(
        "--baseline",
        required=True,
        metavar="OVERRIDES",
        help='Hydra overrides of the baseline, one quoted string ("" for none)',
    )
    parser.add_argument(
        "--candidate", required=True, metavar="OVERRIDES", help="Hydra overrides of the candidate"
    )
    parser.add_argument(
        "--common",
        default="",
        metavar="OVERRIDES",
        help="overrides applied to both sides first (model, workload, ...)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=MIN_ROUNDS,
        help=f"measured rounds (default and minimum {MIN_ROUNDS})",
    )
    parser.add_argument(
        "--allow-few-rounds",
        action="store_true",
        help=f"allow fewer than {MIN_ROUNDS} rounds (smoke tests: timing will "
        "then usually be inconclusive)",
    )
    parser.add_argument(
        "--warmup-rounds", type=int, default=1, help="rounds run first and not gated (default 1)"
    )
    parser.add_argument(
        "--isolation",
        choices=ISOLATION,
        default="worker",
        help="worker: one fresh process per side for the whole job (default); "
        "process: a fresh process per run",
    )
    parser.add_argument(
        "--baseline-code",
        default=str(SOURCE_ROOT),
        metavar="DIR",
        help="the checkout the baseline runs (default: this one), e.g. a "
        "worktree of the main branch",
    )
    parser.add_argument(
        "--candidate-code",
        default=str(SOURCE_ROOT),
        metavar="DIR",
        help="the checkout the candidate runs (default: this one)",
    )
    parser.add_argument(
        "--launcher",
        choices=sorted(LAUNCHER_EXTRAS),
        help="run the rounds as jobs of this Hydra launcher, each round on its own device "
        "slot, both sides on the same one (docs/scaling.md); default: in turn, here",
    )
    parser.add_argument(
        "--launcher-options",
        default="",
        metavar="OVERRIDES",
        help='the launcher\'s Hydra overrides, e.g. "hydra.launcher.n_jobs=2"',
    )
    parser.add_argument("--out", required=True, help="the A/B folder to create")
    parser.add_argument("--rules", help="rules YAML merged over configs/gate/default.yaml")
    add_require_argument(parser)
    return parser


def plan_from_args(args: argparse.Namespace) -> ABPlan:
    if args.rounds < 1:
        raise ABError(
            f"--rounds: {args.rounds} is invalid; allowed: an integer >= "
            f"{MIN_ROUNDS} (>= 1 with --allow-few-rounds)"
        )
    if args.rounds < MIN_ROUNDS and not args.allow_few_rounds:
        raise ABError(
            f"--rounds: {args.rounds} is fewer than {MIN_ROUNDS}: too few paired "
            "ratios to gate timing on a noisy machine; give --allow-few-rounds to "
            "run it anyway (smoke tests)"
        )
    if args.warmup_rounds < 0:
        raise ABError(f"--warmup-rounds: {args.warmup_rounds} is invalid; allowed: an integer >= 0")
    out = given_output_path(args.out, "--out", "a folder path")
    refuse_run_file(out, "--out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ABError(f"--out: {out} exists and is not an empty folder; choose a new one")
    if args.launcher and (missing := missing_launcher([f"hydra/launcher={args.launcher}"])):
        raise ABError(f"--launcher: {missing}")
    try:
        split = {
            name: shlex.split(getattr(args, name))
            for name in ("baseline", "candidate", "common", "launcher_options")
        }
    except ValueError as exc:
        raise ABError(f"overrides: cannot split {exc}") from exc
    codes = {}
    for side in ("baseline", "candidate"):
        code = Path(getattr(args, f"{side}_code")).resolve()
        layouts = ("running/experiment.py", "experiment.py")  # today's, before the sub-packages
        if not any((code / "harness" / layout).is_file() for layout in layouts):
            raise ABError(
                f"--{side}-code: {code} is not an inferlab checkout "
                "(no harness/running/experiment.py)"
            )
        codes[side] = code
    return ABPlan(
        split["baseline"],
        split["candidate"],
        split["common"],
        args.rounds,
        out,
        args.warmup_rounds,
        args.isolation,
        codes["baseline"],
        codes["candidate"],
        args.launcher,
        split["launcher_options"],
    )


def run_ab(plan: ABPlan, rules: GateRules, log: IO[str] | None = None) -> int:
    """Compose, check, run every round into plan.out and gate; returns the exit code."""
    runner = ABRunner(plan, rules, log)  # composes and checks before creating anything
    plan.out.mkdir(parents=True, exist_ok=True)
    return runner.run()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        plan = plan_from_args(args)
        rules = load_rules(args.rules, tuple(args.require_metric))
        return run_ab(plan, rules)
    except (ABError, RulesError, UnreadableFile, RunFileRefused, UserFileError) as exc:
        print(f"inferlab gate ab: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out cannot be created or written
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"inferlab gate ab: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
