"""A GGUF file whose header holds a count or length the file cannot hold (a patched tensor
count, key count, name, string or array length, dimension count, tensor offset, or a file cut
short) is refused before the `gguf` package reads it, in one line naming the file and the
field, exit 2, by every command that reads it: `inferlab kv-calc`, `inferlab convert` and
`inferlab run` (a failed run). Before, each ended in an IndexError traceback from inside the
package's reader."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from checkpoints import run_on_checkpoint, write_tiny_gguf

from harness import cli
from models.gguf import UnsupportedGGUFError, open_gguf, tokenizer_folder


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def string_key_value_at(reader: Any, key: str) -> int:
    """The offset of a string key's value length (after the key's name and value type)."""
    return reader.fields[key].offset + 8 + len(key) + 4


def array_length_at(reader: Any, key: str) -> int:
    return string_key_value_at(reader, key) + 4  # past the item type


def tensor_at(reader: Any, name: str) -> tuple[int, int]:
    """(the offset of the tensor info's dimension count, of its data offset)."""
    tensor = next(t for t in reader.tensors if t.name == name)
    dims = tensor.field.offset + 8 + len(name)
    return dims, dims + 4 + 8 * len(tensor.shape) + 4


#: (how the file is damaged, what the error says after "FILE: "); {size}: the file's size
Patch = Callable[[bytearray, Any], bytearray]


def put(fmt: str, where: Callable[[Any], int], value: int) -> Patch:
    def patch(data: bytearray, reader: Any) -> bytearray:
        struct.pack_into(fmt, data, where(reader), value)
        return data

    return patch


CASES: list[tuple[str, Patch, str]] = [
    (
        "tensor count",
        put("<Q", lambda r: 8, 2**32 - 1),
        "tensor count 4294967295 does not fit the file ({size} bytes)",
    ),
    (
        "key count",
        put("<Q", lambda r: 16, 2**40),
        "key count 1099511627776 does not fit the file ({size} bytes)",
    ),
    (
        "key name length",
        put("<Q", lambda r: 24, 2**62),
        "key #0's name: length 4611686018427387904 does not fit the file ({size} bytes)",
    ),
    (
        "string value length",
        put("<Q", lambda r: string_key_value_at(r, "general.name"), 2**63),
        "key 'general.name': length 9223372036854775808 does not fit the file ({size} bytes)",
    ),
    (
        "array length",
        put("<Q", lambda r: array_length_at(r, "tokenizer.ggml.tokens"), 2**60),
        "key 'tokenizer.ggml.tokens': array length 1152921504606846976 does not fit the file "
        "({size} bytes)",
    ),
    (
        "array item length",
        put("<Q", lambda r: array_length_at(r, "tokenizer.ggml.tokens") + 8, 2**33),
        "key 'tokenizer.ggml.tokens'[0]: length 8589934592 does not fit the file ({size} bytes)",
    ),
    (
        "key name not UTF-8",
        put("<B", lambda r: r.fields["general.name"].offset + 8, 0xFF),
        "key #2's name is not valid UTF-8",
    ),
    (
        "dimension count",
        put("<I", lambda r: tensor_at(r, "blk.0.attn_q.weight")[0], 2**31),
        "tensor 'blk.0.attn_q.weight': 2147483648 dimensions; allowed: at most 4",
    ),
    (
        "tensor data offset",
        put("<Q", lambda r: tensor_at(r, "output_norm.weight")[1], 2**40),
        "tensor 'output_norm.weight': its data (256 bytes at offset 1099511627776) does not "
        "fit the file ({size} bytes)",
    ),
    (
        # inside the file, but not where the tensors before it end: the weights were read from
        # the wrong bytes (here NaN logits, a failed run; other bytes: wrong numbers, silently)
        "tensor data offset misaligned",
        put("<Q", lambda r: tensor_at(r, "blk.0.attn_norm.weight")[1], 3),
        "tensor 'blk.0.attn_norm.weight': its data offset 3 is not where the tensors before it "
        "end (17824, padded to the alignment 32)",
    ),
    (
        "tensor data offset over another tensor",
        put("<Q", lambda r: tensor_at(r, "output_norm.weight")[1], 0),
        "tensor 'output_norm.weight': its data offset 0 is not where the tensors before it end "
        "(64928, padded to the alignment 32)",
    ),
    (
        "header cut short",
        lambda data, reader: data[:20],
        "the GGUF header (24 bytes) does not fit the file (20 bytes)",
    ),
    (
        "file cut short",
        lambda data, reader: data[:-100],  # into the last tensor's data
        "tensor 'output_norm.weight': its data (256 bytes at offset 64928) does not fit the "
        "file ({size} bytes)",
    ),
]


def damaged(good: Path, tmp_path: Path, patch: Patch) -> tuple[Path, str]:
    reader = open_gguf(good)
    data = patch(bytearray(good.read_bytes()), reader)
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    return path, str(len(data))


@pytest.mark.parametrize(("case", "patch", "says"), CASES, ids=[c[0] for c in CASES])
def test_a_header_the_file_cannot_hold_is_one_line_naming_the_field(
    good: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    patch: Patch,
    says: str,
) -> None:
    path, size = damaged(good, tmp_path, patch)
    expected = f"{path}: {says.format(size=size)}"
    assert cli.main(["kv-calc", "model=hf", f"model.path={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert cli.main(["convert", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"inferlab convert: {expected}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_the_undamaged_file_passes(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The damaged files above differ from this one only in the bytes each patches."""
    assert cli.main(["kv-calc", "model=hf", f"model.path={good}"]) == 0
    assert "sequences that fit" in capsys.readouterr().out


def test_inferlab_run_on_a_damaged_header_fails_naming_the_field(
    good: Path, tmp_path: Path
) -> None:
    path, size = damaged(good, tmp_path, CASES[0][1])
    run_dir = tmp_path / "run"
    result = run_on_checkpoint(path, run_dir)
    reason = f"{path}: tensor count 4294967295 does not fit the file ({size} bytes)"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(reason), result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].endswith(reason), summary


def test_a_vocabulary_string_that_is_not_utf8_is_named(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Array items are not decoded by the header check (a vocabulary has 10^5 of them); the
    tokenizer that reads them names the file and the key instead of a bare UnicodeDecodeError."""
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path / "cache"))
    first_token = lambda r: array_length_at(r, "tokenizer.ggml.tokens") + 16  # noqa: E731
    path, _ = damaged(good, tmp_path, put("<B", first_token, 0xFF))
    with pytest.raises(UnsupportedGGUFError) as refused:
        tokenizer_folder(path)
    assert str(refused.value) == (
        f"{path}: tokenizer.ggml.tokens: holds a string that is not valid UTF-8"
    )


def test_the_files_own_alignment_places_the_tensor_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """general.alignment 4096 puts the data further in than the default 32: a file cut inside
    its last tensor is still caught, and the whole file still passes."""
    path = write_tiny_gguf(tmp_path / "aligned.gguf", alignment=4096)
    assert cli.main(["kv-calc", "model=hf", f"model.path={path}"]) == 0
    capsys.readouterr()
    path.write_bytes(path.read_bytes()[:-3900])  # past its padding, into its data
    assert cli.main(["kv-calc", "model=hf", f"model.path={path}"]) == 2
    assert "tensor 'output_norm.weight': its data (256 bytes" in capsys.readouterr().err
