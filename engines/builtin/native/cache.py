"""Building and caching the C kernels' library: one build per machine and source, kept in a
folder only this user can write, verified before every load.

A shared library is mapped, not read: a cached `.so` cut short (a full disk, a `truncate`)
passes `dlopen` and then kills the process with SIGBUS when a page past its end is touched.
So each build records the library's size and SHA-256 beside it, every load checks them
first, and a library that does not match is rebuilt, never loaded. Builds run under a file
lock, so processes starting together on an empty cache build once and all load that build.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from models.cache import cache_dir as inferlab_cache_dir
from models.cache import make_folder

FOLDER = Path(__file__).parent
# the library's C files (cpu_kernels.c, quant_kernels.c) and the headers they share
SOURCES = tuple(sorted(FOLDER.glob("*.c")))
HEADERS = tuple(sorted(FOLDER.glob("*.h")))
# -fno-trapping-math: no kernel reads the floating-point exception flags, and with them kept
# exact GCC 12 would not turn a clamp (exp_f32's) into a blend without AVX-512's masks, so
# that on AVX2 the SiLU and both softmax loops ran one float at a time. Values are unchanged
# (no reassociation, no contraction: that is -ffast-math, never used here).
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")
LOCK_TIMEOUT_S = 300.0  # waiting for another process's build; a build takes ~0.3-3 s
BUILD_TIMEOUT_S = 240.0

log = logging.getLogger(__name__)


class NativeUnavailable(RuntimeError):
    """Why the kernels cannot be built or loaded here (the message is the reason shown)."""


@dataclass(frozen=True)
class Built:
    path: Path
    sha256: str
    how: str  # "cached", "built", or "rebuilt: <why the cached copy was refused>"


def cache_dir() -> Path:
    return inferlab_cache_dir() / "native"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _key(cc: str) -> str:
    try:
        probe = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, check=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"the C compiler {cc!r} does not answer --version: {e}") from e
    version = (probe.stdout or probe.stderr).strip().splitlines()[:1]
    return hashlib.sha256(
        "\n".join(
            [
                *(p.read_text() for p in (*SOURCES, *HEADERS)),
                cc,
                *version,
                " ".join(FLAGS),
                platform.machine(),
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()


def check_private(path: Path) -> None:
    """Refuse a cache folder or file that someone else could write (the lab's one trust rule,
    models.cache.check_trusted): whoever can replace the library runs code in every process
    that loads it."""
    from models.cache import UntrustedCacheError, check_trusted

    try:
        check_trusted(path, "kernel cache")
    except UntrustedCacheError as exc:
        raise NativeUnavailable(str(exc)) from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record_path(target: Path) -> Path:
    return target.with_name(target.name + ".json")


def _problem(target: Path) -> str | None:
    """Why the cached library must not be loaded, or None when it is the recorded build."""
    record_path = _record_path(target)
    if not target.exists():
        return "not built yet"
    check_private(target)
    check_private(record_path)
    try:
        record = json.loads(record_path.read_text())
        size, digest = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"no valid build record ({record_path.name})"
    if target.stat().st_size != size:
        return f"size {target.stat().st_size} bytes, built as {size}"
    if _sha256(target) != digest:
        return "content differs from the build (SHA-256 mismatch)"
    return None


def _recorded_sha256(target: Path) -> str:
    return str(json.loads(_record_path(target).read_text())["sha256"])


def _compile(cc: str, target: Path) -> str:
    """Compile to a temporary file beside `target`, record it, rename both into place (a
    process that mapped the previous library keeps its own copy). Returns the SHA-256."""
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    record_tmp = tmp + ".json"
    try:
        try:
            result = subprocess.run(
                [cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            raise NativeUnavailable(f"{cc} did not finish in {BUILD_TIMEOUT_S:.0f} s") from e
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip()[:500]
            raise NativeUnavailable(f"{cc} failed (exit {result.returncode}): {detail}")
        os.chmod(tmp, 0o644)  # mkstemp's 0600: readable by whoever may read the folder
        digest = _sha256(Path(tmp))
        Path(record_tmp).write_text(
            json.dumps(
                {
                    "size": os.path.getsize(tmp),
                    "sha256": digest,
                    "compiler": cc,
                    "flags": list(FLAGS),
                }
            )
        )
        os.chmod(record_tmp, 0o644)  # not the umask's: it is read as part of the build
        os.replace(tmp, target)
        os.replace(record_tmp, _record_path(target))
    finally:
        for leftover in (tmp, record_tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return digest


def build() -> Built:
    """The verified library for this machine, compiled first if the cache has none (or one
    that does not match its record). Raises NativeUnavailable with the reason otherwise."""
    cc = compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler found (tried $CC, cc, gcc, clang)")
    folder = cache_dir()
    target = folder / f"cpu_kernels-{_key(cc)[:16]}.so"
    try:
        make_folder(folder.parent)
        folder.mkdir(exist_ok=True, mode=0o700)
    except OSError as e:
        raise NativeUnavailable(f"cannot create the kernel cache {folder}: {e}") from e
    check_private(folder)
    lock = FileLock(str(folder / ".lock"), timeout=LOCK_TIMEOUT_S, mode=0o600)
    try:
        lock.acquire()
    except Timeout as e:
        raise NativeUnavailable(
            f"waited {LOCK_TIMEOUT_S:.0f} s for another process's build "
            f"of the kernels ({folder / '.lock'})"
        ) from e
    except OSError as e:  # a read-only cache (a prebuilt image) serves if its build verifies
        problem = _problem(target)
        if problem is None:
            return Built(target, _recorded_sha256(target), "cached (read-only, unlocked)")
        raise NativeUnavailable(
            f"cannot lock the kernel cache {folder} ({e}) and it holds no usable build ({problem})"
        ) from e
    try:
        problem = _problem(target)
        if problem is None:
            return Built(target, _recorded_sha256(target), "cached")
        if problem != "not built yet":
            log.warning("rebuilding the C kernels: the cached %s is refused (%s)", target, problem)
        for stale in folder.glob(".build-*"):  # left by a builder that was killed
            stale.unlink(missing_ok=True)
        digest = _compile(cc, target)
        return Built(
            target, digest, "built" if problem == "not built yet" else f"rebuilt: {problem}"
        )
    except OSError as e:
        raise NativeUnavailable(f"cannot write the kernel cache {folder}: {e}") from e
    finally:
        lock.release()
