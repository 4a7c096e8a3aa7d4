"""Sweeps on Hydra's launcher plugins (joblib, Ray, submitit; docs/scaling.md): which launcher
runs a job and how many jobs it runs at once, the sweep folder's launch record, a job folder
carried back to the launching host, and the rows of jobs whose process died.

The launching host writes `.launch.json` into the sweep folder before any job starts. A job
that cannot see it runs on a host without the launching host's filesystem: it returns its
whole run folder (a tar.gz in its return value) and the sweeper writes it under the sweep
folder there, so that sweep.csv, resume, `inferlab report` and `inferlab gate` find every job
where the basic launcher would have put it.
"""

from __future__ import annotations

import importlib.util
import io
import json
import multiprocessing
import os
import signal
import socket
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.types import RunMode

from engines.openai import server_keeper
from harness.run_folder import read_summary, write_json_atomic, write_summary, write_text_atomic

LAUNCH_FILE = ".launch.json"
ARCHIVE_KEY = "_run_folder_tar_gz"  # in a job's return value, popped by the sweeper

#: hydra/launcher=<name> -> (the plugin's module, the extra that installs it)
LAUNCHER_EXTRAS = {
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "joblib"),
    "ray": ("hydra_plugins.hydra_ray_launcher", "ray"),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
}

_LAUNCHER_CLASSES = {
    "BasicLauncher": "basic",
    "JoblibLauncher": "joblib",
    "RayLauncher": "ray",
    "LocalLauncher": "submitit_local",
    "SlurmLauncher": "submitit_slurm",
}


def missing_launcher(overrides: list[str]) -> str | None:
    """The one-line error for a `hydra/launcher=<name>` whose plugin is not installed."""
    for override in overrides:
        key, _, name = override.partition("=")
        if key.lstrip("+~") != "hydra/launcher" or name not in LAUNCHER_EXTRAS:
            continue
        module, extra = LAUNCHER_EXTRAS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return (
                f"hydra/launcher={name} needs the optional extra `{extra}`: "
                f"pip install -e '.[{extra}]' (or make setup-launchers)"
            )
    return None


def ray_joins_its_cluster(launcher: Any) -> None:
    """Hydra's Ray launcher gives ray.init an object store size (75 MB, for the small local
    cluster it starts), which ray.init refuses when it connects to an existing cluster
    (`hydra.launcher.ray.init.address`, or RAY_ADDRESS): that cluster sized its own. Left
    unset there, so that the documented `hydra.launcher.ray.init.address=ray://head:10001`
    connects. An object store size given explicitly is kept."""
    from omegaconf import open_dict

    init = getattr(getattr(launcher, "ray_cfg", None), "init", None)
    if init is None or "object_store_memory" in init:
        return
    if init.get("address") or os.environ.get("RAY_ADDRESS"):
        with open_dict(init):
            init.object_store_memory = None  # the launcher's setdefault keeps it None


def ray_connection_hint(error: str) -> str:
    """What to try when Ray could not join a cluster: `ray start` turns on token
    authentication by default since Ray 2.59, and a client joins such a cluster only with
    RAY_AUTH_MODE=token in its own environment (Ray then reads ~/.ray/auth_token or
    RAY_AUTH_TOKEN). Ray's own error says only that it failed to connect."""
    if "Failed to connect to Ray cluster" not in error or os.environ.get("RAY_AUTH_MODE"):
        return ""
    return (
        "; if the cluster uses token authentication (`ray start`'s default since Ray 2.59), "
        "set RAY_AUTH_MODE=token here too, with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN"
    )


def ray_cluster_overrides(launcher: str | None, options: list[str]) -> list[str]:
    """What ray_joins_its_cluster does, as an override for a Ray launcher that another Hydra
    app's sweeper runs (`gate ab --launcher ray --launcher-options ...`, ab_rounds.py)."""
    given = {o.partition("=")[0].lstrip("+~"): o.partition("=")[2] for o in options}
    address = given.get("hydra.launcher.ray.init.address", "null") not in ("", "null")
    if launcher != "ray" or "hydra.launcher.ray.init.object_store_memory" in given:
        return []
    if address or os.environ.get("RAY_ADDRESS"):
        return ["+hydra.launcher.ray.init.object_store_memory=null"]
    return []


def launcher_name(launcher_cfg: Any) -> str:
    """basic | joblib | ray | submitit_local | submitit_slurm, or the class of another plugin."""
    target = str((launcher_cfg or {}).get("_target_") or "BasicLauncher")
    cls = target.rsplit(".", 1)[-1]
    return _LAUNCHER_CLASSES.get(cls, cls)


def _positive(value: Any) -> int | None:
    return (
        int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    )


def cores_per_job(launcher_cfg: Any, host_cores: int, num_jobs: int | None) -> int:
    """The cores one job gets: what the launcher allots a job where it says (Ray's num_cpus,
    submitit's cpus_per_task), else the host's cores over the jobs it runs at once."""
    cfg = launcher_cfg or {}
    name = launcher_name(cfg)
    at_once: int | None = None
    if name == "joblib":
        n_jobs = int(cfg.get("n_jobs") or 1)
        at_once = n_jobs if n_jobs > 0 else max(1, (os.cpu_count() or 1) + 1 + n_jobs)
    elif name == "ray":
        remote = (cfg.get("ray") or {}).get("remote") or {}
        per_task = remote.get("num_cpus")
        return max(1, min(host_cores, int(per_task) if per_task else 1))
    elif name.startswith("submitit"):
        per_task = _positive(cfg.get("cpus_per_task"))
        if per_task:
            return min(host_cores, per_task)
        if name == "submitit_slurm":  # the job's process sees its own allocation only
            return host_cores
        at_once = _positive(cfg.get("array_parallelism"))
    if num_jobs:
        at_once = min(at_once or num_jobs, num_jobs)
    return max(1, host_cores // max(1, at_once or 1))


@dataclass
class LaunchRecord:
    """The sweep folder's .launch.json."""

    host: str
    token: str
    launcher: str
    num_jobs: int
    started_unix: float


def write_launch_record(sweep_dir: Path, launcher: str, num_jobs: int) -> LaunchRecord:
    record = LaunchRecord(socket.gethostname(), uuid.uuid4().hex, launcher, num_jobs, time.time())
    write_json_atomic(sweep_dir / LAUNCH_FILE, record.__dict__)
    return record


def read_launch_record(sweep_dir: Path) -> LaunchRecord | None:
    """None where the file is absent: the job runs on a host without the sweep folder."""
    try:
        return LaunchRecord(**json.loads((sweep_dir / LAUNCH_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def pack_folder(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(folder, arcname=".")
    return buffer.getvalue()


def unpack_folder(archive: bytes, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(folder, filter="data")  # no absolute paths, links out, devices


FINAL_STATUSES = ("complete", "failed", "incomplete")

#: The errors with which a launcher gives up on a batch because a job's process or node was
#: lost (joblib/loky, submitit, Ray), by class name: the launchers are optional extras. A job's
#: own exception is its JobReturn, not one of these.
LOST_JOB_ERRORS = ("BrokenProcessPool", "UncompletedJobError", "RayError")


def lost_a_job(exc: BaseException) -> bool:
    """Did the launcher raise because it lost a job (else it could not run the batch at all:
    n_jobs=0, no SLURM, a Ray cluster it cannot reach)?"""
    return any(cls.__name__ in LOST_JOB_ERRORS for cls in type(exc).__mro__)


def _pid_here(job_dir: Path) -> int | None:
    """The job's process (its provenance's placement) when it still runs on this host."""
    try:
        placement = json.loads((job_dir / "provenance.json").read_text()).get("placement") or {}
        if placement.get("node") != socket.gethostname():
            return None
        pid = int(placement["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return pid


def _alive_here(job_dir: Path) -> bool:
    """Is the job's process (its provenance's placement) still running on this host?"""
    return _pid_here(job_dir) is not None


def settle_jobs(job_dirs: list[Path], error: str, poll_s: float = 1.0) -> list[Path]:
    """After the launcher gave up on a batch (`error`): wait for the jobs of the batch that are
    still running on this host, then record every job without a final summary as failed with
    the reason, so that sweep.csv has its row and resume runs it again. Returns those jobs."""
    while any(_pending(d) and _alive_here(d) for d in job_dirs):
        time.sleep(poll_s)
    failed = []
    for job_dir in job_dirs:
        if not _pending(job_dir):
            continue
        summary = read_summary(job_dir) or {}
        started = summary.get("status") == "running"
        reason = (
            "the job's process ended before its run did"
            if started
            else "the job did not start or its folder never reached this host"
        )
        failed.append(job_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        write_summary(
            job_dir, {**summary, "status": "failed", "error": f"{reason}: {error}", "metrics": {}}
        )
    return failed


STOP_TIMEOUT_S = 30.0  # after Ctrl-C, how long the jobs get to end as interrupted runs


def stop_jobs(
    job_dirs: list[Path], reason: str, timeout_s: float = STOP_TIMEOUT_S, poll_s: float = 0.2
) -> list[Path]:
    """After Ctrl-C or SIGTERM in the launching process (`reason`: `interrupted: SIGINT`): a
    SIGTERM to each job of the batch still running on this host, which stops it as it stops
    a run (its rows kept, its summary `incomplete`), a wait for them (cut short by a second
    Ctrl-C), then every job that started and has no final summary, its process gone (a
    launcher ends its workers on Ctrl-C: joblib at once) or on another host, is recorded
    `incomplete` with the reason. A job that never started keeps no folder, as under the
    basic launcher. Resume runs all of them again. Returns the jobs recorded here."""
    for job_dir in job_dirs:
        pid = _pid_here(job_dir) if _pending(job_dir) else None
        if pid is not None:
            with suppress(OSError):  # it ended meanwhile
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and any(_pending(d) and _alive_here(d) for d in job_dirs):
            time.sleep(poll_s)
    except KeyboardInterrupt:  # a second Ctrl-C: record them as they are
        pass
    recorded = []
    for job_dir in job_dirs:
        summary = read_summary(job_dir)
        if summary is None or summary.get("status") in FINAL_STATUSES:
            continue
        recorded.append(job_dir)
        error = f"{reason}: the sweep was stopped before this job ended"
        write_summary(job_dir, {**summary, "status": "incomplete", "error": error, "metrics": {}})
    return recorded


def _pending(job_dir: Path) -> bool:
    summary = read_summary(job_dir)
    return summary is None or summary.get("status") not in FINAL_STATUSES


def write_job_overrides(job_dir: Path, overrides: list[str]) -> None:
    """A job folder's .hydra/overrides.yaml (as Hydra writes it), for a job that never started:
    its sweep.csv row needs its overrides."""
    import yaml

    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, yaml.safe_dump(list(overrides)))


def gpus_per_job(config: dict[str, Any], visible: list[str]) -> int:
    """GPUs a job of this configuration uses: its tensor-parallel ranks on a CUDA device, or
    those of the server it starts (engine.launch.gpus)."""
    engine = config.get("engine") or {}
    launch = engine.get("launch") or {}
    if engine.get("backend") == "openai" and launch.get("command"):
        return int(launch.get("gpus") or 0) if visible else 0
    if engine.get("backend", "builtin") not in ("builtin", "hf"):
        return 0  # a client (openai) or llama.cpp on the CPU
    device = str(engine.get("device") or "auto")
    if device.startswith("cuda") or (device == "auto" and visible):
        return int(engine.get("tensor_parallel_size") or 1)
    return 0


ORPHAN_POLL_S = 2.0
_jobs_here = 0  # jobs running in this process (its main thread starts and ends them)
_watching_parent = False


def _exit_when_orphaned(parent: int, poll_s: float) -> None:
    """Once the launching process is gone (SIGKILL, the OOM killer) and no job runs here, end
    this worker process: loky's idle workers would otherwise wait for work for good. A job
    running when it went finishes first (a complete job is kept)."""
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent and _jobs_here == 0:
            os._exit(0)


def _watch_parent(poll_s: float = ORPHAN_POLL_S) -> None:
    global _watching_parent
    # None in the launching process itself (joblib runs a job there with n_jobs=1): its own
    # parent, a shell, may well go
    parent = multiprocessing.parent_process()
    if not _watching_parent and parent is not None and parent.pid is not None:
        _watching_parent = True
        threading.Thread(target=_exit_when_orphaned, args=(parent.pid, poll_s), daemon=True).start()


@contextmanager
def launched_job(hydra_cfg: Any, config: dict[str, Any]) -> Iterator[JobOnLauncher]:
    """A sweep job's placement (claimed and pinned for the duration) when the launcher runs
    jobs side by side."""
    global _jobs_here
    name = launcher_name(hydra_cfg.launcher)
    if name == "basic" or hydra_cfg.mode != RunMode.MULTIRUN:  # one job at a time
        yield JobOnLauncher(name, None)
        return
    from harness.running import placement

    if name == "joblib":  # its workers are children of the launching process
        _watch_parent()
    record = read_launch_record(Path(hydra_cfg.sweep.dir))
    cores = cores_per_job(
        hydra_cfg.launcher, len(placement.allowed_cores()), record.num_jobs if record else None
    )
    gpus = gpus_per_job(config, placement.visible_gpus())
    _jobs_here += 1
    try:
        with placement.job_placement(name, cores, gpus) as where:
            try:
                yield JobOnLauncher(name, where.as_record())
            finally:  # its server holds the job's cores and GPUs, which the next job may claim
                server_keeper.stop_kept()
    finally:
        _jobs_here -= 1


@dataclass
class JobOnLauncher:
    launcher: str
    placement: dict[str, Any] | None  # provenance.json's `placement`

    def provenance(self) -> dict[str, Any]:
        return {} if self.placement is None else {"placement": self.placement}
