"""The run folder: rows appended as the run goes, parquet and a summary at the end.

Layout (schema version in `SCHEMA_VERSION`):

    config.yaml         the resolved configuration
    provenance.json     commit, versions, machine, config hash
    requests.jsonl      one row per request, appended as each finishes   -> requests.parquet
    tokens.jsonl        one row per output token                         -> tokens.parquet
    steps.jsonl         one row per engine step                          -> steps.parquet
    summary.json        status, metrics, engine facts; written atomically

A run that is interrupted or crashes keeps its JSONL rows, and its summary says
`"status": "incomplete"` or `"failed"`; `load_table` reads parquet or, failing that, JSONL.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pandas as pd

SCHEMA_VERSION = 1
TABLES = ("requests", "tokens", "steps")

REQUEST_COLUMNS = [
    "request_id",
    "status",
    "error",
    "finish_reason",
    "arrival_s",
    "sent_s",
    "tokenized_s",
    "scheduled_s",
    "first_token_s",
    "last_token_s",
    "finished_s",
    "prompt_tokens_requested",
    "prompt_tokens",
    "output_tokens_requested",
    "output_tokens",
    "output_tokens_reported",
    "num_prefill_chunks",
    "num_preemptions",
    "cached_prompt_tokens",
    "prefix_group",
    "session_id",
    "turn",
    "prefill_tokens_computed",
    "tokenize_s",
    "queue_s",
    "prefill_s",
    "decode_s",
    "detokenize_s",
]
TOKEN_COLUMNS = ["request_id", "index", "step", "time_s", "token_id"]
STEP_COLUMNS = [
    "step",
    "start_s",
    "end_s",
    "num_seqs",
    "num_prefill_seqs",
    "num_decode_seqs",
    "prefill_tokens",
    "decode_tokens",
    "padding_tokens",
    "num_waiting",
    "kv_bytes_reserved",
    "kv_bytes_used",
    "num_preempted",
    "num_running",
    "kv_blocks_used",
    "forward_s",
    "kv_gather_s",
    "logits_tokens",
    "attention_pairs",
    "kv_tokens_read",
    "kv_tokens_written",
    # the roofline (harness/measuring/roofline.py), added when the run finishes; NaN where it
    # does not apply
    "flops",
    "weight_bytes_read",
    "kv_bytes_read",
    "kv_bytes_written",
    "predicted_s",
    "mbu",
    "mfu",
]
COLUMNS = {"requests": REQUEST_COLUMNS, "tokens": TOKEN_COLUMNS, "steps": STEP_COLUMNS}


def _replace_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write` a temporary file in the same folder, then rename it over `path`: a reader sees
    the old file or the new one, never half of one (a full disk, a crash mid-write)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:  # the old file stays whole; no half-written temporary is left
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    """Write to a temporary file in the same folder, then rename over the target."""

    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")

    _replace_atomic(path, write)


def write_parquet_atomic(frame: pd.DataFrame, path: Path) -> None:
    _replace_atomic(path, lambda tmp: frame.to_parquet(tmp, index=False))


class TablesNotWritten(Exception):
    """Finalizing could not write the run's tables (a full disk, an unwritable folder).
    `cause` is the first OSError; `frames` the tables as read back from the JSONL rows."""

    def __init__(self, cause: OSError, frames: dict[str, pd.DataFrame]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.frames = frames


class RunRecorder:
    """Appends rows to JSONL files, flushing often enough that a killed run keeps them."""

    def __init__(self, run_dir: str | Path, flush_every: int = 256) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        for table in TABLES:  # an earlier run's tables in this folder (resume) are stale
            (self.run_dir / f"{table}.parquet").unlink(missing_ok=True)
        # kept open for the run's lifetime (closed in close()): no context manager fits
        self.files: dict[str, IO[str]] = {
            t: open(self.run_dir / f"{t}.jsonl", "w")  # noqa: SIM115
            for t in TABLES
        }
        self.counts = dict.fromkeys(TABLES, 0)
        self._unflushed = 0

    def append(self, table: str, row: dict[str, Any]) -> None:
        self.files[table].write(json.dumps(row) + "\n")
        self.counts[table] += 1
        self._unflushed += 1
        if self._unflushed >= self.flush_every or table == "requests":
            self.flush()

    def flush(self) -> None:
        for f in self.files.values():
            f.flush()
        self._unflushed = 0

    def close(self) -> None:
        """Close every JSONL file (each flushes first); raise the first OSError after all."""
        errors = []
        for f in self.files.values():
            try:
                f.close()
            except OSError as exc:  # the file is closed all the same; its unwritten tail lost
                errors.append(exc)
        if errors:
            raise errors[0]

    def finalize(self) -> dict[str, pd.DataFrame]:
        """Close the JSONL files and write one parquet file per table, each whole or not at
        all. Every table is tried; a write that fails raises TablesNotWritten at the end, with
        the tables read back from the JSONL rows (which readers then fall back to)."""
        errors: list[OSError] = []
        try:
            self.close()
        except OSError as exc:
            errors.append(exc)
        frames = {}
        for table in TABLES:
            frame = read_jsonl(self.run_dir / f"{table}.jsonl", COLUMNS[table])
            frames[table] = frame
            try:
                write_parquet_atomic(frame, self.run_dir / f"{table}.parquet")
            except OSError as exc:
                errors.append(exc)
        if errors:
            raise TablesNotWritten(errors[0], frames)
        return frames

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(
            self.run_dir / "summary.json", {"schema_version": SCHEMA_VERSION, **summary}
        )


def read_jsonl(path: Path, columns: list[str]) -> pd.DataFrame:
    rows = []
    if path.is_file():
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line of a killed run
    frame = pd.DataFrame(rows)
    for column in columns:
        if column not in frame:
            frame[column] = pd.Series(dtype="float64")
    return frame[columns + [c for c in frame.columns if c not in columns]]


def load_table(run_dir: str | Path, table: str) -> pd.DataFrame:
    """A run's table from parquet, or from the JSONL rows of an unfinished run."""
    run_dir = Path(run_dir)
    parquet = run_dir / f"{table}.parquet"
    if parquet.is_file():
        return pd.read_parquet(parquet)
    return read_jsonl(run_dir / f"{table}.jsonl", COLUMNS[table])
