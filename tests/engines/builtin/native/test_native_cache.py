"""The C kernels' cache (engines/builtin/native/cache.py): a damaged library is rebuilt, never
loaded; a cache others can write is refused; why the kernels are off is said; parallel first
runs build once."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.builtin import native
from engines.builtin.config import EngineConfig
from engines.builtin.engine import LLMEngine
from engines.builtin.native import cache

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache folder holding one good build (each test copies it rather than compiling)."""
    root = tmp_path_factory.mktemp("good-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFERLAB_CACHE_DIR", str(root))
        cache.build()
    yield root


def cache_from(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str = "cache"
) -> Path:
    """A private copy of the good cache as this test's INFERLAB_CACHE_DIR; returns the .so."""
    cache = tmp_path / name
    shutil.copytree(good, cache)
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(cache))
    monkeypatch.setattr(native, "_state", {})  # load afresh; restored for the other tests
    (library,) = (cache / "native").glob("cpu_kernels-*.so")
    return library


def test_a_good_cache_is_loaded_as_it_is(
    good_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = cache_from(good_cache, tmp_path, monkeypatch)
    before = library.stat().st_mtime_ns
    assert native.load() is not None, native.reason()
    assert native.info()["cache"] == "cached"
    assert native.info()["library"] == str(library)
    assert library.stat().st_mtime_ns == before


def test_a_truncated_library_is_rebuilt_not_loaded(
    good_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Today `truncate -s 1000` on the cached .so kills every run with SIGBUS (exit 135): run
    it in a child so that a crash is a failure here, not the end of pytest."""
    library = cache_from(good_cache, tmp_path, monkeypatch)
    good = library.read_bytes()
    os.truncate(library, 1000)
    script = (
        "import json; from engines.builtin import native; lib = native.load(); "
        "print(json.dumps({'loaded': lib is not None, 'reason': native.reason(), "
        "'info': getattr(native, 'info', dict)()}))"
    )
    child = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["loaded"], result
    assert result["info"]["cache"].startswith("rebuilt: size 1000 bytes"), result
    assert library.read_bytes() == good  # the same compiler and flags give the same bytes


@pytest.mark.parametrize("damage", ["garbage", "one byte changed", "no build record"])
def test_a_damaged_library_is_rebuilt(
    damage: str, good_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = cache_from(good_cache, tmp_path, monkeypatch)
    good = library.read_bytes()
    if damage == "garbage":
        library.write_bytes(b"\x7fELF but not a library " * 64)
    elif damage == "one byte changed":  # same size: only the hash can tell
        data = bytearray(good)
        data[len(data) // 2] ^= 0xFF
        library.write_bytes(bytes(data))
    else:
        library.with_name(library.name + ".json").unlink()
    assert native.load() is not None, native.reason()
    assert native.info()["cache"].startswith("rebuilt: "), native.info()
    assert library.read_bytes() == good
    assert (
        native.info()["sha256"]
        == json.loads(library.with_name(library.name + ".json").read_text())["sha256"]
    )


@pytest.mark.parametrize(
    "who",
    [
        "world-writable folder",
        "group-writable library",
        "another user's folder",
        "another user's build record",
        "world-writable cache root",
    ],
)
def test_a_cache_others_can_write_is_refused(
    who: str, good_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = cache_from(good_cache, tmp_path, monkeypatch)
    if who == "world-writable folder":
        library.parent.chmod(0o777)
        expected = "writable by group or others (mode 0o777)"
    elif who == "group-writable library":
        library.chmod(0o664)
        expected = "writable by group or others (mode 0o664)"
    elif who == "another user's build record":  # its size and hash vouch for the library
        os.chown(library.with_name(library.name + ".json"), 12345, -1)
        expected = "owned by uid 12345, not by this user"
    elif who == "world-writable cache root":  # INFERLAB_CACHE_DIR itself
        library.parent.parent.chmod(0o777)
        expected = f"{library.parent.parent}: writable by group or others (mode 0o777)"
    else:  # the folder is ours; to the check it belongs to someone else
        me = os.getuid()
        monkeypatch.setattr(cache.os, "getuid", lambda: me + 1)
        expected = f"owned by uid {me}, not by this user"
    assert native.load() is None
    assert "refused the kernel cache" in native.reason() and expected in native.reason()
    assert stat.S_IMODE(library.stat().st_mode) in (0o644, 0o664)  # left alone, not rebuilt


def test_a_read_only_cache_serves_a_verified_build_and_nothing_else(
    good_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prebuilt cache on a read-only mount: no lock file can be made there."""

    class ReadOnly:
        def __init__(self, path: str, **_: object) -> None:
            self.path = path

        def acquire(self) -> None:
            raise PermissionError(30, "Read-only file system", self.path)

    monkeypatch.setattr(cache, "FileLock", ReadOnly)
    library = cache_from(good_cache, tmp_path, monkeypatch)
    assert native.load() is not None, native.reason()
    assert native.info()["cache"] == "cached (read-only, unlocked)"
    # another copy: truncating the library this process has mapped would SIGBUS it at exit
    library = cache_from(good_cache, tmp_path, monkeypatch, name="damaged")
    os.truncate(library, 1000)
    assert native.load() is None
    built_size = (good_cache / "native" / library.name).stat().st_size
    assert native.reason().endswith(
        f"holds no usable build (size 1000 bytes, built as {built_size})"
    )


def test_without_a_compiler_the_engine_says_why_the_kernels_are_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang on it
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native, "_state", {})
    engine = LLMEngine(
        EngineConfig(model="tiny", max_model_len=64, max_num_seqs=2, kv_cache_memory_bytes=1 << 20)
    )
    facts = engine.describe()
    assert facts["native_kernels"] is False
    assert facts["native_kernels_reason"] == "no C compiler found (tried $CC, cc, gcc, clang)"
    assert facts["native_kernels_isa"] is None
    off = LLMEngine(
        EngineConfig(
            model="tiny",
            native_kernels=False,
            max_model_len=64,
            max_num_seqs=2,
            kv_cache_memory_bytes=1 << 20,
        )
    ).describe()
    assert off["native_kernels_reason"] == "engine.native_kernels=false"


def test_a_failed_build_is_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = tmp_path / "broken-cc"
    compiler.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then echo "broken-cc 1.0"; exit 0; fi
        echo "cpu_kernels.c:1: error: the compiler is broken" >&2
        exit 1
        """)
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_state", {})
    assert native.load() is None
    assert native.reason() == (
        f"{compiler} failed (exit 1): cpu_kernels.c:1: error: the compiler is broken"
    )
    assert not list((tmp_path / "cache" / "native").glob("*.so*"))  # no half-built leftovers


def test_parallel_first_runs_build_once_and_all_load(tmp_path: Path) -> None:
    """Two processes start on an empty cache at the same moment: one compiles (slowed by a
    second, so that today's code would compile twice), the other waits for its build."""
    real = cache.compiler()
    assert real is not None, "the test needs the machine's C compiler"
    calls = tmp_path / "compiles.log"
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" != "--version" ]; then echo "$$" >> {calls}; sleep 1; fi
        exec {shutil.which(real)} "$@"
        """)
    )
    wrapper.chmod(0o755)
    go = tmp_path / "go"
    script = textwrap.dedent("""\
        import json, sys, time
        from pathlib import Path
        from engines.builtin import native
        Path(sys.argv[1]).touch()
        while not Path(sys.argv[2]).exists():
            time.sleep(0.005)
        lib = native.load()
        print(json.dumps({"loaded": lib is not None, "reason": native.reason(),
                          "info": getattr(native, "info", dict)()}))
        """)
    env = {**os.environ, "CC": str(wrapper), "INFERLAB_CACHE_DIR": str(tmp_path / "cache")}
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), str(go)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ready
    ]
    try:
        deadline = time.monotonic() + 600
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline and all(c.poll() is None for c in children)
            time.sleep(0.01)
        go.touch()
        outputs = [c.communicate(timeout=600) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert all(r["loaded"] for r in results), results
    assert len(calls.read_text().split()) == 1  # one compile between them
    assert sorted(r["info"]["cache"] for r in results) == ["built", "cached"]
    assert results[0]["info"]["sha256"] == results[1]["info"]["sha256"]
