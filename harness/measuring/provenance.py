"""Where a result came from: code version, packages, machine, configuration hash."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from harness import SOURCE_ROOT
from harness.run_folder import read_provenance, write_provenance

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "pandas",
    "pyarrow",
    "hydra-core",
    "inferlab",
)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=SOURCE_ROOT, capture_output=True, text=True, timeout=5, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


#: The instruction-set extensions that decide which CPU kernels run (the lab's and llama.cpp's).
ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "fma",
    "f16c",
)


def _cpu() -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and "model" not in info:
            info["model"] = value.strip()
        elif key == "flags" and "flags" not in info:
            info["flags"] = [f for f in value.split() if f in ISA_FLAGS]
    return info


def _gpu() -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    gpu: dict[str, Any] = {
        "name": props.name,
        "memory_bytes": props.total_memory,
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        gpu["driver"] = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
    except Exception:
        pass
    return gpu


def _compiler_version(cc: str | None) -> str | None:
    if cc is None:
        return None
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return next(iter((out.stdout or out.stderr).splitlines()), None)


def isa() -> dict[str, Any]:
    """How each side of a CPU comparison was compiled: the lab's C kernels (-march=native on
    this CPU) and, where `make setup-peer` built it, llama.cpp (engines/llamacpp/peer_build.py;
    an engine=llamacpp run's engine.system_info says what that build uses)."""
    from engines.builtin.native import cache
    from engines.llamacpp.peer_build import build_record

    cc = cache.compiler()
    lab = {"compiler": _compiler_version(cc), "flags": list(cache.FLAGS)}
    peer = build_record()
    if peer is not None:
        peer = {
            **{k: peer.get(k) for k in ("version", "isa", "cmake_args", "compiler")},
            "cpu_flags": [f for f in peer.get("cpu_flags") or [] if f in ISA_FLAGS],
        }
    return {"lab_kernels": lab, "llama_cpp": peer}


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def threads() -> dict[str, Any]:
    """The threads each library runs with in this process: torch's intra- and inter-op pools,
    OpenMP and MKL, the engine's C kernels, the OpenMP wait policy and who chose it, the
    threading variables set, and the CPUs this process may use (affinity, cgroup quota)."""
    from engines.builtin.platform import thread_facts

    return thread_facts()


def record_threads(run_dir: Path) -> None:
    """Rewrite `threads` in a run's provenance.json once the engine has set its threads (the
    file is written before the engine loads); a missing or unreadable file is left alone."""
    record = read_provenance(run_dir)
    if record is None:
        return
    record["threads"] = threads()
    record["torch_num_threads"] = record["threads"]["torch_intra_op"]
    write_provenance(run_dir, record)


def record_server(run_dir: Path, server: dict[str, Any] | None) -> None:
    """Add the server the run started (engine.launch: its command line, flags, version) to
    the run's provenance.json; nothing when it started none."""
    record = read_provenance(run_dir)
    if record is None or server is None:
        return
    keys = ("command", "params", "version", "version_error", "pid", "reused")
    record["server"] = {key: server.get(key) for key in keys}
    write_provenance(run_dir, record)


def collect(config: dict[str, Any]) -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    status = _git("status", "--porcelain")
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": platform.python_version(),
        "packages": versions,
        "cpu": _cpu(),
        "torch_num_threads": torch.get_num_threads(),
        "threads": threads(),  # as at collection; record_threads() updates it after load
        "gpu": _gpu(),
        "isa": isa(),
        "hostname_hash": hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12],
        "os": platform.platform(),
        "config_hash": config_hash(config),
    }
