"""Device, synchronisation, timing, memory statistics and threads: the only place that
knows whether it runs on a CPU or a GPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engines.base import now_ns


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
    def create(cls, device: str = "auto", num_threads: int | None = None) -> Platform:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"engine.device: {device!r} requested but CUDA is not available; "
                             "allowed here: cpu|auto")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
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
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        avail = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
        return {"device_total_bytes": pages * page, "device_free_bytes": avail * page}

    def kv_budget_bytes(self, requested: int | None, weight_bytes: int,
                        gpu_memory_utilization: float) -> int:
        """Bytes the KV cache may take: the explicit budget, else a share of device memory."""
        if requested is not None:
            return requested
        stats = self.memory_stats()
        if self.is_cuda:
            # Weights are already resident; keep a slice of the rest for activations.
            usable = stats["device_total_bytes"] * gpu_memory_utilization
            used = stats["device_total_bytes"] - stats["device_free_bytes"]
            return max(0, int((usable - used) * 0.9))
        # On CPU the cache lives in RAM: take at most a quarter of what is free, up to 4 GiB.
        return int(min(4 << 30, stats["device_free_bytes"] // 4))
