"""The on-disk cache every part of the lab shares (the default tokenizer, the tiny trained
model, GGUF tokenizers and conversions, native kernels, hardware calibration):
$INFERLAB_CACHE_DIR, else ~/.cache/inferlab.

One trust rule for everything read from it (`check_trusted`): the entry, and every folder from
the cache's root down to it, must be owned by this user and writable by no one else. Whoever
can write an entry chooses what the lab loads: a tokenizer, weights, a calibration, or a
shared library that runs in every process. An entry that breaks the rule is refused, never
read and never rebuilt in place (another user could replace the rebuild too); the error
names it and the fix. Everything the cache makes is made so that it keeps the rule, whatever
the umask (a user-private-group umask of 002 makes files group-writable).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

FOLDER_MODE = 0o755  # masked by the umask as usual, but never group- or other-writable


class UntrustedCacheError(ValueError):
    """A cache entry (or a folder above it) that someone other than this user could have
    written; the message names it and how to fix it."""


def cache_dir() -> Path:
    if env := os.environ.get("INFERLAB_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "inferlab"


def check_trusted(path: Path, what: str, root: Path | None = None) -> Path:
    """`path`, once it and each folder from `root` (default: the cache's) down to it that
    exists is owned by this user and not writable by group or others; UntrustedCacheError
    naming the first that is not, and `what` it is, otherwise. A `path` outside `root` is
    checked alone. What does not exist yet is left for this user to make."""
    root = cache_dir() if root is None else root
    try:
        inside = path.relative_to(root)
    except ValueError:
        chain = [path]
    else:
        chain = [root, *(root / Path(*inside.parts[: i + 1]) for i in range(len(inside.parts)))]
    for entry in chain:
        _check_entry(entry, what)
    return path


def check_trusted_tree(folder: Path, what: str) -> Path:
    """`check_trusted` for `folder` and for everything inside it."""
    check_trusted(folder, what)
    for parent, folders, files in os.walk(folder):
        for name in [*folders, *files]:
            _check_entry(Path(parent) / name, what)
    return folder


def _check_entry(entry: Path, what: str) -> None:
    try:
        info = entry.stat()
    except (FileNotFoundError, NotADirectoryError):  # nothing there to read
        return
    except OSError as exc:  # a symlink loop, a folder this user may not search
        raise CacheFolderError(
            f"cannot read the {what} {entry}: {exc.strerror or exc}; set INFERLAB_CACHE_DIR "
            "to a folder you can write"
        ) from exc
    if info.st_uid != os.getuid():
        raise UntrustedCacheError(
            f"refused the {what} {entry}: owned by uid {info.st_uid}, not by this user "
            f"(uid {os.getuid()}); set INFERLAB_CACHE_DIR to a folder of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedCacheError(
            f"refused the {what} {entry}: writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):#o}); `chmod go-w {entry}` or set INFERLAB_CACHE_DIR "
            "to a folder only you can write"
        )


class CacheFolderError(OSError, ValueError):
    """A cache folder that cannot be made (INFERLAB_CACHE_DIR names a file, a read-only place):
    an OSError to the callers that go on without the cache (the kernels), a configuration
    error (ValueError) to the commands, in one line naming the folder and the fix."""


def make_folder(folder: Path) -> None:
    """`mkdir -p` whose new levels are FOLDER_MODE (Path.mkdir(parents=True) makes the
    parents it adds group-writable under a umask of 002)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for level in reversed(missing):
        try:
            level.mkdir(mode=FOLDER_MODE, exist_ok=True)  # exists: another made it first
        except OSError as exc:
            raise CacheFolderError(
                f"cannot make the cache folder {level}: {exc.strerror or exc}; set "
                "INFERLAB_CACHE_DIR to a folder you can write"
            ) from exc


def drop_group_write(path: Path) -> None:
    """Clear the group and other write bits of `path` and of everything inside it."""
    entries = [path, *path.rglob("*")] if path.is_dir() else [path]
    for entry in entries:
        mode = stat.S_IMODE(entry.lstat().st_mode)
        if mode & 0o022 and not entry.is_symlink():
            entry.chmod(mode & ~0o022)


def write_text_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Readers see no file or a complete one, so concurrent processes may race to fill the
    cache. `mode`: mkstemp makes files owner-only; a shared cache should be readable."""
    make_folder(path.parent)
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


#: a memo written less than this after the file last changed may describe bytes that change
#: again within one timestamp tick (git's "racily clean" entries): it is not written
RACY_S = 2.0


def file_key(path: str | os.PathLike[str]) -> str:
    """A digest of a file's content: what a cache entry derived from the file is keyed by, so
    that every copy of one file (another clone's venv, a copy in a temporary folder) shares its
    entries, where a key by path made a new set of conversions per copy. Hashing gigabytes
    takes seconds, so each version of a file (its resolved path, device, inode, size,
    modification and change times) has its digest remembered in the cache's `file-digests`
    folder; a version seen changing while it was hashed, or changed within RACY_S of now, is
    not remembered."""
    source = Path(path).resolve()
    with source.open("rb") as f:
        before = os.fstat(f.fileno())
        version = (
            f"{source}:{before.st_dev}:{before.st_ino}:{before.st_size}:"
            f"{before.st_mtime_ns}:{before.st_ctime_ns}"
        )
        memo = cache_dir() / "file-digests" / hashlib.sha256(version.encode()).hexdigest()[:32]
        if (remembered := _remembered_digest(memo)) is not None:
            return remembered
        digest = hashlib.sha256()
        while chunk := f.read(1 << 24):
            digest.update(chunk)
        after = os.fstat(f.fileno())
    key = digest.hexdigest()[:32]
    unchanged = (before.st_size, before.st_mtime_ns, before.st_ctime_ns) == (
        after.st_size,
        after.st_mtime_ns,
        after.st_ctime_ns,
    )
    settled = time.time_ns() - max(after.st_mtime_ns, after.st_ctime_ns) > RACY_S * 1e9
    if unchanged and settled:
        try:
            check_trusted(memo.parent, "file digest cache")
            write_text_atomic(memo, key)
        except (OSError, UntrustedCacheError):  # the key is right, only slower next time
            pass
    return key


def _remembered_digest(memo: Path) -> str | None:
    """The digest in `memo`, unless it is missing, damaged, or someone else could have written
    it (it would choose the entries loaded)."""
    try:
        check_trusted(memo, "file digest cache")
        text = memo.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, UntrustedCacheError):
        return None
    if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
        return text
    return None


def code_key(*modules: ModuleType, extra: str = "") -> str:
    """Eight hex digits naming the code that makes a cache entry: the source files of
    `modules` (and `extra`, a library's version): entries are shared by every copy of a file,
    so a change to a converter must make new ones, not reuse another version's."""
    digest = hashlib.sha256(extra.encode())
    for module in modules:
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()[:8]


def build_folder_once(
    folder: Path, marker: str, build: Callable[[Path], object], what: str
) -> Path:
    """`folder`, built by `build(staging)` in a staging folder beside it and renamed into place
    unless `folder/marker` already exists: readers see it whole or not at all, and when
    processes race, the first rename wins and the others' copies (as good) are dropped.
    `folder` and all it holds must keep the trust rule (`what` names it in the error)."""
    check_trusted(folder, what)
    if (folder / marker).is_file():
        return check_trusted_tree(folder, what)
    make_folder(folder.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build(staging)
        drop_group_write(staging)  # what `build` wrote with the umask's modes
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
