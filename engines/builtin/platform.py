"""Device, synchronisation, timing, memory statistics and threads: the only place that
knows whether it runs on a CPU or a GPU."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from engines.base import now_ns
from engines.openmp import wait_policy


class DeviceTimer:
    """Times device work: CUDA events on a GPU (no host sync until read), the clock on CPU."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.cuda = platform.is_cuda
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._start_ns = self._end_ns = 0

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._start_ns = now_ns()

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._end_ns = now_ns()

    def elapsed_ns(self) -> int:
        """Call after the work is known to be finished (the step's sampled tokens are on the
        host), so reading CUDA events never adds a synchronisation of its own."""
        if self.cuda:
            self._end.synchronize()
            return int(self._start.elapsed_time(self._end) * 1e6)
        return self._end_ns - self._start_ns


@dataclass
class Platform:
    device: torch.device

    @classmethod
    def create(
        cls, device: str = "auto", num_threads: int | None = None, processes_per_host: int = 1
    ) -> Platform:
        """`processes_per_host`: engine processes sharing this host's CPUs (tensor-parallel
        ranks), among which the default thread count is divided."""
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"engine.device: {device!r} requested but CUDA is not available; "
                "allowed here: cpu|auto"
            )
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        else:  # torch's default counts the machine's cores, not those this process may use
            cpus, _ = available_cpus()
            cpus = max(1, cpus // processes_per_host)
            if torch.get_num_threads() > cpus:
                torch.set_num_threads(cpus)
        return cls(torch.device(device))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def num_threads(self) -> int:
        return torch.get_num_threads()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def now_ns(self) -> int:
        """The one monotonic clock; call `synchronize` first when GPU work must be finished."""
        return now_ns()

    def timer(self) -> DeviceTimer:
        return DeviceTimer(self)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.is_cuda else torch.float32

    def memory_stats(self) -> dict[str, int]:
        if self.is_cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            return {
                "device_total_bytes": total,
                "device_free_bytes": free,
                "torch_allocated_bytes": torch.cuda.memory_allocated(self.device),
                "torch_peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "torch_reserved_bytes": torch.cuda.memory_reserved(self.device),
            }
        memory = psutil.virtual_memory()
        return {
            "device_total_bytes": memory.total,
            "device_free_bytes": memory.free,
            "device_available_bytes": memory.available,
        }

    def kv_budget(
        self,
        requested: int | None,
        weight_bytes: int,
        gpu_memory_utilization: float,
        one_sequence_bytes: int,
    ) -> tuple[int, str]:
        """Bytes the KV cache may take, and why that many: the explicit budget, else a share
        of device memory. `one_sequence_bytes`: what one sequence of max_model_len needs."""
        if requested is not None:
            return requested, f"engine.kv_cache_memory_bytes={requested}"
        stats = self.memory_stats()
        if self.is_cuda:
            # Weights are already resident; keep a slice of the rest for activations.
            usable = stats["device_total_bytes"] * gpu_memory_utilization
            total = stats["device_total_bytes"]
            used = total - stats["device_free_bytes"]
            return max(0, int((usable - used) * 0.9)), (
                f"0.9 x (gpu_memory_utilization {gpu_memory_utilization} x {_gib(total)} - "
                f"{_gib(used)} in use, weights {_gib(weight_bytes)} included)"
            )
        return cpu_kv_budget(stats["device_available_bytes"], one_sequence_bytes)


CPU_KV_SHARE = 0.25  # of the memory still available once the weights are loaded
CPU_KV_MAX_BYTES = 4 << 30


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_memory_headroom(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process's memory cgroup (v2, else v1) still allows: its limit minus its
    usage, reclaimable file cache not counted as used; None without a limit."""
    for limit_file, usage_file, stat_file, inactive_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        (
            "memory/memory.limit_in_bytes",
            "memory/memory.usage_in_bytes",
            "memory/memory.stat",
            "total_inactive_file",
        ),
    ):
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text())
            stats = dict(line.split() for line in (root / stat_file).read_text().splitlines())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= psutil.virtual_memory().total:
            return None  # v1 reports "no limit" as a huge number
        return max(0, int(limit_text) - usage + int(stats.get(inactive_key, 0)))
    return None


def cpu_kv_budget(available: int, one_sequence_bytes: int) -> tuple[int, str]:
    """The CPU default: a quarter of the memory available (free pages plus the page cache the
    kernel can reclaim: psutil's `available`, not `free`, which on a machine that has read a
    lot of files is a small part of what can be had), or of the cgroup's headroom if that is
    smaller; at most 4 GiB; raised to one sequence of max_model_len when that fits in half."""
    source = "psutil available"
    headroom = cgroup_memory_headroom()
    if headroom is not None and headroom < available:
        available, source = headroom, "cgroup memory limit headroom"
    budget = int(min(CPU_KV_MAX_BYTES, available * CPU_KV_SHARE))
    why = (
        f"min(4 GiB, {CPU_KV_SHARE} x {_gib(available)} available ({source}, after the "
        "weights were loaded))"
    )
    if budget < one_sequence_bytes <= available // 2:
        budget = one_sequence_bytes
        why += (
            f", raised to one sequence of max_model_len ({_gib(one_sequence_bytes)}), "
            "under half of what is available"
        )
    return budget, why


#: what the threading libraries read from the environment, recorded when set
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "OMP_DYNAMIC",
    "MKL_NUM_THREADS",
    "KMP_BLOCKTIME",
    "KMP_AFFINITY",
)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the process's cgroup allows (v2 cpu.max, v1 cfs quota), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu/cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu/cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_cpus() -> tuple[int, str]:
    """The CPUs this process may run on: its affinity mask, lowered to a cgroup's CPU quota
    (a container given 2 CPUs of a 64-core host would otherwise run 64 threads on 2)."""
    if hasattr(os, "sched_getaffinity"):
        cpus, why = len(os.sched_getaffinity(0)), "sched_getaffinity"
    else:
        cpus, why = os.cpu_count() or 1, "os.cpu_count"
    quota = cgroup_cpu_quota()
    if quota is not None and math.ceil(quota) < cpus:
        cpus, why = max(1, math.ceil(quota)), f"cgroup CPU quota {quota:g}"
    return cpus, why


def _parallel_info() -> dict[str, int]:
    """omp_get_max_threads() and mkl_get_max_threads() as torch reports them."""
    found = re.findall(r"(\w+)\(\) : (\d+)", torch.__config__.parallel_info())
    return {
        name: int(value)
        for name, value in found
        if name in ("omp_get_max_threads", "mkl_get_max_threads")
    }


def thread_facts() -> dict[str, Any]:
    """The threads each library runs with in this process, and what decided them."""
    from engines.builtin import native

    cpus, cpus_source = available_cpus()
    kernels = native.info(load_now=False)
    return {
        "torch_intra_op": torch.get_num_threads(),
        "torch_inter_op": torch.get_num_interop_threads(),
        # the C kernels take torch's intra-op count on every call and share its libgomp pool
        "native_kernels": torch.get_num_threads() if kernels["loaded"] else None,
        **_parallel_info(),
        "omp_wait_policy": wait_policy(),
        "env": {name: os.environ[name] for name in THREAD_ENV if name in os.environ},
        "available_cpus": cpus,
        "available_cpus_source": cpus_source,
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "logical_cpus": os.cpu_count(),
    }
