"""The on-disk cache every part of the lab shares (the default tokenizer, the tiny trained
model, native kernels, hardware calibration): $INFERLAB_CACHE_DIR, else ~/.cache/inferlab."""

from __future__ import annotations

import os
import tempfile
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
