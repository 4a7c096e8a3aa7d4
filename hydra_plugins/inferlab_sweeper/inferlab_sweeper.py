"""inferlab's Hydra sweeper (`hydra/sweeper=inferlab`, config.yaml's default): Hydra's basic
sweeper (the same grid, batches and job numbers) that keeps every job of a sweep whatever the
launcher does:

- before launching it writes the sweep folder's launch record (harness/running/launching.py);
- a job that ran where the sweep folder is not returns its run folder, written here;
- when the launcher gives up on a batch (a worker killed, out of memory, a node lost: joblib,
  Ray and submitit raise for the whole batch), the jobs still running on this host are waited
  for and every job without a final summary gets a failed one with the launcher's error, so it
  is a row of sweep.csv and resume (`run.resume=true`) runs it again. The other batches go on.
  Any other error of the launcher (its options, a cluster it cannot reach) stops the sweep;
- Ctrl-C or SIGTERM while a launcher runs a batch stops the batch's jobs, records the ones that
  started as incomplete, writes sweep.csv and exits with 130, as the basic launcher does.
"""

# no `from __future__ import annotations`: Hydra imports plugins without registering them in
# sys.modules, where dataclasses look string annotations up
import logging
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf, open_dict

from harness.measuring import provenance
from harness.run_folder import (
    HOW_TO_RUN_KEYS,
    SWEEP_TABLE_FILE,
    override_values,
    read_config,
    read_sweep_overrides,
    repeat_dir,
    write_config,
    write_provenance,
)
from harness.running import capacity_search, capacity_sweep, launching
from harness.running.capacity_search import Measurement, Probe
from harness.running.interrupts import interruption, interrupts
from harness.running.repeats import one_repeat, summarize_launched_repeats
from harness.running.sweep import write_sweep_csv
from harness.running.sweep_outputs import named_outputs

log = logging.getLogger(__name__)


@dataclass
class InferlabSweeperConf:
    _target_: str = "hydra_plugins.inferlab_sweeper.inferlab_sweeper.InferlabSweeper"
    max_batch_size: Optional[int] = None  # noqa: UP045 (OmegaConf reads typing's Optional)
    params: Optional[dict[str, str]] = None  # noqa: UP045


ConfigStore.instance().store(
    group="hydra/sweeper", name="inferlab", node=InferlabSweeperConf, provider="inferlab"
)


@dataclass
class Job:
    """One job to launch: its overrides and run folder; `of`: the grid's job it is a repeat of."""

    overrides: list[str]
    folder: Optional[Path]  # noqa: UP045  (None: not composed yet, under the basic launcher)
    num: int  # the grid's job number
    of: Optional["Job"] = None


def _write_hydra_files(folder: Path, first: Path, overrides: list[str], repeats: int) -> None:
    """The .hydra/config.yaml and hydra.yaml Hydra would have written for the job whose
    repeats ran as jobs: its first repeat's, with the job's own repeats, overrides and folder."""
    if not (first / "config.yaml").is_file() or not (first / "hydra.yaml").is_file():
        return
    config = OmegaConf.load(first / "config.yaml")
    hydra_cfg = OmegaConf.load(first / "hydra.yaml")
    with open_dict(config), open_dict(hydra_cfg):
        config.repeats = repeats
        hydra_cfg.hydra.overrides.task = list(overrides)
        hydra_cfg.hydra.runtime.output_dir = str(folder.resolve())
        hydra_cfg.hydra.sweep.subdir = str(PurePosixPath(hydra_cfg.hydra.sweep.subdir).parent)
    OmegaConf.save(config, folder / ".hydra" / "config.yaml")
    OmegaConf.save(hydra_cfg, folder / ".hydra" / "hydra.yaml")


def _what(overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides less those that say how to run (run.resume, ...), not what."""
    return {k: v for k, v in overrides.items() if k not in HOW_TO_RUN_KEYS}


def _quoted(value: str) -> str:
    """A Hydra override value quoted (a folder name may hold `=` or `,`)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class InferlabSweeper(BasicSweeper):
    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(
            parser.parse_overrides(params_conf), self.max_batch_size
        )
        sweep_dir = Path(self.config.hydra.sweep.dir)
        name = launching.launcher_name(self.config.hydra.launcher)
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
            launching.write_launch_record(
                sweep_dir, name, sum(len(batch) for batch in self.overrides)
            )
        except OSError as exc:  # read-only, no permission, a full disk: one line, as for a run
            print(f"error: {sweep_dir}: the sweep folder cannot be written: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        if name == "ray":
            launching.ray_joins_its_cluster(self.launcher)
        if self._searching():
            return self._search(sweep_dir, name)
        returns: list[Any] = []
        first_job = 0  # the job numbers the basic launcher would give
        launched = 0
        while not self.is_done():
            batch = [list(o) for o in self.get_job_batch()]
            jobs, results = self._launch_batch(batch, first_job, launched, sweep_dir, name)
            first_job += len(batch)
            launched += len(jobs)
            returns.append(results)
        return returns

    def _launch_batch(
        self, batch: list[list[str]], first_job: int, launched: int, sweep_dir: Path, name: str
    ) -> tuple[list[Job], list[Any]]:
        """Launch one batch of grid jobs (numbered from first_job; the launcher's own
        numbers from `launched`), gather their folders and summarize their repeats."""
        assert self.launcher is not None  # set up before the sweep
        self.validate_batch_is_legal(batch)
        jobs = self._expand_repeats(batch, first_job, sweep_dir, launched != first_job)
        try:
            # a launcher that runs jobs elsewhere: SIGTERM stops the sweep as Ctrl-C does
            # (the basic launcher's job, running here, takes both signals itself)
            with interrupts() if name != "basic" else nullcontext():
                results = self.launcher.launch(
                    [j.overrides for j in jobs], initial_job_idx=launched
                )
        except KeyboardInterrupt as exc:
            self._interrupted(jobs, sweep_dir, interruption(exc))
        except Exception as exc:
            error = " ".join("".join(traceback.format_exception_only(exc)).split())
            error = error if len(error) <= 400 else error[:400] + " ..."
            if not launching.lost_a_job(exc):
                self._launcher_failed(jobs, sweep_dir, name, error)
            # the launcher lost a job: record the batch's, go on
            log.error(f"the launcher stopped on a batch: {error}")
            self._settle(jobs, sweep_dir, error)
            results = []
        for result in results:
            self._gather(result, sweep_dir)
            if result.status == JobStatus.FAILED:  # the task raised: Hydra's behaviour
                _ = result.return_value
        self._summarize_repeats(jobs)
        return jobs, list(results)

    def _searching(self) -> bool:
        """Whether the sweep is a capacity search (`run.search.slo` set): the sweep's own config
        says so; each grid point's composed config then gives its search."""
        assert self.config is not None
        return OmegaConf.select(self.config, "run.search.slo", default=None) is not None

    def _search(self, sweep_dir: Path, name: str) -> list[Any]:
        """A capacity search per point of the grid (docs/capacity.md): rounds of jobs at the
        loads harness/running/capacity_search.py asks for, numbered on as a grid's are, each
        round decided on the summaries of all before it. Its answers go to search.json,
        search.png and the console; sweep.csv and sweep_summary.json come as for any sweep."""
        assert self.hydra_context is not None and self.config is not None and self.overrides
        grid = [list(o) for batch in self.overrides for o in batch]
        plans = []
        for overrides in grid:  # every point checked before the first job runs
            composed = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            sections = {
                key: OmegaConf.to_container(composed[key], resolve=True)
                if isinstance(composed.get(key), DictConfig)
                else None
                for key in ("run", "workload")
            }
            try:
                plans.append(capacity_sweep.search_of(sections))
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                raise SystemExit(2) from None
        # the keys whose value differs between grid points name each search
        values = [override_values(o) for o in grid]
        swept = [k for k in values[0] if any(v.get(k) != values[0][k] for v in values)]
        # the search sets every workload.arrival key of each run: a grid over one of them
        # would run the same search once per value
        clash = [k for k in swept if k == "workload.arrival" or k.startswith("workload.arrival.")]
        if clash:
            print(
                f"error: {clash[0]}: swept, but the capacity search sets the arrivals of each "
                "run (run.search.over); allowed: a grid over other keys (engine.max_num_seqs=4,16)",
                file=sys.stderr,
            )
            raise SystemExit(2)
        counters = {"first_job": 0, "launched": 0}
        returns: list[Any] = []
        records = []
        for overrides, (search, arrival, num_requests) in zip(grid, plans, strict=True):
            if not search.enabled:
                print(
                    "error: run.search.slo: null at some points of the grid and set at others; "
                    "allowed: one search per grid point, or none",
                    file=sys.stderr,
                )
                raise SystemExit(2)

            def measure(probes: list[Probe], point: list[str] = overrides, plan: Any = (
                search.over, arrival, num_requests)) -> list[Measurement]:  # fmt: skip
                batch = [[*point, *capacity_sweep.load_overrides(p, *plan)] for p in probes]
                return self._measure(batch, counters, returns, sweep_dir, name)

            result = capacity_search.search(measure, search.checks, search.settings(), num_requests)
            point = override_values(overrides)
            grid_point = {k: point[k] for k in swept if k in point} if len(grid) > 1 else None
            record = capacity_sweep.result_record(result, grid_point)
            records.append(record)
            print(capacity_sweep.console_line(record))
        try:
            capacity_sweep.write_search(sweep_dir, records)
        except OSError as exc:
            print(f"error: {sweep_dir}: search.json cannot be written: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        return returns

    def _measure(
        self,
        batch: list[list[str]],
        counters: dict[str, int],
        returns: list[Any],
        sweep_dir: Path,
        name: str,
    ) -> list[Measurement]:
        """One round of a search: its jobs launched as a batch, their summaries read."""
        self._skip_taken_numbers(batch, counters, sweep_dir)
        jobs, results = self._launch_batch(
            batch, counters["first_job"], counters["launched"], sweep_dir, name
        )
        returns.append(results)
        folders = self._folders([j.of or j for j in jobs], sweep_dir)
        counters["first_job"] += len(batch)
        counters["launched"] += len(jobs)
        unique = list(dict.fromkeys(folders))  # a job's repeats ran as jobs: its own folder
        return [capacity_sweep.measurement(f, f.name) for f in unique]

    def _skip_taken_numbers(
        self, batch: list[list[str]], counters: dict[str, int], sweep_dir: Path
    ) -> None:
        """On resume, a job number whose folder holds a job of other overrides (an earlier
        search that went another way after a point was measured again) is skipped, so that
        its run is kept and the new one has a folder of its own."""
        while True:
            taken = False
            for i, overrides in enumerate(batch):
                folder = self._job_plan(overrides, counters["first_job"] + i, sweep_dir)[0]
                stored = read_sweep_overrides(folder) if folder.is_dir() else None
                if stored is not None and _what(stored) != _what(override_values(overrides)):
                    taken = True
                    break
            if not taken:
                return
            counters["first_job"] += 1
            counters["launched"] += 1

    def _expand_repeats(
        self, batch: list[list[str]], first_job: int, sweep_dir: Path, renumbered: bool
    ) -> list[Job]:
        """The jobs to launch for a batch of the grid. A job with repeats=N > 1 becomes N jobs,
        one per repeat-<k>/ folder (harness/running/repeats.py), when the launcher runs jobs
        side by side; the basic launcher keeps running them in turn, each in a fresh process.
        Every job's folder is then given explicitly: the launcher's job numbers no longer
        match the grid's. So it is in every later batch (`renumbered`: an earlier batch's
        repeats were jobs), whose job numbers the launcher counts on from all it launched."""
        assert self.config is not None
        if launching.launcher_name(self.config.hydra.launcher) == "basic":
            # no composing here (a sweep of hundreds of jobs): folders only if ever needed
            return [Job(o, None, first_job + i) for i, o in enumerate(batch)]
        grid, counts = [], []
        for i, overrides in enumerate(batch):
            folder, repeats = self._job_plan(overrides, first_job + i, sweep_dir)
            grid.append(Job(overrides, folder, first_job + i))
            counts.append(repeats)
        if all(n == 1 for n in counts) and not renumbered:
            return grid
        jobs = []
        for job, n in zip(grid, counts, strict=True):
            assert job.folder is not None
            runs = [
                Job(one_repeat(job.overrides), repeat_dir(job.folder, k), job.num, job)
                for k in range(n)
            ]
            for run in runs if n > 1 else [job]:
                assert run.folder is not None
                subdir = str(run.folder.relative_to(sweep_dir))
                run.overrides = [*run.overrides, f"hydra.sweep.subdir={_quoted(subdir)}"]
                jobs.append(run)
        return jobs

    def _summarize_repeats(self, jobs: list[Job]) -> None:
        """The folder of each job whose repeats ran as jobs: its overrides, config and summary,
        as `run_repeats` writes them."""
        parents = {j.of.folder: j.of for j in jobs if j.of is not None and j.of.folder is not None}
        for folder, parent in parents.items():
            n = sum(1 for j in jobs if j.of is parent)
            launching.write_job_overrides(folder, parent.overrides)
            _write_hydra_files(folder, repeat_dir(folder, 0) / ".hydra", parent.overrides, n)
            first = read_config(repeat_dir(folder, 0))
            if first is not None:
                config = {**first, "repeats": n}
                write_config(folder, config)
                write_provenance(folder, provenance.collect(config))
            summary = summarize_launched_repeats(folder, n)
            log.info(f"job {folder.name}: {summary['status']} ({n} repeats)")

    def _job_plan(self, overrides: list[str], num: int, sweep_dir: Path) -> tuple[Path, int]:
        """(its run folder, its repeats) of job `num` of the grid, from its composed config."""
        assert self.hydra_context is not None and self.config is not None
        job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.num = num
        return sweep_dir / str(job_cfg.hydra.sweep.subdir), int(job_cfg.get("repeats") or 1)

    def _folders(self, jobs: list[Job], sweep_dir: Path) -> list[Path]:
        """Each job's run folder, composed now where it was not yet (the basic launcher's)."""
        for job in jobs:
            if job.folder is None:
                job.folder = self._job_plan(job.overrides, job.num, sweep_dir)[0]
        return [j.folder for j in jobs if j.folder is not None]

    def _settle(self, jobs: list[Job], sweep_dir: Path, error: str) -> None:
        time.sleep(0.5)  # let a job that was ending finish its summary
        failed = launching.settle_jobs(self._folders(jobs, sweep_dir), error)
        for job in jobs:
            assert job.folder is not None
            launching.write_job_overrides(job.folder, job.overrides)
        for job_dir in failed:
            log.error(f"job {job_dir.name}: failed ({error})")

    def _launcher_failed(self, jobs: list[Job], sweep_dir: Path, name: str, error: str) -> NoReturn:
        """The launcher could not run the batch (options it refuses, such as n_jobs=0; no
        SLURM; a Ray cluster it cannot reach): every batch would fail alike, so the sweep
        stops with its error. Jobs of the batch that started are recorded first."""
        started = [
            j for j, f in zip(jobs, self._folders(jobs, sweep_dir), strict=True) if f.is_dir()
        ]
        if started:
            self._settle(started, sweep_dir, error)
            assert self.config is not None  # set up before the sweep
            write_sweep_csv(sweep_dir, named_outputs(self.config.hydra))
        hint = launching.ray_connection_hint(error) if name == "ray" else ""
        print(
            f"error: hydra/launcher={name} could not run the sweep: {error}{hint}", file=sys.stderr
        )
        raise SystemExit(1)

    def _interrupted(self, jobs: list[Job], sweep_dir: Path, reason: str) -> NoReturn:
        """Ctrl-C or SIGTERM while the launcher ran a batch: the batch's jobs are stopped and
        recorded `incomplete`, sweep.csv is written, and the sweep ends with exit code 130,
        as under the basic launcher; `run.resume=true` finishes it."""
        for job_dir in launching.stop_jobs(self._folders(jobs, sweep_dir), reason):
            log.error(f"job {job_dir.relative_to(sweep_dir)}: incomplete ({reason})")
        for job in jobs:
            if job.folder is not None and job.folder.is_dir():  # started: its row needs them
                launching.write_job_overrides(job.folder, job.overrides)
        self._summarize_repeats(
            [j for j in jobs if j.of is None or (j.of.folder is not None and j.of.folder.is_dir())]
        )
        assert self.config is not None  # set up before the sweep
        frame = write_sweep_csv(sweep_dir, named_outputs(self.config.hydra))
        print(
            f"sweep {reason}: {len(frame)} job(s) -> {sweep_dir / SWEEP_TABLE_FILE}; the same "
            "command with run.resume=true runs the jobs that are not complete",
            file=sys.stderr,
        )
        raise SystemExit(130)

    def _gather(self, result: JobReturn, sweep_dir: Path) -> None:
        if result.status != JobStatus.COMPLETED or not isinstance(result.return_value, dict):
            return
        archive = result.return_value.pop(launching.ARCHIVE_KEY, None)
        if archive is None:
            return
        if result.hydra_cfg is None:
            return
        subdir = str(result.hydra_cfg.hydra.sweep.subdir)
        launching.unpack_folder(archive, sweep_dir / subdir)
        log.info(f"job {subdir}: run folder gathered from its host")
