"""The run folder: its layout, and every read and write of it. Nothing else in the project
spells a run folder's file names; everything asks this module.

Layout (schema version in `SCHEMA_VERSION`):

    config.yaml         the resolved configuration
    provenance.json     commit, versions, machine, config hash
    requests.jsonl      one row per request, appended as each finishes   -> requests.parquet
    tokens.jsonl        one row per output token                         -> tokens.parquet
    steps.jsonl         one row per engine step                          -> steps.parquet
    samples.parquet     the monitors' samples (memory, GPU)
    timeslices.csv      the run over time, slice by slice (harness/measuring/timeslices.py)
    summary.json        status, metrics, engine facts; written atomically
    profile/            with `profile=true`: the torch profiler's trace and op tables
    repeat-<k>/         a run with `repeats` > 1: one run folder per repeat

A sweep folder holds one job folder per variant (a run folder plus Hydra's
.hydra/overrides.yaml), multirun.yaml, sweep.csv, sweep_summary.json and, for a
KV-cache sweep over context lengths, kv_speedup.csv; an A/B folder holds ab.json and one run
folder per round and side (round-<k>-a/, round-<k>-b/; warmup-<k>-a/ ... not gated).

A run that is interrupted or crashes keeps its JSONL rows, and its summary says
`"status": "incomplete"` or `"failed"`; `load_table` reads parquet or, failing that, JSONL.
Readers come in two kinds: strict ones (`read_json_object`, `read_yaml`, `read_overrides`)
raise UnreadableFile naming the file and what is wrong, for the gate; lenient ones
(`read_summary`, `read_config`, ...) return None for a missing or damaged file, for reports and
resume checks that skip what they cannot use.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pandas as pd
import yaml

from configs import CONFIG_DIR
from models.files import SETTINGS, UserFileError, given_output_path, read_input_text

#: a disaggregated engine's request facts (engine.disaggregation=pd; None for a colocated one)
DISAGGREGATED_COLUMNS = (
    "pd_prefill_instance",
    "pd_decode_instance",
    "pd_kv_bytes",
    "pd_kv_transfer_s",
    "pd_decode_queue_s",
    "pd_fallback",
)

CONFIG_FILE = "config.yaml"
PROVENANCE_FILE = "provenance.json"
SUMMARY_FILE = "summary.json"
SAMPLES_FILE = "samples.parquet"
SERVER_METRICS_FILE = "server_metrics.parquet"
TIMESLICES_FILE = "timeslices.csv"
SEARCH_FILE = "search.json"  # a capacity search's record, in its sweep folder
PROFILE_DIR = "profile"
AB_FILE = "ab.json"
SWEEP_TABLE_FILE = "sweep.csv"
SWEEP_SUMMARY_FILE = "sweep_summary.json"
KV_SPEEDUP_FILE = "kv_speedup.csv"
MULTIRUN_FILE = "multirun.yaml"
#: Hydra's log of the run (`<job name>.log`; the job is harness/running/app.py's)
JOB_LOG_FILE = "app.log"
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
REPEAT_DIR = re.compile(r"^repeat-(\d+)$")
AB_ROUND_DIR = re.compile(r"^round-(\d+)-([ab])$")


def _how_to_run_keys() -> frozenset[str]:
    """config.yaml's `hydra.job.config.override_dirname.exclude_keys`, where Hydra needs them
    (a sweep job's folder name leaves them out), read from there: one list."""
    config = yaml.safe_load((CONFIG_DIR / "config.yaml").read_text(encoding="utf-8"))
    return frozenset(config["hydra"]["job"]["config"]["override_dirname"]["exclude_keys"])


#: Overrides that say how to run, not what: no column in sweep.csv, ignored by resume, by the
#: report's variants and by the gate's matching of sweep jobs (a resumed job is the same job).
HOW_TO_RUN_KEYS = _how_to_run_keys()


def repeat_dir(run_dir: Path, k: int) -> Path:
    return run_dir / f"repeat-{k}"


def ab_round_dir(ab_dir: Path, k: int, side: str, kind: str = "round") -> Path:
    """Round k's run of side a or b; kind "warmup" for the rounds that are not gated."""
    return ab_dir / f"{kind}-{k}-{side}"


def table_path(run_dir: Path, table: str, suffix: str) -> Path:
    """A table's file: suffix "jsonl" (rows as they come) or "parquet" (written at the end)."""
    return run_dir / f"{table}.{suffix}"


def has_summary(folder: Path) -> bool:
    # exists(), not is_file(): a summary.json that is not a file is reported, not skipped
    return (folder / SUMMARY_FILE).exists()


def is_sweep_job(folder: Path) -> bool:
    return (folder / OVERRIDES_FILE).is_file()


def is_sweep(folder: Path) -> bool:
    return (folder / MULTIRUN_FILE).is_file() or (folder / SWEEP_TABLE_FILE).is_file()


SCHEMA_VERSION = 1
TABLES = ("requests", "tokens", "steps")


#: The files a run folder (and a sweep, repeats or A/B folder above runs) writes for itself;
#: anything else in it (an export, the user's notes) is not the run's, and may be written over.
OWN_FILES = frozenset(
    {
        CONFIG_FILE,
        PROVENANCE_FILE,
        SUMMARY_FILE,
        SAMPLES_FILE,
        SERVER_METRICS_FILE,
        TIMESLICES_FILE,
        AB_FILE,
        SWEEP_TABLE_FILE,
        SWEEP_SUMMARY_FILE,
        KV_SPEEDUP_FILE,
        MULTIRUN_FILE,
        JOB_LOG_FILE,
    }
    | {f"{table}.{suffix}" for table in TABLES for suffix in ("jsonl", "parquet")}
)
#: Folders inside a run folder that hold only the run's own files.
OWN_DIRS = frozenset({str(OVERRIDES_FILE.parent), PROFILE_DIR})


def _holds_own_files(folder: Path, besides: Path | None = None) -> bool:
    """Whether `folder` holds a run's own file (other than `besides`): a run, sweep, repeats
    or A/B folder."""
    return (folder / OVERRIDES_FILE.parent).is_dir() or any(
        (folder / name).exists() for name in OWN_FILES if folder / name != besides
    )


def run_folder_owning(path: Path) -> Path | None:
    """The run (or sweep, repeats, A/B) folder whose own file `path` is, or None. A lone
    summary.json in a folder of nothing else is not a run's (an earlier export may be named
    so)."""
    path = Path(path).resolve()  # a link to a run's file is that file; so is a linked folder
    if path.name in OWN_FILES and _holds_own_files(path.parent, besides=path):
        return path.parent
    for folder in path.parents:
        if folder.name in OWN_DIRS and _holds_own_files(folder.parent):
            return folder.parent
    return None


class RunFileRefused(ValueError):
    """A file (or folder) the user named for a command's output is one of a run folder's own."""


def output_file_path(value: str, option: str) -> Path:
    """A file path given for a command's output, checked before the command does its work:
    not empty (an unset variable), not a folder, not a run folder's own file. A ValueError
    naming `option` (UserFileError, RunFileRefused)."""
    path = given_output_path(value, option, "a file's path")
    if path.is_dir():
        raise UserFileError(f"{option}: {path} is a folder; allowed: a file's path")
    refuse_run_file(path, option)
    return path


def refuse_run_file(path: Path, option: str) -> None:
    """The one check before a command writes where the user said (`gate --json`, `export
    --out`, `report --out`...): a run folder's own file, or a link to one, is refused, so that
    the run stays readable; any other file is written over (an earlier output of the same
    command). The rule is in docs/run_folder.md."""
    owner = run_folder_owning(path)
    if owner is None:
        return
    target = Path(path).resolve()
    which = "" if target == Path(os.path.abspath(path)) else f" (that is {target})"
    raise RunFileRefused(
        f"{option}: {path}{which} is a file of the run folder {owner} and would be written "
        "over; allowed: a path that is not one of a run folder's own files (docs/run_folder.md)"
    )


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
    # of those, loaded back from a KV tier (engine.kv_host_tier_bytes, kv_disk_tier_bytes)
    "cached_prompt_tokens_host",
    "cached_prompt_tokens_disk",
    # disaggregation (engine.disaggregation=pd): where it ran and what its K/V hand-off cost
    *DISAGGREGATED_COLUMNS,
    "prefix_group",
    "session_id",
    "turn",
    "lora",
    # structured output: the request's constraint kind, and whether its output satisfied it
    "structured",
    "structured_enforced",
    "structured_valid",
    "structured_compile_s",
    "structured_cache_hit",
    "structured_forced_tokens",
    # tool calls: the request's tool choice, the calls it made, whether they are valid
    "tool_choice",
    "tool_calls",
    "tool_calls_valid",
    "prefill_tokens_computed",
    "tokenize_s",
    "queue_s",
    "prefill_s",
    "decode_s",
    "detokenize_s",
    # speculative decoding (built-in engine): steps that verified drafts, drafts, drafts kept;
    # kept / drafts, and (kept + steps) / steps: the tokens a verifying step gave the request
    "spec_steps",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_acceptance_rate",
    "spec_mean_accepted_length",
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
    "kv_blocks_shared",
    "kv_bytes_copied",
    "structured_rows",
    "structured_mask_s",
    "lora_adapters",
    "lora_rows",
    "lora_rows_max",
    # mixture of experts: tokens routed to each expert (a list, summed over the MoE layers),
    # and the busiest expert's tokens over the mean (1: even)
    "moe_expert_tokens",
    "moe_imbalance",
    "moe_experts_touched",  # (layer, expert) pairs with a token: the experts' weights read
    "moe_expert_s",  # the experts' MLPs' host time (routing and grouping excluded)
    "forward_s",
    "kv_gather_s",
    "logits_tokens",
    "attention_pairs",
    "kv_tokens_read",
    "kv_tokens_written",
    # speculative decoding: drafts verified and kept this step, the proposer's time before it
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "draft_s",
    # lists, per draft position 1, 2, ...: verifying rows that proposed / kept a draft there
    "spec_drafts_by_position",
    "spec_accepted_by_position",
    # tensor parallelism, rank 0's view: time in the forward's collectives (all-reduces, the
    # logits gather) and the bytes it sent into them; the step's broadcast to the other ranks
    "comm_s",
    "comm_bytes",
    "broadcast_s",
    "broadcast_bytes",
    # KV tiers: evicted blocks saved from the pool, tier hits loaded into it (bytes), the time
    # that took before the forward, and the disk tier's reads while matching prefixes
    "kv_bytes_saved",
    "kv_bytes_loaded",
    "kv_transfer_s",
    "kv_disk_read_bytes",
    "kv_disk_read_s",
    # disaggregation: the instance that ran the step (prefill0, decode0, ...)
    "instance",
    # the roofline (harness/measuring/roofline.py), added when the run finishes; NaN where it
    # does not apply
    "flops",
    "weight_bytes_read",
    "kv_bytes_read",
    "kv_bytes_written",
    "predicted_s",
    "predicted_comm_s",  # of which the tensor-parallel collectives on the link
    "mbu",
    "mfu",
]
COLUMNS = {"requests": REQUEST_COLUMNS, "tokens": TOKEN_COLUMNS, "steps": STEP_COLUMNS}


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, for every thread)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022  # no /proc: the usual umask


def _replace_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """`write` a temporary file in the same folder, then rename it over `path`: a reader sees
    the old file or the new one, never half of one (a full disk, a crash mid-write)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        # mkstemp's 0600 would survive the rename: the file gets a plain open()'s mode instead
        os.chmod(tmp, 0o666 & ~_umask())
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


def write_text_atomic(path: Path, text: str) -> None:
    _replace_atomic(path, lambda tmp: tmp.write_text(text))


def write_timeslices(run_dir: Path, table: pd.DataFrame) -> None:
    # nine significant digits: a slice's edge late in a long run keeps its milliseconds
    _replace_atomic(
        run_dir / TIMESLICES_FILE,
        lambda tmp: table.to_csv(tmp, index=False, float_format="%.9g"),
    )


def read_timeslices(run_dir: Path) -> pd.DataFrame | None:
    """The run's timeslices.csv, or None when it is missing or cannot be read as a table."""
    path = run_dir / TIMESLICES_FILE
    if not path.is_file():
        return None
    try:
        return pd.read_csv(path)
    except (OSError, ValueError, UnicodeDecodeError):  # pandas' ParserError is a ValueError
        return None


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    write_json_atomic(run_dir / SUMMARY_FILE, {"schema_version": SCHEMA_VERSION, **summary})


def write_provenance(run_dir: Path, provenance: dict[str, Any]) -> None:
    write_json_atomic(run_dir / PROVENANCE_FILE, provenance)


def write_config(run_dir: Path, config: dict[str, Any]) -> None:
    write_text_atomic(run_dir / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))


def remove_summary(run_dir: Path) -> None:
    """A summary about to be rewritten goes first, so that a crash before the rewrite does not
    leave the old one claiming a finished run."""
    (run_dir / SUMMARY_FILE).unlink(missing_ok=True)


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
            table_path(self.run_dir, table, "parquet").unlink(missing_ok=True)
        # kept open for the run's lifetime (closed in close()): no context manager fits
        self.files: dict[str, IO[str]] = {
            t: open(table_path(self.run_dir, t, "jsonl"), "w")  # noqa: SIM115
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
            frame = read_jsonl(table_path(self.run_dir, table, "jsonl"), COLUMNS[table])
            frames[table] = frame
            try:
                write_parquet_atomic(frame, table_path(self.run_dir, table, "parquet"))
            except OSError as exc:
                errors.append(exc)
        if errors:
            raise TablesNotWritten(errors[0], frames)
        return frames

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_summary(self.run_dir, summary)


def read_jsonl(path: Path, columns: list[str]) -> pd.DataFrame:
    rows = []
    if path.is_file():
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break  # a torn last line of a killed run
                if isinstance(row, dict):  # a line that is not a row (hand-edited) is skipped
                    rows.append(row)
    frame = pd.DataFrame(rows)
    for column in columns:
        if column not in frame:
            frame[column] = pd.Series(dtype="float64")
    return frame[columns + [c for c in frame.columns if c not in columns]]


def load_table(run_dir: str | Path, table: str) -> pd.DataFrame:
    """A run's table from parquet, or from the JSONL rows of an unfinished run."""
    run_dir = Path(run_dir)
    parquet = table_path(run_dir, table, "parquet")
    if parquet.is_file():
        return pd.read_parquet(parquet)
    return read_jsonl(table_path(run_dir, table, "jsonl"), COLUMNS[table])


class UnreadableFile(ValueError):
    """A run-folder file that is missing, damaged or not what the harness writes; the message
    names the file."""


def json_kind(value: Any) -> str:
    """A JSON value's type in JSON's words, for error messages."""
    if value is None:
        return "null"
    names = {bool: "a boolean", str: "a string", list: "a list", dict: "an object"}
    for kind, name in names.items():
        if isinstance(value, kind):
            return f"{name} ({short_json(value)})"
    return f"a number ({value!r})" if isinstance(value, int | float) else type(value).__name__


def short_json(value: Any, limit: int = 60) -> str:
    if isinstance(value, str):
        text = repr(value[: limit + 3])
    else:  # encoded lazily: a huge value (a YAML alias bomb) costs only its first characters
        text = ""
        for chunk in json.JSONEncoder(default=str).iterencode(value):
            text += chunk
            if len(text) > limit:
                break
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise UnreadableFile(f"{path}: is a folder, not a file")
    if not (path.exists() or path.is_symlink()):
        raise UnreadableFile(f"{path}: no such file")
    try:  # a FIFO or a device (a summary.json linked to /dev/zero) is refused, not read
        return read_input_text(path, SETTINGS)
    except UserFileError as exc:
        raise UnreadableFile(str(exc)) from exc


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (summary.json, ab.json, provenance.json)."""
    text = _read_text(path)
    if not text.strip():
        raise UnreadableFile(f"{path}: empty file; expected a JSON object")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnreadableFile(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}); truncated or damaged?"
        ) from exc
    except RecursionError as exc:
        raise UnreadableFile(f"{path}: JSON nested too deeply") from exc
    except ValueError as exc:  # e.g. an integer past Python's 4300-digit conversion limit
        raise UnreadableFile(f"{path}: not usable JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise UnreadableFile(f"{path}: expected a JSON object, got {json_kind(value)}")
    return value


def read_yaml(path: Path) -> Any:
    """A YAML file (config.yaml, .hydra/overrides.yaml), parsed safely."""
    text = _read_text(path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UnreadableFile(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from exc
    except RecursionError as exc:
        raise UnreadableFile(f"{path}: YAML nested too deeply") from exc


def read_overrides(job: Path) -> list[str]:
    """A sweep job's Hydra overrides (.hydra/overrides.yaml: a list of `key=value` strings)."""
    path = job / OVERRIDES_FILE
    overrides = read_yaml(path)
    if overrides is None:
        return []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise UnreadableFile(
            f"{path}: expected a list of override strings such as "
            f"'engine.kv_cache=paged', got {json_kind(overrides)}"
        )
    return overrides


def override_values(overrides: list[str]) -> dict[str, Any]:
    """`key=value` strings as {key: value}, the value as Hydra read it (`8` an int, `[1,2]` a
    list, `{process:poisson,rate:1}` a mapping: Hydra writes overrides.yaml without the
    spaces YAML would need), Hydra's +/++/~ prefixes dropped from the key. A string Hydra's
    grammar refuses (a hand-edited file) is read as YAML, else kept as text."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    values = {}
    for override in overrides:
        key, _, text = override.partition("=")
        try:
            value = parser.parse_override(override).value()
        except HydraException:
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                value = text
        values[key.lstrip("+~")] = value
    return values


def _lenient(read: Callable[[Path], Any], path: Path) -> Any:
    try:
        return read(path)
    except (UnreadableFile, RecursionError):
        return None


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary, or None when it is missing or damaged."""
    return _lenient(read_json_object, run_dir / SUMMARY_FILE)


def read_provenance(run_dir: Path) -> dict[str, Any] | None:
    return _lenient(read_json_object, run_dir / PROVENANCE_FILE)


def read_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's resolved configuration, or None when it is missing, damaged or not a mapping."""
    config = _lenient(read_yaml, run_dir / CONFIG_FILE)
    return config if isinstance(config, dict) else None


def read_sweep_summary(sweep_dir: Path) -> dict[str, Any] | None:
    return _lenient(read_json_object, sweep_dir / SWEEP_SUMMARY_FILE)


def read_sweep_overrides(job: Path) -> dict[str, Any] | None:
    """A sweep job's overrides as {key: value}, or None when it has no readable overrides."""
    overrides = _lenient(read_overrides, job)
    return None if overrides is None else override_values(overrides)


def runs_written_in(folder: Path, sweep: bool = False) -> list[str]:
    """What in `folder` a run (or, with `sweep`, a sweep) started into it would write over:
    the own files and folders of a run, sweep, repeats or A/B folder already there, and the
    subfolders that hold runs where the new one would write them (its repeat-<k>/, or a
    sweep's jobs). Empty when the folder is new, empty, or holds nothing of a run's (an
    export, the user's notes)."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:  # absent, or not a folder: nothing of a run's is in it
        return []

    def is_runs(entry: Path) -> bool:
        if entry.name in OWN_FILES | OWN_DIRS:
            return True
        below = sweep or REPEAT_DIR.match(entry.name) is not None
        return below and entry.is_dir() and _holds_own_files(entry)

    return [entry.name for entry in entries if is_runs(entry)]


def read_search_records(sweep_dir: Path) -> list[dict[str, Any]]:
    """The capacity search records of a sweep folder's search.json: the one search's, or one
    per grid point (`{"searches": [...]}`); none where no search ran. A file that cannot be
    read raises UnreadableFile."""
    path = Path(sweep_dir) / SEARCH_FILE
    if not path.is_file():
        return []
    data = read_json_object(path)
    searches = data.get("searches")
    return [s for s in searches if isinstance(s, dict)] if isinstance(searches, list) else [data]
