"""One trust rule for everything the lab reads from its cache (models/cache.py check_trusted):
the entry and every folder from the cache's root down to it are owned by this user and
writable by no one else. Before, only the kernel cache checked it: with INFERLAB_CACHE_DIR on a
world-writable folder, or an entry another user had put there, the default tokenizer, the
hardware calibration, the trained tiny model, a GGUF file's tokenizer and a converted GGUF
file were read as they were. Each is now refused in one line naming the entry and the fix.
(The tests run as root: os.chown gives a file to another uid.)"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import write_tiny_gguf

from harness.cli import main as inferlab
from harness.measuring import hardware
from models.cache import (
    UntrustedCacheError,
    build_folder_once,
    check_trusted,
    make_folder,
)
from models.gguf import tokenizer_cache_folder, tokenizer_folder
from models.gguf_quantize import derived_gguf, derived_gguf_path
from models.tokenizer import default_tokenizer
from models.train_tiny import cache_key, cached_tiny_model

OTHER_UID = 12345
TINY_PROBE = {"probe_bytes": 1 << 20, "matmul_size": 64}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache root (0o755, this user's) as INFERLAB_CACHE_DIR."""
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o755)
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(root))
    return root


@pytest.fixture(autouse=True)
def _native_kernels_state_kept() -> Iterator[None]:
    """A test here may be the process's first to load the C kernels, under a cache it breaks
    on purpose: that failure is remembered (native.load), and must not stay for the tests
    after it (run alone, tests/engines/builtin/test_decode_program.py found no kernels)."""
    from engines.builtin import native

    saved = dict(native._state)
    yield
    native._state.clear()
    native._state.update(saved)


@pytest.fixture
def fresh_default_tokenizer() -> Iterator[None]:
    """The default tokenizer is loaded once per process: these tests load it afresh."""
    default_tokenizer.cache_clear()
    yield
    default_tokenizer.cache_clear()


def world_writable_root(cache: Path, entry: Path) -> tuple[Path, str]:
    cache.chmod(0o777)
    return cache, (
        f"writable by group or others (mode 0o777); `chmod go-w {cache}` or set "
        "INFERLAB_CACHE_DIR to a folder only you can write"
    )


def another_users_entry(cache: Path, entry: Path) -> tuple[Path, str]:
    os.chown(entry, OTHER_UID, -1)
    return entry, (
        f"owned by uid {OTHER_UID}, not by this user (uid {os.getuid()}); set "
        "INFERLAB_CACHE_DIR to a folder of your own"
    )


UNTRUSTED = [world_writable_root, another_users_entry]


def test_the_rule(cache: Path) -> None:
    entry = cache / "sub" / "file.json"
    make_folder(entry.parent)
    entry.write_text("{}")
    assert check_trusted(entry, "test cache") == entry
    assert check_trusted(cache / "absent" / "x", "test cache") == cache / "absent" / "x"
    (cache / "sub").chmod(0o775)  # group-writable: refused too
    with pytest.raises(UntrustedCacheError, match=r"refused the test cache .*/sub: writable by"):
        check_trusted(entry, "test cache")


def test_folders_the_cache_makes_keep_the_rule_under_a_group_umask(cache: Path) -> None:
    """A user-private-group umask (002) made Path.mkdir(parents=True)'s folders and a build's
    files group-writable: the next read would refuse them."""
    old = os.umask(0o002)
    try:
        folder = build_folder_once(
            cache / "a" / "b" / "built",
            "done",
            lambda out: (out / "done").write_text("x"),
            "test cache",
        )
    finally:
        os.umask(old)
    for entry in (cache / "a", cache / "a" / "b", folder, folder / "done"):
        assert not stat.S_IMODE(entry.stat().st_mode) & 0o022, entry


Entry = Callable[[Path, Path], tuple[Path, Callable[[], object], str]]


def tokenizer_entry(cache: Path, tmp_path: Path) -> tuple[Path, Callable[[], object], str]:
    default_tokenizer()  # trained once into this cache
    (entry,) = cache.glob("tokenizer-*.json")
    default_tokenizer.cache_clear()
    return entry, default_tokenizer, "tokenizer cache"


def hardware_entry(cache: Path, tmp_path: Path) -> tuple[Path, Callable[[], object], str]:
    entry = hardware.cache_path(torch.get_num_threads())
    make_folder(entry.parent)
    entry.write_text('{"settings": "of another probe"}')
    return entry, lambda: hardware.cpu_spec(**TINY_PROBE), "hardware calibration cache"


def tiny_model_entry(cache: Path, tmp_path: Path) -> tuple[Path, Callable[[], object], str]:
    entry = cache / f"tiny-trained-{cache_key()}" / "config.json"
    make_folder(entry.parent)
    entry.write_text("{}")  # a finished build: nothing would be trained
    return entry, cached_tiny_model, "trained-model cache"


def gguf_tokenizer_entry(cache: Path, tmp_path: Path) -> tuple[Path, Callable[[], object], str]:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    entry = tokenizer_cache_folder(gguf) / "tokenizer_config.json"
    make_folder(entry.parent)
    entry.write_text("{}")
    return entry, lambda: tokenizer_folder(gguf), "GGUF tokenizer cache"


def converted_gguf_entry(cache: Path, tmp_path: Path) -> tuple[Path, Callable[[], object], str]:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    entry = derived_gguf_path(gguf, "f16")
    make_folder(entry.parent)
    entry.write_bytes(b"GGUF another user's conversion")
    return entry, lambda: derived_gguf(gguf, "f16"), "converted GGUF cache"


READERS = [tokenizer_entry, hardware_entry, tiny_model_entry, gguf_tokenizer_entry,
           converted_gguf_entry]  # fmt: skip


@pytest.mark.usefixtures("fresh_default_tokenizer")
@pytest.mark.parametrize("untrusted", UNTRUSTED, ids=lambda f: f.__name__)
@pytest.mark.parametrize("reader", READERS, ids=lambda f: f.__name__.removesuffix("_entry"))
def test_every_cache_reader_refuses_an_untrusted_entry(
    cache: Path, tmp_path: Path, reader: Entry, untrusted: Callable[..., tuple[Path, str]]
) -> None:
    entry, read, what = reader(cache, tmp_path)
    refused, says = untrusted(cache, entry)
    before = entry.read_bytes()
    with pytest.raises(UntrustedCacheError) as error:
        read()
    assert str(error.value) == f"refused the {what} {refused}: {says}"
    assert entry.read_bytes() == before  # left as it was: neither read nor rebuilt over


def test_kv_calc_on_an_untrusted_cache_is_one_line(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """hardware=cpu reads the calibration cache: refused before anything is probed."""
    cache.chmod(0o777)
    assert inferlab(["kv-calc", "model=tiny", "hardware=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: refused the hardware calibration cache {cache}: writable")
    assert err.count("\n") == 1


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_cache_that_cannot_be_made_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """INFERLAB_CACHE_DIR naming a file (or a read-only place): kv-calc hardware=cpu ended in
    a NotADirectoryError traceback, and inferlab run failed with it, exit 1."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    root = a_file if where == "a file" else a_file / "cache"
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(root))
    with pytest.raises(ValueError, match=r"set INFERLAB_CACHE_DIR to a folder you can write$"):
        make_folder(root / "hardware")
    assert inferlab(["kv-calc", "model=tiny", "hardware=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot make the cache folder {root}") and err.count("\n") == 1
    assert a_file.read_text() == "mine"


@pytest.mark.usefixtures("fresh_default_tokenizer")
def test_a_cache_that_is_a_symlink_loop_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """INFERLAB_CACHE_DIR on a symlink loop: inferlab run failed with 'OSError: [Errno 40] Too
    many levels of symbolic links', exit 1; kv-calc hardware=cpu the same."""
    loop = tmp_path / "a"
    loop.symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(loop)
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(loop))
    with pytest.raises(ValueError) as refused:
        default_tokenizer()
    assert str(refused.value) == (
        f"cannot read the tokenizer cache {loop}: Too many levels of symbolic links; set "
        "INFERLAB_CACHE_DIR to a folder you can write"
    )
    assert inferlab(["kv-calc", "model=tiny", "hardware=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read the hardware calibration cache {loop}: Too many")
    assert err.count("\n") == 1
