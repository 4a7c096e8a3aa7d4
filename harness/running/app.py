"""`inferlab run`: the Hydra application. Composes engine / model / workload config groups,
runs one experiment per job (or `repeats` of it, each in a fresh process), skips jobs that are
already complete when resuming (`run.resume=true`), and (with -m) writes sweep.csv at the
sweep root."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, cast

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import configs
import engines.backends  # noqa: F401  (the engine groups' schemas, before Hydra composes)
import workloads  # noqa: F401  (the workload groups' schemas, likewise)
from engines.openai import server_keeper
from harness.run_folder import read_summary
from harness.running import config_schema  # noqa: F401  (the primary config's, likewise)
from harness.running.experiment import RunFolderError, run_experiment
from harness.running.folder_guard import refuse_shared_job_folder
from harness.running.launching import (
    ARCHIVE_KEY,
    launched_job,
    launcher_name,
    missing_launcher,
    pack_folder,
    read_launch_record,
)
from harness.running.repeats import run_repeats, validate_repeats
from harness.running.run_config import run_config
from harness.running.sweep import ResumeMismatch, completed_run, note_unrecorded, write_sweep_csv
from harness.running.sweep_outputs import named_outputs
from harness.running.table import summary_table


def _run(cfg: DictConfig) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    # a composed DictConfig's container: a dict with the YAML's str keys
    config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(config, dict)
    try:  # the edge: a bad `run` key or repeats stops here, before anything loads
        repeats = validate_repeats(config.get("repeats", 1))
        run_cfg = run_config(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    resume = run_cfg.resume
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if run_cfg.search.enabled and not multirun:  # the sweeper runs a search, over many runs
        print(
            "error: run.search: a capacity search runs many jobs; allowed: inferlab run -m "
            "(e.g. -m experiment=capacity), or run.search.slo=null for one run",
            file=sys.stderr,
        )
        raise SystemExit(2)
    label = f"job {hydra_cfg.job.num}: " if multirun else ""
    try:
        done = resume and completed_run(run_dir, config)
    except ResumeMismatch as exc:  # stop: the sweep folder belongs to another command
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if done:
        print(f"{label}skipped (already complete) -> {run_dir}")
        return _gathered(read_summary(run_dir) or {}, run_dir, hydra_cfg, multirun)
    if multirun and not resume:
        refuse_shared_job_folder(run_dir)
    try:
        with launched_job(hydra_cfg, config) as job:
            if repeats > 1:
                summary = run_repeats(
                    config,
                    list(hydra_cfg.overrides.task),
                    run_dir,
                    repeats,
                    resume=resume,
                    provenance_extra=job.provenance(),
                )
            else:
                summary = run_experiment(
                    config, run_dir, progress=run_cfg.progress, provenance_extra=job.provenance()
                )
    except OSError as exc:  # the folder cannot be written (a full disk, no permission)
        error = (
            str(exc)
            if isinstance(exc, RunFolderError)
            else f"{run_dir}: the run folder cannot be written: {exc}"
        ).replace("\n", " ")
        print(f"{label}failed -> {run_dir}")
        print(f"error: {error}", file=sys.stderr)
        if not multirun:
            raise SystemExit(1) from None
        note_unrecorded(run_dir, error)  # sweep.csv says so: its summary.json may be absent
        return {"status": "failed", "error": error, "metrics": {}}
    print(f"{label}{summary['status']} -> {run_dir}")
    if summary["metrics"]:
        print(summary_table(summary["metrics"], window=summary.get("window")))
    for problem in summary.get("finalize_errors") or []:  # an output the run could not make
        print(f"warning: {run_dir}: {problem}", file=sys.stderr)
    if summary["status"] == "failed":
        print(f"error: {summary['error']}", file=sys.stderr)
        if not multirun:  # a sweep records the failed job and goes on
            # 2: the engine or the model's files refused the configuration, as for any
            # config error; 1: the run itself failed
            raise SystemExit(2 if summary.get("error_kind") == "config" else 1)
    if summary["status"] == "incomplete":  # Ctrl-C or SIGTERM stops a sweep too
        server_keeper.stop_kept()  # and the server it kept for the next job
        if multirun:
            write_sweep_csv(Path(hydra_cfg.sweep.dir), named_outputs(hydra_cfg))
        raise SystemExit(130)
    return _gathered(summary, run_dir, hydra_cfg, multirun)


def _gathered(
    summary: dict[str, Any], run_dir: Path, hydra_cfg: Any, multirun: bool
) -> dict[str, Any]:
    """The job's return value: its summary, and its folder where the launching host cannot see
    it (the sweeper writes it there; harness/running/launching.py)."""
    launched = multirun and launcher_name(hydra_cfg.launcher) != "basic"
    if launched and read_launch_record(Path(hydra_cfg.sweep.dir)) is None:
        return {**summary, ARCHIVE_KEY: pack_folder(run_dir)}
    return summary


@hydra.main(version_base="1.3", config_path=str(configs.CONFIG_DIR), config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    return _run(cfg)  # a sweep job's return value reaches the sweeper


#: The user's HYDRA_FULL_ERROR, for the processes a run starts (cli() sets its own).
USER_HYDRA_FULL_ERROR = "INFERLAB_USER_HYDRA_FULL_ERROR"


def cli() -> None:
    """`inferlab run`: a launcher whose plugin is not installed, and a config that does not
    compose (a value of the wrong type, `run.monitor.server_interval_s=abc`; an unknown key
    or group option), are one line naming the key, exit 2, not Hydra's multi-line report."""
    missing = missing_launcher(sys.argv[1:])
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        raise SystemExit(2)
    # Hydra prints a composition error itself and exits 1, unless HYDRA_FULL_ERROR lets it
    # through; one set by the user keeps Hydra's full report. The user's setting travels to
    # the processes this run starts (repeats, launched jobs), which see ours in
    # HYDRA_FULL_ERROR, and ours is undone after, for callers in this process (tests).
    saved = {key: os.environ.get(key) for key in ("HYDRA_FULL_ERROR", USER_HYDRA_FULL_ERROR)}
    user_setting = os.environ.setdefault(USER_HYDRA_FULL_ERROR, saved["HYDRA_FULL_ERROR"] or "")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException) as exc:
        if user_setting == "1":
            raise
        print(f"error: {configs.reason(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


if __name__ == "__main__":
    cli()
