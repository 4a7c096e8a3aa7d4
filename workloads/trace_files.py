"""Opening trace and prompt files: plain or `.gz`, checked before a byte is parsed.

What is refused, each with the file named and the likely cause: a path that is not a regular
file (a directory, a FIFO, a device such as /dev/zero, which would never end), an unreadable
file, compressed data without the `.gz` suffix (or zip, zstd, bzip2, xz, lz4, 7z data, which
are not read directly), a `.gz` name on data that is not gzip, Parquet, UTF-16/UTF-32 text,
binary data (NUL bytes) and bytes that are not UTF-8 (both named by line), gzip data that is
truncated or corrupt, a "line" longer than MAX_LINE_BYTES (a binary or one-line file), and
more data than the limit for data files (models/files.py: 4 GiB after gunzip, or
INFERLAB_MAX_INPUT_BYTES).

`chunks` hands out the file in pieces of about CHUNK_BYTES that end on a record boundary, each
with the number of its first line, so readers can stop after the first pieces and still name
exact lines.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from models.files import DATA, check_regular_file, check_size, max_input_bytes

CHUNK_BYTES = 4 << 20  # what one read hands to the parsers; a few MB parse in milliseconds
FIRST_CHUNK_BYTES = 64 << 10
MAX_LINE_BYTES = 64 << 20  # a record this long means a binary or a one-line file
_SNIFF_BYTES = 4096
_BOM = b"\xef\xbb\xbf"

# (leading bytes, what they mean, what to do about it)
_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\x1f\x8b", "gzip-compressed", "name it {name}.gz to read it compressed, or gunzip it"),
    (b"PK\x03\x04", "a zip archive", "unzip it (only gzip, named .gz, is read compressed)"),
    (
        b"(\xb5/\xfd",
        "zstd-compressed",
        "decompress it (zstd -d) or recompress it with gzip and name it .gz",
    ),
    (
        b"BZh",
        "bzip2-compressed",
        "decompress it (bunzip2) or recompress it with gzip and name it .gz",
    ),
    (
        b"\xfd7zXZ\x00",
        "xz-compressed",
        "decompress it (unxz) or recompress it with gzip and name it .gz",
    ),
    (
        b"\x04\x22\x4d\x18",
        "lz4-compressed",
        "decompress it (lz4 -d) or recompress it with gzip and name it .gz",
    ),
    (b"7z\xbc\xaf\x27\x1c", "a 7z archive", "extract it (only gzip, named .gz, is read)"),
    (b"PAR1", "a Parquet file", "convert it to CSV or JSON Lines"),
)
_WIDE_TEXT: tuple[tuple[bytes, str], ...] = (  # UTF-32 first: its LE BOM starts like UTF-16's
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def file_error(path: str | Path, problem: str, line: int | None = None) -> ValueError:
    where = f"line {line}: " if line is not None else ""
    return ValueError(f"{path}: {where}{problem}")


def _sniff(path: str | Path, head: bytes, compressed: bool) -> None:
    """Refuse compressed data, archives and UTF-16/32 text by their first bytes (NUL bytes
    and other non-UTF-8 bytes are found, by line, as the file is decoded)."""
    for magic, what, advice in _MAGIC:
        if head.startswith(magic):
            advice = advice.format(name=Path(path).name)
            if compressed:
                raise file_error(path, f"the gzip stream holds {what} data, not text; {advice}")
            look = f"looks {what}" if what.endswith("compressed") else f"is {what}"
            raise file_error(
                path, f"{look} (it starts with bytes {magic.hex(' ')}), not text; {advice}"
            )
    for bom, encoding in _WIDE_TEXT:
        if head.startswith(bom):
            raise file_error(
                path,
                f"is {encoding} text (it starts with the byte-order mark "
                f"{bom!r}); convert it to UTF-8, e.g. iconv -f {encoding} "
                "-t UTF-8",
            )


class _Reader:
    """Reads the raw or gunzipped bytes, turning read failures into ValueErrors, and no more
    than the limit for data files (models/files.py), counted after gunzip: a small .gz can
    hold gigabytes."""

    def __init__(self, path: str | Path, raw: BinaryIO, compressed: bool) -> None:
        self.path = path
        self.stream: BinaryIO | gzip.GzipFile = (
            gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw
        )
        self.limit = max_input_bytes(DATA)
        self.total = 0

    def read(self, size: int) -> bytes:
        try:
            data = self.stream.read(min(size, self.limit + 1 - self.total))
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise file_error(self.path, f"the gzip data is truncated or corrupt ({exc})") from exc
        except OSError as exc:
            raise file_error(self.path, f"read failed ({exc.strerror or exc})") from exc
        self.total += len(data)
        check_size(self.path, self.total, DATA, read_so_far=True)
        return data


@contextmanager
def open_data(path: str | Path) -> Iterator[_Reader]:
    """The file's bytes (gunzipped for a `.gz` name) after the checks in the module doc."""
    compressed = str(path).lower().endswith(".gz")
    size = check_regular_file(path).st_size
    if not compressed:  # refused at once, rather than after reading up to the limit
        check_size(path, size, DATA)
    try:
        raw = open(path, "rb")  # noqa: SIM115 - the with below closes it
    except OSError as exc:
        raise file_error(path, f"cannot open it ({exc.strerror})") from exc
    with raw:
        magic = raw.read(2)
        if compressed and not magic:
            raise file_error(path, "is named .gz but is empty (0 bytes, no gzip data)")
        if compressed and magic != b"\x1f\x8b":
            raise file_error(
                path,
                "is named .gz but is not gzip-compressed (it does not start "
                "with the gzip bytes 1f 8b); rename it without .gz if it is text",
            )
        raw.seek(0)
        head = _Reader(path, raw, compressed).read(_SNIFF_BYTES)  # what is inside, if gzip
        _sniff(path, head, compressed)
        raw.seek(0)
        yield _Reader(path, raw, compressed)


@dataclass(frozen=True)
class Chunk:
    data: bytes  # whole records, UTF-8 checked, without a leading byte-order mark
    first_line: int  # 1-based line number of data's first byte
    last: bool  # the file ends with this chunk


def decode(path: str | Path, chunk: Chunk) -> str:
    """The chunk as text; a NUL byte or one that is not UTF-8 is an error naming its line."""
    nul = chunk.data.find(b"\x00")
    if nul >= 0:  # text never holds NUL; binary data or a zero-filled (damaged) block does
        column = nul - (chunk.data.rfind(b"\n", 0, nul) + 1) + 1
        raise file_error(
            path,
            f"binary data (a NUL byte at column {column}), not UTF-8 text "
            "(a binary or damaged file, or UTF-16 without a byte-order mark?)",
            chunk.first_line + chunk.data.count(b"\n", 0, nul),
        )
    try:
        return chunk.data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = chunk.first_line + chunk.data.count(b"\n", 0, exc.start)
        column = exc.start - (chunk.data.rfind(b"\n", 0, exc.start) + 1) + 1
        bad = chunk.data[exc.start : exc.start + 1].hex()
        raise file_error(
            path,
            f"not UTF-8 text (byte 0x{bad} at column {column}); re-encode "
            "the file as UTF-8, e.g. iconv -f latin1 -t UTF-8",
            line,
        ) from exc


def _record_end(data: bytes, quoted: bool) -> int:
    """Index just past the last complete record in data (0: none yet).

    With quoted (CSV), a newline inside a quoted field does not end a record: a newline ends
    one when the quotes before it are even in number (RFC 4180 doubles a literal quote).
    """
    end = data.rfind(b"\n") + 1
    if not quoted or end == 0 or data.find(b'"', 0, end) < 0:
        return end
    buf = np.frombuffer(data, dtype=np.uint8)
    outside = np.cumsum(buf == ord('"')) % 2 == 0
    newlines = np.flatnonzero((buf == ord("\n")) & outside)
    return int(newlines[-1]) + 1 if len(newlines) else 0


def chunks(
    path: str | Path, reader: _Reader, quoted: bool = False, size: int | None = None
) -> Iterator[Chunk]:
    """The file in pieces of up to about `size` bytes (default CHUNK_BYTES), cut after a
    newline that ends a record; each piece's bytes are checked to be UTF-8.

    The first piece is small and each next one 4 times larger, so a reader that needs only
    the first rows reads a few kB, and one that reads everything makes few calls.
    """
    size = size or CHUNK_BYTES
    step = min(FIRST_CHUNK_BYTES, size)
    carry = b""
    line = 1
    block = reader.read(step).removeprefix(_BOM)
    while block:
        step = min(step * 4, size)
        following = reader.read(step)  # read ahead, so a chunk knows whether it is the last
        data = carry + block
        end = len(data) if not following else _record_end(data, quoted)
        if end == 0:
            if len(data) > MAX_LINE_BYTES:
                what = (
                    "a quoted field that does not close (a stray double quote?)"
                    if quoted and data.count(b'"') % 2
                    else "no line break"
                )
                raise file_error(
                    path,
                    f"{what} in {MAX_LINE_BYTES >> 20} MiB: not a line-oriented text file?",
                    line,
                )
            carry, block = data, following
            continue
        chunk = Chunk(data[:end], line, not following)
        decode(path, chunk)
        yield chunk
        line += chunk.data.count(b"\n")
        carry, block = data[end:], following


def read_text(path: str | Path) -> str:
    """The whole file as text (for formats that are one document, such as a JSON array)."""
    with open_data(path) as reader:
        parts = [decode(path, chunk) for chunk in chunks(path, reader)]
    return "".join(parts)


def text_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its \\n or \\r\\n) for each line of the file."""
    with open_data(path) as reader:
        for chunk in chunks(path, reader):
            text = decode(path, chunk)
            if text.endswith("\n"):
                text = text[:-1]
            for offset, line in enumerate(text.split("\n")):
                yield chunk.first_line + offset, line.removesuffix("\r")
