"""One device per timing job: the cores and GPUs a sweep job runs on when a launcher runs
several jobs at once (joblib, Ray, submitit; docs/scaling.md).

Each job claims its cores and GPUs on its host through lock files, one per core and one per
GPU, in a host-local folder shared by every inferlab job on the host (`flock`: the kernel frees
a dead job's claims). A job takes the first free cores of the set its process may run on and
pins every thread of its process to them; it takes free GPUs and narrows CUDA_VISIBLE_DEVICES
to them, before CUDA starts. When too few are free, two timing jobs would share hardware and
time each other: the job still runs, on the free ones topped up with busy ones, and says so
(a warning on stderr and `shared_*` in its provenance).

Worker processes are reused across jobs (Ray's workers, joblib's loky pool): the original
affinity is restored when a job ends, and a process in which CUDA has started keeps the GPUs
it claimed first (CUDA_VISIBLE_DEVICES no longer has any effect there).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

LOCK_DIR_ENV = "INFERLAB_PLACEMENT_DIR"

#: The GPUs this process's CUDA was started on, once it was (see the module docstring).
_cuda_started_on: list[str] | None = None


@dataclass
class Placement:
    """Where one job ran, as its provenance.json records it (`placement`)."""

    node: str
    pid: int
    launcher: str
    cores: list[int]
    gpus: list[str] = field(default_factory=list)
    shared_cores: list[int] = field(default_factory=list)  # also claimed by another job
    shared_gpus: list[str] = field(default_factory=list)
    warning: str | None = None

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


def lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "inferlab-placement")


def allowed_cores() -> list[int]:
    """The cores this process may run on (a scheduler's allocation: SLURM's cgroup, taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def visible_gpus() -> list[str]:
    """The GPUs this process may use, by the names CUDA_VISIBLE_DEVICES takes: the variable's
    entries when set (Ray's num_gpus and SLURM's gpus_per_task set it), else NVML's indices."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no GPU: a CPU job
        return []


def _try_lock(path: Path) -> IO[bytes] | None:
    # Read-only, created readable by all: flock needs no write access, and the lock files are
    # shared with other users' jobs on the host (opening another user's 0644 file for writing
    # failed with PermissionError, which crashed every job of the second user)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    handle = os.fdopen(fd, "rb")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _shared_dir(folder: Path) -> None:
    """The lock folder, writable by every user like /tmp (sticky: each removes only its own
    files), so that another user's job can add the lock file of a core not claimed yet."""
    if folder.is_dir():
        return
    folder.mkdir(parents=True, exist_ok=True)
    with suppress(OSError):  # created by another user meanwhile: theirs to set
        folder.chmod(0o1777)


def _claim(
    names: list[str], wanted: int, prefix: str, stack: ExitStack
) -> tuple[list[str], list[str]]:
    """(claimed, shared): the first `wanted` free names, topped up with busy ones when too
    few are free. Claims last as long as `stack`."""
    folder = lock_dir()
    _shared_dir(folder)
    claimed: list[str] = []
    for name in names:
        if len(claimed) == wanted:
            break
        handle = _try_lock(folder / f"{prefix}-{name}.lock")
        if handle is not None:
            stack.callback(handle.close)
            claimed.append(name)
    shared = [n for n in names if n not in claimed][: wanted - len(claimed)]
    return claimed + shared, shared


def _pin_threads(cores: set[int]) -> None:
    """Every thread of this process on `cores` (sched_setaffinity(0) moves the calling thread
    only: thread pools started by an earlier job in this process would stay where they were)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, cores)


@contextmanager
def job_placement(
    launcher: str, cores_per_job: int, gpus_per_job: int, gpus: list[str] | None = None
) -> Iterator[Placement]:
    """Claim and pin `cores_per_job` cores and `gpus_per_job` GPUs for the duration."""
    global _cuda_started_on
    cores = allowed_cores()
    gpus = visible_gpus() if gpus is None else gpus
    wanted_cores = max(1, min(cores_per_job, len(cores)))
    with ExitStack() as stack:
        mine, shared = _claim([str(c) for c in cores], wanted_cores, "cpu", stack)
        placement = Placement(
            node=socket.gethostname(),
            pid=os.getpid(),
            launcher=launcher,
            cores=[int(c) for c in mine],
            shared_cores=[int(c) for c in shared],
        )
        if gpus_per_job and _cuda_started_on is not None:
            placement.gpus = list(_cuda_started_on)
        elif gpus_per_job:
            if len(gpus) < gpus_per_job:
                raise RuntimeError(
                    f"placement: the job needs {gpus_per_job} GPU(s) "
                    f"(engine.tensor_parallel_size) and its process sees {len(gpus)} ({gpus}); "
                    "give the launcher's jobs more GPUs (Ray: hydra.launcher.ray.remote.num_gpus, "
                    "SLURM: hydra.launcher.gpus_per_task)"
                )
            placement.gpus, placement.shared_gpus = _claim(gpus, gpus_per_job, "gpu", stack)
        problems = []
        if placement.shared_cores:
            problems.append(f"cores {placement.shared_cores}")
        if placement.shared_gpus:
            problems.append(f"GPUs {placement.shared_gpus}")
        if problems:
            placement.warning = (
                f"this timing job shares {' and '.join(problems)} with another job on "
                f"{placement.node}: both are slowed; run fewer jobs at once"
            )
            print(f"warning: {placement.warning}", file=sys.stderr, flush=True)
        before_env = os.environ.get("CUDA_VISIBLE_DEVICES")
        before_cores = set(cores)
        if hasattr(os, "sched_setaffinity"):
            _pin_threads(set(placement.cores))
        if placement.gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(placement.gpus)
        try:
            yield placement
        finally:
            if hasattr(os, "sched_setaffinity"):
                _pin_threads(before_cores)
            if placement.gpus and _cuda_started():
                _cuda_started_on = placement.gpus  # this process cannot move to other GPUs
            elif before_env is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before_env


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())
