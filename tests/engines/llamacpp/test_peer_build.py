"""`make setup-peer` (engines/llamacpp/peer_build.py): llama.cpp built for the instruction set
the lab's kernels use, its wheel cached under a key of everything that shapes the build, and
the build recorded where provenance reads it. pip is a stand-in here: nothing is compiled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engines.llamacpp import peer_build
from harness.measuring import provenance

AVX512 = ["avx2", "avx512f", "avx512_vnni", "fma", "f16c", "sse2"]


def test_the_native_build_is_this_cpus_without_amx_or_openmp() -> None:
    native = peer_build.cmake_args("native", AVX512)
    assert "-DGGML_NATIVE=ON" in native and "-DGGML_OPENMP=OFF" in native
    assert not any("amx" in a for a in native)  # no AMX on this CPU: nothing to turn off
    with_amx = peer_build.cmake_args("native", [*AVX512, "amx_tile", "amx_int8"])
    assert f"-DCMAKE_C_FLAGS={peer_build.NO_AMX}" in with_amx
    assert f"-DCMAKE_CXX_FLAGS={peer_build.NO_AMX}" in with_amx
    portable = peer_build.cmake_args("portable", AVX512)
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX512=OFF", "-DGGML_OPENMP=OFF"} <= set(portable)
    custom = peer_build.cmake_args("custom", AVX512, "-DGGML_NATIVE=OFF -DGGML_AVX2=ON")
    assert custom[-2:] == ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"]
    with pytest.raises(ValueError, match=r"--isa: 'fast' is invalid; allowed: native\|portable"):
        peer_build.cmake_args("fast", AVX512)


def test_a_wheel_is_keyed_by_everything_that_shapes_it() -> None:
    args = peer_build.cmake_args("native", AVX512)
    key = peer_build.build_key("0.3.36", args, "gcc 12", AVX512)
    assert key == peer_build.build_key("0.3.36", args, "gcc 12", AVX512)
    others = {
        peer_build.build_key("0.3.37", args, "gcc 12", AVX512),
        peer_build.build_key("0.3.36", peer_build.cmake_args("portable", AVX512), "gcc 12", AVX512),
        peer_build.build_key("0.3.36", args, "gcc 13", AVX512),
        peer_build.build_key("0.3.36", args, "gcc 12", ["avx2", "fma", "f16c"]),  # another CPU
    }
    assert key not in others and len(others) == 4


class FakePip:
    """subprocess.run for peer_build: answers `pip cache dir` and sys.prefix, builds a
    placeholder wheel for `pip wheel`, and records every command and its CMAKE_ARGS."""

    def __init__(self, cache: Path, prefix: Path) -> None:
        self.cache, self.prefix = cache, prefix
        self.calls: list[tuple[list[str], str | None]] = []

    def __call__(self, command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        env = kwargs.get("env") or {}
        self.calls.append((list(command), env.get("CMAKE_ARGS")))
        out = ""
        if command[1:4] == ["-m", "pip", "cache"]:
            out = str(self.cache)
        elif command[1] == "-c":
            out = str(self.prefix)
        elif command[1:4] == ["-m", "pip", "wheel"]:
            folder = Path(command[command.index("-w") + 1])
            (folder / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"wheel")
        return subprocess.CompletedProcess(command, 0, out, "")


def test_a_build_is_cached_reused_and_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pip = FakePip(tmp_path / "pip-cache", tmp_path / "venv")
    pip.prefix.mkdir()
    monkeypatch.setattr(peer_build.subprocess, "run", pip)
    monkeypatch.setattr(peer_build, "cpu_flags", lambda: AVX512)
    first = peer_build.build_and_install(sys.executable, "0.3.36", "native")
    built = [(c, a) for c, a in pip.calls if c[1:4] == ["-m", "pip", "wheel"]]
    assert len(built) == 1
    command, cmake = built[0]
    # pip's own wheel cache is keyed by version only: it is kept out of the build
    assert "--no-cache-dir" in command and "llama-cpp-python==0.3.36" in command
    assert cmake == " ".join(first["cmake_args"]) and "-DGGML_NATIVE=ON" in cmake
    folder = (
        tmp_path
        / "pip-cache"
        / "inferlab-peer"
        / (f"llama-cpp-python-0.3.36-native-{first['key']}")
    )
    assert (folder / first["wheel"]).is_file()
    installs = [c for c, _ in pip.calls if c[1:4] == ["-m", "pip", "install"]]
    assert "--force-reinstall" in installs[0] and installs[0][-1].endswith(".whl")
    recorded = json.loads((pip.prefix / peer_build.RECORD_FILE).read_text())
    assert recorded == first and recorded["isa"] == "native"

    pip.calls.clear()
    again = peer_build.build_and_install(sys.executable, "0.3.36", "native")
    assert again["key"] == first["key"]
    assert not [c for c, _ in pip.calls if c[1:4] == ["-m", "pip", "wheel"]]  # reused

    monkeypatch.setattr(peer_build, "cpu_flags", lambda: ["avx2", "fma", "f16c"])
    other_cpu = peer_build.build_and_install(sys.executable, "0.3.36", "native")
    assert other_cpu["key"] != first["key"]  # never the wheel built for the other CPU
    assert [c for c, _ in pip.calls if c[1:4] == ["-m", "pip", "wheel"]]


def test_provenance_records_both_sides_of_the_comparison(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert provenance.isa()["llama_cpp"] is None  # installed some other way: not recorded
    record = {
        "version": "0.3.36",
        "isa": "native",
        "cmake_args": ["-DLLAVA_BUILD=OFF", "-DGGML_OPENMP=OFF", "-DGGML_NATIVE=ON"],
        "compiler": "cc 12",
        "cpu_flags": ["avx512f", "sse2", "avx2", "rdrand"],
    }
    (tmp_path / peer_build.RECORD_FILE).write_text(json.dumps(record))
    isa = provenance.isa()
    assert "-march=native" in isa["lab_kernels"]["flags"]
    assert isa["llama_cpp"] == {**record, "cpu_flags": ["avx512f", "avx2"]}
