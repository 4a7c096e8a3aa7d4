"""file_key: cache entries derived from a file are keyed by its content, so every copy of one
file shares them. Keyed by path, each clean clone of the repository made its own ~3 GB of
GGUF and Hugging Face conversions of the packaged SmolLM2 file, until CI's disk was full."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

import models.cache
from models.cache import file_key


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache; files written just now count as settled (RACY_S tested apart)."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(root))
    monkeypatch.setattr(models.cache, "RACY_S", -1.0)
    return root


def content_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:32]


def memos(cache: Path) -> list[Path]:
    return sorted((cache / "file-digests").iterdir())


def test_copies_share_a_key_and_other_content_does_not(cache: Path, tmp_path: Path) -> None:
    original = tmp_path / "a" / "model.gguf"
    original.parent.mkdir()
    original.write_bytes(os.urandom(3 << 20))
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(original, copy)  # a new path, inode and modification time
    other = tmp_path / "c.gguf"
    other.write_bytes(original.read_bytes()[:-1] + b"\0")

    assert file_key(original) == file_key(copy) == content_digest(original)
    assert file_key(other) == content_digest(other) != file_key(original)


def test_a_rewritten_file_gets_its_new_content_key(cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"first version")
    first = file_key(path)
    path.write_bytes(b"second version, another size")
    assert file_key(path) == content_digest(path) != first
    assert len(memos(cache)) == 2  # one per version of the file


def test_the_digest_is_remembered_per_version(cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    key = file_key(path)
    [memo] = memos(cache)
    assert memo.read_text() == key
    memo.write_text("0123456789abcdef" * 2)  # remembered: the file is not read again
    assert file_key(path) == "0123456789abcdef" * 2


@pytest.mark.parametrize(
    "memo_text", ["", "not a digest", "0123456789ABCDEF" * 2, "0123456789abcdef", "\xff"]
)
def test_a_damaged_memo_is_recomputed(cache: Path, tmp_path: Path, memo_text: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    file_key(path)
    [memo] = memos(cache)
    memo.write_text(memo_text, encoding="latin-1")
    assert file_key(path) == content_digest(path)


def test_an_untrusted_memo_is_not_read(cache: Path, tmp_path: Path) -> None:
    """Whoever can write a memo would choose which cache entries a file loads."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    file_key(path)
    [memo] = memos(cache)
    memo.write_text("0123456789abcdef" * 2)
    memo.chmod(0o666)
    assert file_key(path) == content_digest(path)


def test_a_cache_that_cannot_be_written_still_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(a_file / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    assert file_key(path) == content_digest(path)
    assert a_file.read_text() == "mine"


def test_a_file_changed_just_now_is_not_remembered(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within one timestamp tick, a same-size rewrite keeps the version a memo is filed under
    (git's racily clean entries): such a file is hashed each time until it settles."""
    monkeypatch.setattr(models.cache, "RACY_S", 2.0)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"first")
    assert file_key(path) == content_digest(path)
    assert not (cache / "file-digests").exists()
    path.write_bytes(b"other")  # the same size
    assert file_key(path) == content_digest(path)


def test_a_file_that_changes_while_hashed_is_not_remembered(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights" * 1000)
    real = models.cache.hashlib.sha256

    class Appending:
        def __init__(self) -> None:
            self.inner = real()

        def update(self, chunk: bytes) -> None:
            self.inner.update(chunk)
            if len(chunk) > 4:
                with path.open("ab") as f:  # a download still under way
                    f.write(b"more")

        def hexdigest(self) -> str:
            return self.inner.hexdigest()

    monkeypatch.setattr(models.cache.hashlib, "sha256", lambda *a: real(*a) if a else Appending())
    file_key(path)
    assert not (cache / "file-digests").exists()
