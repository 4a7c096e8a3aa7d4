"""Files the user names on the command line or in a config: read only when they are regular
files of a bounded size, and (for the commands that write models) written only where nothing is.

Reading: a FIFO blocks until someone writes into it and a device such as /dev/zero never ends,
so anything but a regular file is refused, naming the file, before it is opened. Each kind of
file has a size limit (`SETTINGS`, `RESULT`, `DATA`) far above the real files of that kind and
far below what would exhaust memory; the environment variable INFERLAB_MAX_INPUT_BYTES (bytes,
or with a K, M, G or T suffix) replaces every limit. Streaming readers (traces read in chunks)
count the bytes as they go with `check_size`.

Writing: `write_output_text` writes a command's output where the user said without blocking on
a FIFO that no process reads (a pipe with a reader, `--json >(jq .)` or `/dev/stdout`, works),
and `check_model_output` keeps `inferlab convert` and `inferlab train-tiny` from replacing a
model that is already there (the user's own checkpoint has the very file names they write)
unless asked with --force. (The other commands' outputs are checked by the harness's
`harness.run_folder.refuse_run_file`, which alone knows a run folder's files.)

These live in models/, the lowest layer, so that workloads/ and engines/ use the same checks as
the harness.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

MAX_INPUT_ENV = "INFERLAB_MAX_INPUT_BYTES"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class UserFileError(ValueError):
    """A file the user named that is not read or written as asked; the message is one line
    that names the file (or the setting) and what to do."""


@dataclass(frozen=True)
class FileKind:
    what: str  # for the message: "the limit for <what>"
    limit: int  # bytes


#: a rules file, a run folder's JSON/YAML, a model's config, tokenizer and chat template (the
#: largest real ones, a tokenizer.json of a 256k vocabulary, are about 35 MB)
SETTINGS = FileKind("a settings file", 64 << 20)
#: another tool's result file, read whole (vLLM's --save-detailed with its generated texts:
#: some 5 kB a request)
RESULT = FileKind("a result file", 1 << 30)
#: a trace, prompt set or text corpus, counted after gunzip (Azure's week-long trace is about
#: 1 GB of CSV; the full ShareGPT file 0.65 GB of JSON)
DATA = FileKind("a trace, prompt set or text", 4 << 30)


def _kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: str | Path) -> os.stat_result:
    """The file's stat, or a UserFileError if it is missing or not a regular file (it is not
    opened: /dev/zero never ends and a FIFO blocks until someone writes to it)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UserFileError(f"{path}: cannot open it ({exc.strerror})") from exc
    if not stat.S_ISREG(st.st_mode):
        raise UserFileError(f"{path}: is {_kind_of(st.st_mode)}, not a regular file")
    return st


def max_input_bytes(kind: FileKind) -> int:
    """The limit for `kind`: INFERLAB_MAX_INPUT_BYTES when set, else the kind's own."""
    text = os.environ.get(MAX_INPUT_ENV, "").strip()
    if not text:
        return kind.limit
    match = re.fullmatch(r"(\d+)\s*([KMGT]?)(?:i?B)?", text, re.IGNORECASE)
    value = int(match.group(1)) * _UNITS[match.group(2).upper()] if match else 0
    if value < 1:
        raise UserFileError(
            f"{MAX_INPUT_ENV}: {text!r} is invalid; allowed: a number of bytes >= 1, with an "
            "optional K, M, G or T suffix (e.g. 8G)"
        )
    return value


def _size_text(size: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor:
            return f"{size / factor:.3g} {unit}"
    return f"{size} bytes"


def check_size(path: str | Path, size: int, kind: FileKind, read_so_far: bool = False) -> None:
    """A UserFileError naming the file, the limit and how to raise it when `size` (the file's,
    or with `read_so_far` the bytes read from it so far) is over the limit for `kind`."""
    limit = max_input_bytes(kind)
    if size <= limit:
        return
    how_big = "holds more than" if read_so_far else f"{_size_text(size)} is more than"
    raise UserFileError(
        f"{path}: {how_big} the {_size_text(limit)} allowed for {kind.what}; to read it, "
        f"raise the limit with the environment variable {MAX_INPUT_ENV} (e.g. "
        f"{MAX_INPUT_ENV}=8G)"
    )


def read_input_bytes(path: str | Path, kind: FileKind) -> bytes:
    """The whole file, once it is known to be a regular file within the limit for `kind`."""
    st = check_regular_file(path)
    check_size(path, st.st_size, kind)
    limit = max_input_bytes(kind)
    try:
        with open(path, "rb") as f:
            # read(n) allocates n bytes first: a limit of 1T was a MemoryError on every file,
            # and one past 2^63 an OverflowError. The size stat gave, then what it grew since,
            # in chunks, to at most the limit and one byte more.
            data = f.read(min(limit, st.st_size) + 1)
            while len(data) <= limit and (more := f.read(min(1 << 20, limit + 1 - len(data)))):
                data += more
    except OSError as exc:
        raise UserFileError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    check_size(path, len(data), kind, read_so_far=True)
    return data


def read_input_text(path: str | Path, kind: FileKind) -> str:
    """read_input_bytes as UTF-8 text; bytes that are not UTF-8 are an error naming the file."""
    data = read_input_bytes(path, kind)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserFileError(
            f"{path}: not UTF-8 text (byte {exc.start}); a binary or damaged file?"
        ) from exc


def check_model_output(path: str | Path, option: str, folder: bool, force: bool) -> None:
    """Where a command writes a model (`folder`: a folder it fills, else one file): a path
    where nothing is, or an empty folder; with `force` (--force) also one that holds a model
    already. A file where a folder is to go is refused either way (it is not removed)."""
    p = Path(path)
    there = p.exists() or p.is_symlink()
    if folder and there and not p.is_dir():
        raise UserFileError(f"{option}: {path} exists and is not a folder; name a folder")
    if not there or force or (folder and not any(p.iterdir())):
        return
    what = "a folder that is not empty" if folder else "a file" if p.exists() else "a link"
    raise UserFileError(
        f"{option}: {path} exists ({what}) and would be written over; give --force to "
        "replace what is there, or name a path that does not exist"
    )


def given_output_path(value: str, option: str, allowed: str) -> Path:
    """The path the user gave `option` for a command's output. An empty one (`--json "$OUT"`
    with OUT unset) is refused: read as the option left out, it wrote nothing or wrote to the
    default place (a run folder, the current folder) without a word."""
    if not value.strip():
        raise UserFileError(f"{option}: {value!r} is invalid; allowed: {allowed} (or no {option})")
    return Path(value)


def write_output_text(path: str | Path, text: str, option: str) -> None:
    """Write `text` to the file `option` names, replacing it. Opening a FIFO for writing waits
    until a process opens it for reading, for ever if none does: it is opened without waiting,
    and a FIFO that nothing reads is an error. Any other failure (a folder, a full disk) is a
    UserFileError naming the option and the file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise UserFileError(
                f"{option}: {path}: a FIFO (named pipe) that no process reads; start its "
                "reader first, or name a regular file"
            ) from exc
        raise UserFileError(f"{option}: {path}: cannot be written: {exc.strerror}") from exc
    try:
        os.set_blocking(fd, True)  # a pipe whose reader is slow is waited for
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise UserFileError(f"{option}: {path}: cannot be written: {exc.strerror}") from exc
