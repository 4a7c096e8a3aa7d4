"""Building llama-cpp-python for the instruction set the lab's own kernels use, and saying so.

The lab's C kernels are compiled with `-march=native` (engines/builtin/native/cache.py), so
a llama.cpp peer built with portable flags (AVX2, no AVX-512) is not a like-for-like
comparison on a CPU with AVX-512 or VNNI. `make setup-peer` runs this module:

    python -m engines.llamacpp.peer_build --version 0.3.36 [--isa native|portable]

`native` (the default) is llama.cpp's `GGML_NATIVE=ON` (-march=native), with AMX turned off
where the CPU has it: the lab's kernels have no AMX path, and ggml's AMX kernels are not
what a like-for-like comparison measures. `portable` is the earlier AVX2 build, which runs
on any x86-64 machine of the last decade. `custom` takes the CMake arguments given with
`--cmake-args` (the Makefile's LLAMA_CMAKE_ARGS) as they are.

pip keys its wheel cache by version, not by CMAKE_ARGS, so a native wheel cached on one
machine would be reused (and crash with SIGILL, or silently run another ISA) on another. The
wheel is therefore built with pip's cache off and kept in a folder of its own, keyed by the
version, the CMake arguments, the compiler and the CPU's flags, under pip's cache folder (the
one CI keeps between runs). Each build writes `llama_cpp_build.json` beside the wheel and
into the virtual environment (`sys.prefix`), which `build_record()` reads for provenance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DISTRIBUTION = "llama-cpp-python"
RECORD_FILE = "llama_cpp_build.json"
# No multimodal library: the lab runs text models only, and it is a third of the build.
# No OpenMP: llama.cpp's own thread pool (spin, then sleep), as in builds without OpenMP. An
# OpenMP build shares the process's libgomp with torch (one soname), which engine=llamacpp
# runs under the lab's OMP_WAIT_POLICY=PASSIVE (engines/openmp.py): every graph then woke a
# sleeping thread, and a batch-1 decode step at 2 threads took 20.1 ms instead of 7.7 ms
# (SmolLM2-135M Q4_1, 2-core Zen 4 EPYC; the OpenMP build with libgomp's own spinning 8.2 ms).
COMMON_ARGS = ("-DLLAVA_BUILD=OFF", "-DGGML_OPENMP=OFF")
PORTABLE_ARGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
)
# With GGML_NATIVE=ON ggml passes -march=native and ignores its GGML_AMX_* options; AMX goes
# only through the compiler's own switches.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ISAS = ("native", "portable", "custom")


def cpu_flags() -> list[str]:
    """The CPU's feature flags (/proc/cpuinfo), sorted; empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return sorted(line.partition(":")[2].split())
    except OSError:
        pass
    return []


def cmake_args(isa: str, flags: list[str], custom: str = "") -> list[str]:
    if isa == "custom":
        return [*COMMON_ARGS, *custom.split()]
    if isa == "portable":
        return [*COMMON_ARGS, *PORTABLE_ARGS]
    if isa != "native":
        raise ValueError(f"--isa: {isa!r} is invalid; allowed: {'|'.join(ISAS)}")
    args = [*COMMON_ARGS, "-DGGML_NATIVE=ON"]
    if any(flag.startswith("amx") for flag in flags):
        args += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return args


def _compiler_version() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            out = subprocess.run([name, "--version"], capture_output=True, text=True, check=False)
            return next(iter((out.stdout or out.stderr).splitlines()), f"{name}: no version")
    return "no C compiler found"


def build_key(version: str, args: list[str], compiler: str, flags: list[str]) -> str:
    parts = [version, *args, compiler, platform.machine(), *flags]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _pip_cache_dir(python: str) -> Path:
    out = subprocess.run(
        [python, "-m", "pip", "cache", "dir"], capture_output=True, text=True, check=False
    )
    folder = out.stdout.strip()
    return Path(folder) if out.returncode == 0 and folder else Path.home() / ".cache" / "pip"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def _build_wheel(python: str, version: str, args: list[str], folder: Path) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        env = {**os.environ, "CMAKE_ARGS": " ".join(args)}
        # --no-cache-dir: neither take a wheel pip built with other flags, nor leave this one
        # where pip would hand it to a build with other flags
        subprocess.run(
            [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-cache-dir",
             "--no-binary", DISTRIBUTION, f"{DISTRIBUTION}=={version}", "-w", str(staging)],
            env=env,
            check=True,
        )  # fmt: skip
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def build_and_install(python: str, version: str, isa: str, custom: str = "") -> dict[str, Any]:
    flags = cpu_flags()
    args = cmake_args(isa, flags, custom)
    compiler = _compiler_version()
    key = build_key(version, args, compiler, flags)
    root = _pip_cache_dir(python) / "inferlab-peer"
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"{DISTRIBUTION}-{version}-{isa}-{key}"
    if not any(folder.glob("*.whl")):
        print(f"building {DISTRIBUTION} {version} ({isa}: {' '.join(args)}) into {folder}")
        _build_wheel(python, version, args, folder)
    wheel = next(folder.glob("*.whl"))
    record = {
        "distribution": DISTRIBUTION,
        "version": version,
        "isa": isa,
        "cmake_args": args,
        "compiler": compiler,
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_flags": flags,
        "key": key,
        "wheel": wheel.name,
    }
    (folder / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    pip = [python, "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--force-reinstall", "--no-deps", str(wheel)], check=True)
    subprocess.run([*pip, f"{DISTRIBUTION}[server]=={version}"], check=True)  # the extra's deps
    prefix = subprocess.run(
        [python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    (Path(prefix) / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def build_record() -> dict[str, Any] | None:
    """How this environment's llama-cpp-python was built (`make setup-peer`), or None where it
    was installed some other way (then only llama.cpp's own system_info says its ISA)."""
    try:
        record = json.loads((Path(sys.prefix) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.llamacpp.peer_build")
    parser.add_argument("--version", required=True, help="llama-cpp-python's version")
    parser.add_argument("--isa", default="native", choices=ISAS, help="(default: native)")
    parser.add_argument(
        "--cmake-args", default="", help="with --isa custom: llama.cpp's CMake arguments"
    )
    parser.add_argument("--python", default=sys.executable, help="the environment to install in")
    args = parser.parse_args(argv)
    if (args.isa == "custom") != bool(args.cmake_args.strip()):
        parser.error("--cmake-args goes with --isa custom, and --isa custom needs it")
    record = build_and_install(args.python, args.version, args.isa, args.cmake_args)
    print(f"{DISTRIBUTION} {record['version']} ({record['isa']}) installed: {record['wheel']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
