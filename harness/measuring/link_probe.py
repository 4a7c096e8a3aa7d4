"""The CPU probe's interconnect: a 2-process gloo all-reduce over loopback, fitted to the ring
model of harness/measuring/comm.py.

`probe_link` starts `world_size` fresh Python processes (this module as `__main__`), one thread
each, that meet through a FileStore in a temporary folder and time all-reduces (a sum of
float32) of each message size with torch.distributed's gloo backend over the loopback
interface. Per size each rank times a few blocks of back-to-back all-reduces (the block's time
per operation, so the ranks' skew leaving the barrier before it is amortized) and keeps its
best block; the ranks' slowest best is the size's time. The fit is comm.allreduce_seconds,
t = 2(N-1)/N x bytes / link_bandwidth + 2(N-1) x link_latency, through two of the points:

    the smallest message, which is mostly latency, and
    the message with the largest bus bandwidth (nccl-tests' busbw, 2(N-1)/N x bytes / t:
    a large one), which is mostly transfer;

the line through them gives link_bandwidth (its slope) and link_latency (its intercept, at
least 0), so the model reproduces both times. That large message's plain busbw would
understate the bandwidth by its share of latency (~8% for 4 MiB on the 2-core machine this
was written on); the raw times and busbw per size are kept beside the fit.

Fresh processes rather than threads or the caller's own process: the probe must not touch the
caller's torch.distributed state or thread settings, and each rank gets a core of its own as
a real deployment's ranks would. `probe_link` never raises: a failure (no gloo, no loopback,
a timeout) comes back as `{"link_error": reason}`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import source_env

LINK_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)  # bytes: 4 KiB..4 MiB
LINK_WORLD_SIZE = 2
LINK_BACKEND = "gloo"
LINK_TIMEOUT_S = 60.0  # two fresh Pythons importing torch on a loaded machine, and the timing
# Untimed all-reduces: the first ones after the group forms run ~10x slower (connections,
# first-touch buffers), then a few per size (its buffers)
WARMUP_FIRST = 20
WARMUP = 3
BLOCKS = 5  # timed blocks per size; the best is kept (a sample is only ever slowed by noise)
OPS_PER_BLOCK = 8


def _worker(rank: int, world_size: int, store_path: str, sizes: list[int]) -> None:
    """One rank: time each size, print (rank 0) the ranks' slowest best seconds as JSON."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        LINK_BACKEND,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=LINK_TIMEOUT_S),
    )
    try:
        first = torch.ones(min(sizes) // 4, dtype=torch.float32)
        for _ in range(WARMUP_FIRST):
            dist.all_reduce(first)
        best = []
        for nbytes in sizes:
            x = torch.ones(nbytes // 4, dtype=torch.float32)
            for _ in range(WARMUP):
                dist.all_reduce(x)
            seconds = math.inf
            for _ in range(BLOCKS):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(OPS_PER_BLOCK):
                    dist.all_reduce(x)
                seconds = min(seconds, (time.perf_counter() - start) / OPS_PER_BLOCK)
            best.append(seconds)
        # the collective took as long as its slowest rank saw it take
        slowest = torch.tensor(best, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps({"sizes": list(sizes), "seconds": slowest.tolist()}), flush=True)
    finally:
        dist.destroy_process_group()


def fit_link(sizes: list[int], seconds: list[float], world_size: int) -> dict[str, float]:
    """link_bandwidth (bytes/s) and link_latency (seconds per ring step) from all-reduce
    times per message size: the ring model through the smallest message and the one with the
    largest bus bandwidth (the module docstring)."""
    from harness.measuring.comm import allreduce_bus_bandwidth  # (as in probe_link)

    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"fit_link: need >= 2 (size, seconds) pairs, got {sizes}, {seconds}")
    if not all(t > 0 and math.isfinite(t) for t in seconds):
        raise ValueError(f"fit_link: times must be finite and > 0, got {seconds}")
    n = world_size
    hops, share = 2 * (n - 1), 2 * (n - 1) / n  # ring steps; bytes through each link / bytes
    busbw = [allreduce_bus_bandwidth(b, t, n) for b, t in zip(sizes, seconds, strict=True)]
    large = max(range(len(sizes)), key=lambda i: busbw[i])
    small = min(range(len(sizes)), key=lambda i: sizes[i])
    slope = 0.0
    if sizes[large] > sizes[small]:
        slope = (seconds[large] - seconds[small]) / (sizes[large] - sizes[small])
    if slope > 0:
        bandwidth = share / slope
        latency = max(0.0, (seconds[small] - slope * sizes[small]) / hops)
    else:  # the large message no slower than the small one: noise; its plain busbw then
        bandwidth = busbw[large]
        latency = max(0.0, (seconds[small] - share * sizes[small] / bandwidth) / hops)
    return {"link_bandwidth": bandwidth, "link_latency": latency}


def _child_env() -> dict[str, str]:
    env = source_env()  # the same checkout as the caller's, whatever the installed copy
    env["OMP_NUM_THREADS"] = "1"  # one thread per rank, from the first import on
    if "GLOO_SOCKET_IFNAME" not in env and Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback, not whatever the host name resolves to
    return env


def _run_ranks(
    world_size: int, folder: Path, sizes: tuple[int, ...], deadline: float
) -> list[tuple[int, str, str]]:
    """Run the ranks to their end: (exit code, stdout, stderr) each; every rank still running
    at the deadline (or when this is interrupted) is killed."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world_size):
            args = [str(rank), str(world_size), str(folder / "store"), ",".join(map(str, sizes))]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "harness.measuring.link_probe", *args],
                    cwd=folder,
                    env=_child_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.perf_counter()))
            outputs.append((proc.returncode, out, err))
        return outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def probe_link(
    world_size: int = LINK_WORLD_SIZE,
    sizes: tuple[int, ...] = LINK_SIZES,
    timeout_s: float = LINK_TIMEOUT_S,
) -> dict[str, Any]:
    """Measure a `world_size`-process gloo all-reduce over loopback and fit it: link_bandwidth
    and link_latency, with the raw times under "link_probe"; or {"link_error": reason}."""
    # here, not at the top: the ranks import this module and need none of the project's models
    from harness.measuring.comm import allreduce_bus_bandwidth

    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="inferlab-link-") as tmp:
            outputs = _run_ranks(world_size, Path(tmp), sizes, start + timeout_s)
        for rank, (code, _, err) in enumerate(outputs):
            if code != 0:
                last = (err.strip().splitlines() or ["no output"])[-1]
                return {"link_error": f"rank {rank} exited with {code}: {last}"}
        result = json.loads(outputs[0][1].strip().splitlines()[-1])
        fitted = fit_link(result["sizes"], result["seconds"], world_size)
    except subprocess.TimeoutExpired:
        return {"link_error": f"{LINK_BACKEND} all-reduce probe timed out after {timeout_s:.0f} s"}
    except Exception as exc:  # the rest of the CPU probe stands without the link
        return {"link_error": f"{type(exc).__name__}: {exc}"}
    return {
        **fitted,
        "link_probe": {
            "backend": LINK_BACKEND,
            "world_size": world_size,
            "sizes": result["sizes"],
            "seconds": result["seconds"],
            "busbw": [
                allreduce_bus_bandwidth(b, t, world_size)
                for b, t in zip(result["sizes"], result["seconds"], strict=True)
            ],
            "probe_s": time.perf_counter() - start,
        },
    }


if __name__ == "__main__":  # one rank: python -m harness.measuring.link_probe RANK N STORE SIZES
    _rank, _world, _store, _sizes = sys.argv[1:5]
    _worker(int(_rank), int(_world), _store, [int(s) for s in _sizes.split(",")])
    sys.stdout.flush()
    sys.stderr.flush()
    # torch's interpreter teardown takes ~1 s here, a third of the probe; nothing is left to
    # clean up (the group is destroyed, the output flushed), so the rank skips it. An error
    # above raises before this line and exits normally, with its traceback and a nonzero code.
    os._exit(0)
