"""models/files.py, the one reader of the files users name: regular files only (a FIFO would
block, /dev/zero never end), within a size limit per kind that INFERLAB_MAX_INPUT_BYTES
replaces; and the readers that use it in models/ and engines/ (tokenizer and model configs,
chat templates, the training text)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from bounded_cli import finishes_within, run_inferlab
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from models.config import UnsupportedCheckpointError, from_hf_config
from models.files import (
    DATA,
    RESULT,
    SETTINGS,
    UserFileError,
    max_input_bytes,
    read_input_bytes,
    read_input_text,
)
from models.tokenizer import load_tokenizer
from models.weights import checkpoint_files


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: Path("/dev/zero"), "/dev/zero: is a character device, not a regular file"),
        (
            lambda tmp: (os.mkfifo(tmp / "fifo"), tmp / "fifo")[1],
            "fifo: is a FIFO (named pipe), not a regular file",
        ),
        (lambda tmp: tmp, ": is a directory, not a regular file"),
        (lambda tmp: tmp / "nope", "nope: cannot open it (No such file or directory)"),
    ],
    ids=["/dev/zero", "fifo", "folder", "missing"],
)
def test_only_regular_files_are_read(
    tmp_path: Path, make: Callable[[Path], Path], message: str
) -> None:
    path = make(tmp_path)
    error = finishes_within(lambda: read_input_bytes(path, SETTINGS))
    assert isinstance(error, UserFileError) and str(error).endswith(message)


def test_the_limits_and_the_one_variable_that_replaces_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("INFERLAB_MAX_INPUT_BYTES", raising=False)
    assert max_input_bytes(SETTINGS) == 64 << 20
    assert max_input_bytes(RESULT) == 1 << 30
    assert max_input_bytes(DATA) == 4 << 30
    path = tmp_path / "r.json"
    path.write_text("x" * 3000)
    for value, limit in (("2048", 2048), ("2K", 2048), ("2 KiB", 2048), ("1g", 1 << 30)):
        monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", value)
        assert max_input_bytes(SETTINGS) == max_input_bytes(DATA) == limit
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "2K")
    with pytest.raises(UserFileError) as exc:
        read_input_text(path, RESULT)
    assert str(exc.value) == (
        f"{path}: 2.93 KiB is more than the 2 KiB allowed for a result file; to read it, "
        "raise the limit with the environment variable INFERLAB_MAX_INPUT_BYTES (e.g. "
        "INFERLAB_MAX_INPUT_BYTES=8G)"
    )
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "3000")
    assert read_input_text(path, RESULT) == "x" * 3000  # the limit itself is allowed
    for bad in ("0", "-5", "lots", "2X"):
        monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", bad)
        with pytest.raises(UserFileError, match=rf"INFERLAB_MAX_INPUT_BYTES: '{bad}' is invalid"):
            read_input_text(path, RESULT)


@pytest.mark.parametrize("limit", ["1T", "8T", "99999999999999999999999999T"])
def test_a_limit_past_any_file_reads_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str
) -> None:
    """INFERLAB_MAX_INPUT_BYTES=1T (the T suffix it documents) made every read a MemoryError
    (read(n) allocates n bytes first), and a limit past 2^63 an OverflowError."""
    path = tmp_path / "t.json"
    path.write_text('{"a": 1}')
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", limit)
    assert read_input_text(path, RESULT) == '{"a": 1}'


def test_a_file_that_grew_since_its_size_was_taken_is_read_to_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.txt"
    path.write_text("abc")
    real_stat = os.stat

    def stale_stat(p: object, *args: object, **kwargs: object) -> os.stat_result:
        st = real_stat(p, *args, **kwargs)  # type: ignore[arg-type]
        return os.stat_result((st.st_mode, *st[1:6], 1, *st[7:]))  # st_size 1: it grew since

    monkeypatch.setattr(os, "stat", stale_stat)
    assert read_input_text(path, DATA) == "abc"
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "2")
    with pytest.raises(UserFileError, match=r"t\.txt: holds more than the 2 bytes allowed"):
        read_input_text(path, DATA)


def test_text_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"ok\xff")
    with pytest.raises(UserFileError, match=r"t\.txt: not UTF-8 text \(byte 2\)"):
        read_input_text(path, DATA)


def _tokenizer_folder(folder: Path) -> Path:
    backend = Backend(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    return folder


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_a_tokenizer_folders_files_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A tokenizer folder's files were read whole whatever their size."""
    folder = _tokenizer_folder(tmp_path)
    with open(folder / name, "a") as f:  # the one file over the limit; whitespace keeps it valid
        f.write(" " * 1000)
    assert load_tokenizer(folder).chat_template.startswith("{{ messages[0]['content'] }}")
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "1000")
    with pytest.raises(ValueError, match=rf"{name}: .* allowed for a settings file"):
        load_tokenizer(folder)


def test_a_models_config_json_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}) + " " * 100)
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "64")
    with pytest.raises(UnsupportedCheckpointError, match="allowed for a settings file"):
        from_hf_config(tmp_path)


def test_a_safetensors_index_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index) + " " * 100)
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"")
    assert checkpoint_files(tmp_path) == [tmp_path / "model-00001-of-00001.safetensors"]
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "64")
    with pytest.raises(UserFileError, match=r"index\.json: .* allowed for a settings file"):
        checkpoint_files(tmp_path)


DEEP_JSON = "[" * 100_000  # nested past Python's recursion limit


def test_a_deeply_nested_settings_file_is_named_not_a_recursion_error(tmp_path: Path) -> None:
    """config.json, tokenizer_config.json or a safetensors index of 100,000 `[` ended a run in
    'RecursionError: maximum recursion depth exceeded' (exit 1; kv-calc: a traceback)."""
    (tmp_path / "config.json").write_text(DEEP_JSON)
    with pytest.raises(UnsupportedCheckpointError, match=r"config\.json: not valid JSON \(nested"):
        from_hf_config(tmp_path)
    (tmp_path / "tok").mkdir()
    folder = _tokenizer_folder(tmp_path / "tok")
    (folder / "tokenizer_config.json").write_text(DEEP_JSON)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json' is not valid JSON: nested"):
        load_tokenizer(folder)
    (tmp_path / "model.safetensors.index.json").write_text(DEEP_JSON)
    with pytest.raises(ValueError, match=r"index\.json: not a valid safetensors index .*Recursion"):
        checkpoint_files(tmp_path)


def test_a_weights_file_that_is_a_fifo_is_named(tmp_path: Path) -> None:
    """A model.safetensors that is a FIFO was reported as a missing shard."""
    os.mkfifo(tmp_path / "model.safetensors")
    error = finishes_within(lambda: checkpoint_files(tmp_path))
    assert isinstance(error, UserFileError)
    assert (
        str(error)
        == f"{tmp_path / 'model.safetensors'}: is a FIFO (named pipe), not a regular file"
    )


def test_train_tiny_refuses_dev_zero_as_its_text(tmp_path: Path) -> None:
    """`inferlab train-tiny --text /dev/zero` (and the quality probe's run.quality.text, read
    the same way) read until memory ran out."""
    done = run_inferlab("train-tiny", "--text", "/dev/zero", "--out", str(tmp_path / "m"))
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "inferlab train-tiny: --text: /dev/zero: is a character device, not a regular file\n"
    )
    assert not (tmp_path / "m").exists()
