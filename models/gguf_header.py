"""A GGUF file's header checked against the file's size before the `gguf` package reads it.

The package's reader trusts every count and length in the header: a tensor count, key count or
string length patched to 2^32 ended in an IndexError deep inside it, and a length that does fit
a 64-bit offset could make it map or allocate what the file does not hold. Here the header is
walked once with the same layout (GGUF v2/v3: counts and lengths are uint64), each count and
length checked against the bytes left, and the first that does not fit is named with the file.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, key count
MIN_KEY_BYTES = 8 + 4 + 1  # an empty name, a value type, a one-byte value
MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # an empty name, no dimensions, a type, an offset
MAX_DIMS = 4  # GGML_MAX_DIMS
UINT32, STRING, ARRAY = 4, 8, 9
#: The size of each fixed-size value type (GGUFValueType: UINT8 ... FLOAT64).
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
DEFAULT_ALIGNMENT = 32


class GGUFHeaderError(ValueError):
    """A count or length in a GGUF header that the file cannot hold."""


class _Walker:
    """Reads the header from the front, refusing any read past the file's end."""

    def __init__(self, path: str | Path, data: Any, order: str) -> None:
        self.path, self.data, self.order, self.offset = path, data, order, 0
        self.size = len(data)

    def fail(self, what: str) -> GGUFHeaderError:
        return GGUFHeaderError(f"{self.path}: {what} does not fit the file ({self.size} bytes)")

    def left(self) -> int:
        return self.size - self.offset

    def number(self, fmt: str, what: str) -> Any:
        width = struct.calcsize(fmt)
        if width > self.left():
            raise self.fail(what)
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += width
        return value

    def skip(self, count: int, width: int, what: str) -> None:
        if count * width > self.left():
            raise self.fail(what)
        self.offset += count * width

    def string(self, what: str) -> str:
        length = self.number("Q", what)
        if length > self.left():
            raise self.fail(f"{what}: length {length}")
        start = self.offset
        self.offset += length
        try:  # the reader decodes every string too, and its error would name no file
            return str(self.data[start : self.offset], "utf-8")
        except UnicodeDecodeError:
            raise GGUFHeaderError(f"{self.path}: {what} is not valid UTF-8") from None

    def value(self, kind: int, what: str) -> Any:
        if kind == STRING:
            return self.string(what)
        if kind in SCALAR_BYTES:
            fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[SCALAR_BYTES[kind]]
            return self.number(fmt, what)
        if kind != ARRAY:
            raise GGUFHeaderError(f"{self.path}: {what}: value type {kind} is not a GGUF type")
        item_kind = self.number("I", f"{what}: the array's item type")
        count = self.number("Q", f"{what}: the array's length")
        if item_kind in SCALAR_BYTES:
            self.skip(count, SCALAR_BYTES[item_kind], f"{what}: array length {count}")
            return None
        if count * (8 if item_kind == STRING else 12) > self.left():
            raise self.fail(f"{what}: array length {count}")
        if item_kind == STRING:
            self.skip_strings(count, what)
            return None
        for index in range(count):
            self.value(item_kind, f"{what}[{index}]")
        return None

    def skip_strings(self, count: int, what: str) -> None:
        """Past an array of `count` strings (a vocabulary: 10^5 of them), checking only their
        lengths: the one loop of the walk that runs per item, kept tight."""
        length_at = struct.Struct(self.order + "Q").unpack_from
        data, offset, size = self.data, self.offset, self.size
        for index in range(count):
            if offset + 8 > size:
                raise self.fail(f"{what}[{index}]")
            (length,) = length_at(data, offset)
            offset += 8
            if length > size - offset:
                raise self.fail(f"{what}[{index}]: length {length}")
            offset += length
        self.offset = offset


def check_gguf_header(path: str | Path) -> None:
    """Raise GGUFHeaderError naming the file and the field when a count or length in the
    header (tensors, keys, names, strings, arrays, dimensions, tensor data) does not fit the
    file. A file that is not GGUF v2/v3 at all is left to the reader to refuse."""
    with open(path, "rb") as f:
        start = f.read(8)
        if len(start) < 8 or start[:4] != MAGIC:
            return
        # a version whose low half is zero was written in the other byte order
        order = ">" if struct.unpack_from("<I", start, 4)[0] & 0xFFFF == 0 else "<"
        if struct.unpack_from(order + "I", start, 4)[0] not in (2, 3):
            return
        size = Path(path).stat().st_size
        if size < HEADER_BYTES:
            raise GGUFHeaderError(
                f"{path}: the GGUF header ({HEADER_BYTES} bytes) does not fit the file "
                f"({size} bytes)"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _walk(_Walker(path, data, order))


def _walk(header: _Walker) -> None:
    header.offset = 8
    tensors = header.number("Q", "tensor count")
    keys = header.number("Q", "key count")
    if tensors * MIN_TENSOR_BYTES > header.left():
        raise header.fail(f"tensor count {tensors}")
    if keys * MIN_KEY_BYTES > header.left():
        raise header.fail(f"key count {keys}")
    alignment = DEFAULT_ALIGNMENT
    for index in range(keys):
        name = header.string(f"key #{index}'s name")
        kind = header.number("I", f"key {name!r}: its value type")
        value = header.value(kind, f"key {name!r}")
        if name == "general.alignment" and kind == UINT32 and value > 0 and not value & (value - 1):
            alignment = value  # the reader refuses any other, after this check
    infos = [_tensor_info(header, index) for index in range(tensors)]
    data_start = -(-header.offset // alignment) * alignment
    expected = 0  # each tensor's data follows the last, padded to the alignment (llama.cpp's rule)
    for name, offset, nbytes in infos:
        if data_start + offset + nbytes > header.size:
            raise header.fail(f"tensor {name!r}: its data ({nbytes} bytes at offset {offset})")
        if offset != expected:  # misaligned, or over another tensor's data: wrong weights
            raise GGUFHeaderError(
                f"{header.path}: tensor {name!r}: its data offset {offset} is not where the "
                f"tensors before it end ({expected}, padded to the alignment {alignment})"
            )
        expected += -(-nbytes // alignment) * alignment


def _tensor_info(header: _Walker, index: int) -> tuple[str, int, int]:
    """(name, data offset, data bytes) of tensor `index`'s info."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name = header.string(f"tensor #{index}'s name")
    dims = header.number("I", f"tensor {name!r}: its dimension count")
    if dims > MAX_DIMS:
        raise GGUFHeaderError(
            f"{header.path}: tensor {name!r}: {dims} dimensions; allowed: at most {MAX_DIMS}"
        )
    shape = [header.number("Q", f"tensor {name!r}: its shape") for _ in range(dims)]
    kind = header.number("I", f"tensor {name!r}: its type")
    offset = header.number("Q", f"tensor {name!r}: its data offset")
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise GGUFHeaderError(
            f"{header.path}: tensor {name!r}: type {kind} is not a GGML type"
        ) from None
    elements = 1
    for extent in shape:
        elements *= extent
    return name, offset, elements * block_bytes // block
