"""Before Hydra writes anything: a run or sweep folder that already holds a run, or that cannot
be written, is one line and exit code 2.

Hydra writes .hydra/ into `hydra.run.dir` (and the run then its config.yaml, summary.json and
tables) whatever is there, so a run started again into a finished run's folder replaced it
without a word, and a sweep run again into its own folder re-ran and rewrote every job. The
rule (docs/run_folder.md): a folder that holds a run is written into only with
`run.resume=true`, which keeps what is complete and runs the rest again. Hydra's callbacks
turn an exception into a warning; SystemExit is not an Exception, so it stops the command.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness.run_folder import JOB_LOG_FILE, OVERRIDES_FILE, read_summary, runs_written_in

SHOWN_NAMES = 5


def folder_problem(folder: Path, key: str, sweep: bool, resume: bool) -> str | None:
    """Why a run (`sweep`: a sweep) may not be written into `folder`, the value of config
    key `key`, or None: it is a file, it holds a run and `resume` is off, or it cannot be
    made or written. A folder that can be is made."""
    if folder.is_symlink() and not folder.exists():  # mkdir says only "File exists"
        return (
            f"{key}: {folder} is a symbolic link to {os.readlink(folder)}, which is not there "
            "(missing, or a loop of links); allowed: a folder, or a link to one"
        )
    if folder.exists() and not folder.is_dir():
        return f"{key}: {folder} exists and is not a folder; allowed: a folder that holds no run"
    written = [] if resume else runs_written_in(folder, sweep)
    if written:
        names = ", ".join(written[:SHOWN_NAMES])
        if len(written) > SHOWN_NAMES:
            names += f" and {len(written) - SHOWN_NAMES} more"
        status = (read_summary(folder) or {}).get("status")
        what = ("a sweep" if sweep else "a run") + (f" ({status})" if status else "")
        return (
            f"{key}: {folder} already holds {what}: {names}; nothing was written. Add "
            "run.resume=true to keep what is complete and run the rest again, or choose a "
            f"new folder ({key}=NEW, or leave {key} out for a new dated one)"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"{key}: {folder} cannot be written: {exc.strerror or exc}"
    return None


def _refuse_unwritable(config: DictConfig, key: str, sweep: bool) -> None:
    value = str(OmegaConf.select(config, key))
    resume = OmegaConf.select(config, "run.resume", default=False) is True
    # an empty value (`hydra.run.dir=$OUT` with OUT unset) is the current folder to Path: the
    # run's files went in among the user's own
    problem = (
        f"{key}: {value!r} is invalid; allowed: a folder's path (an empty one would put the "
        f"run's files in the current folder, {Path.cwd()})"
        if not value.strip()
        else folder_problem(Path(value), key, sweep, resume)
    )
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)


ONE_FOLDER_PER_JOB = (
    "give each job its own folder: leave hydra.sweep.subdir out (${hydra.job.num}) or put "
    "${hydra.job.num} or ${hydra.job.override_dirname} in it"
)


def _refuse_one_folder_for_every_job(config: DictConfig) -> None:
    """A sweep of several jobs whose `hydra.sweep.subdir` names no job (`subdir=same`) would
    put them all in one folder, each over the one before (launched side by side, at once)."""
    sweep = OmegaConf.to_container(config.hydra.sweep, resolve=False)
    subdir = sweep.get("subdir") if isinstance(sweep, dict) else None
    if not isinstance(subdir, str) or "${" in subdir:
        return
    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    if any(override.is_sweep_override() for override in overrides):
        print(
            f"error: hydra.sweep.subdir: {subdir!r} is invalid for a sweep of several jobs "
            "(every job would run in one folder, over the one before); allowed: "
            f"{ONE_FOLDER_PER_JOB}",
            file=sys.stderr,
        )
        raise SystemExit(2)


def refuse_shared_job_folder(run_dir: Path) -> None:
    """The sweep folder held no run when the sweep started, so a run in this job's folder is
    an earlier job's (a `hydra.sweep.subdir` that names jobs by a value some share): stop the
    sweep before this job writes its run over it. Hydra has already written this job's
    .hydra/ there, before any callback or the job runs."""
    hydras_own = {OVERRIDES_FILE.parent.name, JOB_LOG_FILE}
    earlier = [name for name in runs_written_in(run_dir) if name not in hydras_own]
    if earlier:
        print(
            f"error: hydra.sweep.subdir: {run_dir} already holds the run of an earlier job of "
            f"this sweep ({', '.join(earlier[:SHOWN_NAMES])}); its results were kept, but its "
            f".hydra/ now holds this job's overrides. Run the sweep again into a new folder and "
            f"{ONE_FOLDER_PER_JOB}",
            file=sys.stderr,
        )
        raise SystemExit(2)


class RunFolderGuard(Callback):
    """Hydra callback (config.yaml): checks the run or sweep folder before Hydra writes it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_unwritable(config, "hydra.run.dir", sweep=False)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_one_folder_for_every_job(config)
        _refuse_unwritable(config, "hydra.sweep.dir", sweep=True)
