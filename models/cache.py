"""The on-disk cache every part of the lab shares (the default tokenizer, the tiny trained
model, native kernels, hardware calibration): $INFERLAB_CACHE_DIR, else ~/.cache/inferlab."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    if env := os.environ.get("INFERLAB_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "inferlab"


def write_text_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Readers see no file or a complete one, so concurrent processes may race to fill the
    cache. `mode`: mkstemp makes files owner-only; a shared cache should be readable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False
    ) as f:
        tmp = Path(f.name)
        try:
            f.write(text)
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
    try:
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_key(path: str | os.PathLike[str]) -> str:
    """A short digest naming one version of a file: its resolved path, size and modification
    time (what a cache entry derived from the file is keyed by)."""
    stat = Path(path).stat()
    key = f"{Path(path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def build_folder_once(folder: Path, marker: str, build: Callable[[Path], object]) -> Path:
    """`folder`, built by `build(staging)` in a staging folder beside it and renamed into place
    unless `folder/marker` already exists: readers see it whole or not at all, and when
    processes race, the first rename wins and the others' copies (as good) are dropped."""
    if (folder / marker).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build(staging)
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
