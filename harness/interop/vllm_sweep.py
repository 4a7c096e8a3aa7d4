"""A `vllm bench sweep serve` / `serve_sla` output folder into one lab run folder per result.

vLLM's sweep (vllm-project/vllm, vllm/benchmarks/sweep/serve.py and serve_sla.py) writes, in
its experiment folder, one folder per combination of server and benchmark settings,
`SERVE--<serve settings>-BENCH--<bench settings>/` (serve_sla: one more level per load tried,
`request_rate=<r>/`), holding `run=<k>.json` per repeat: a `vllm bench serve --save-result`
result with the combination's settings merged in as top-level keys (`max_num_seqs`,
`tensor_parallel_size`, ... beside `run_number`), and `summary.json` (the list of those). Failed
repeats leave `run=<k>.failure.json`; `warmup.json` is a warm-up. The experiment folder's
`summary.csv` is every result as a row.

Each `run=<k>.json` is imported as vllm_import imports a result; its settings (the keys vLLM's
own result does not have) go to the run's config under `settings`, where the report tells the
configurations apart and counts the devices (tensor x pipeline x data parallel size). Repeats
of one combination become `repeat-<k>/` of one folder, as the lab's own repeats are.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from harness.interop import vllm_import
from harness.interop.detect import read_content
from harness.interop.errors import InteropError
from harness.interop.imported import ImportedRun
from harness.interop.vllm_format import STAT_KEY

SUMMARY_CSV = "summary.csv"
RUN_FILE = re.compile(r"^run=(\d+)\.json$")
#: keys `vllm bench serve` itself writes that are not among VllmResult's fields
RESULT_KEYS = frozenset(
    {
        "endpoint_type",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "rtfx",
        "request_goodput:",
        "generated_texts",
        "run_number",  # the sweep's repeat number: the folder says it
    }
)
RESULT_PREFIXES = ("spec_decode_", "ramp_up_", "inferlab_")


def is_sweep_folder(path: Path) -> bool:
    """A sweep's experiment folder: summary.csv beside folders of run=<k>.json files."""
    return (
        path.is_dir()
        and (path / SUMMARY_CSV).is_file()
        and any(RUN_FILE.match(p.name) for p in path.rglob("run=*.json"))
    )


def settings_of(data: dict[str, Any]) -> dict[str, Any]:
    """The sweep's settings merged into a result: its scalar keys that vLLM's result has not."""
    known = set(vllm_import.VllmResult.model_fields) | RESULT_KEYS
    return {
        key: value
        for key, value in data.items()
        if key not in known
        and not STAT_KEY.match(key)
        and not key.startswith(RESULT_PREFIXES)
        and (value is None or isinstance(value, str | int | float | bool))
    }


def _check_layout(folder: Path, by_folder: dict[Path, list[Path]]) -> None:
    """Refuse, before anything is written, a layout whose results would land on one another:
    two files of one repeat number in a folder (run=0.json and run=00.json both repeat-0),
    or results both in a folder and below it (the outer run folder would hold the inner ones,
    and the report would read only one of them)."""
    for parent, paths in by_folder.items():
        numbers: dict[int, Path] = {}
        for path in paths:
            number = int(RUN_FILE.match(path.name).group(1))  # type: ignore[union-attr]
            if number in numbers:
                raise InteropError(
                    f"{parent}: {numbers[number].name} and {path.name} are both repeat {number}; "
                    "allowed: one run=<k>.json per repeat number in a folder"
                )
            numbers[number] = path
    for parent in by_folder:
        inner = next((p for p in by_folder if p != parent and parent in p.parents), None)
        if inner is not None:
            where = parent.relative_to(folder).as_posix()
            raise InteropError(
                f"{folder}: results both in {where!r} and below it, in "
                f"{inner.relative_to(folder).as_posix()!r}; allowed: run=<k>.json files at the "
                "deepest level of a combination's folders (import the others on their own)"
            )


def import_sweep(folder: Path) -> tuple[list[tuple[Path, ImportedRun]], list[str]]:
    """Every run=<k>.json under `folder` as (its folder relative to the output, the run), in
    path order; and notes on what was not imported (failed repeats)."""
    files = sorted(
        (p for p in folder.rglob("run=*.json") if RUN_FILE.match(p.name)),
        key=lambda p: (p.parent.as_posix(), int(RUN_FILE.match(p.name).group(1))),  # type: ignore[union-attr]
    )
    by_folder: dict[Path, list[Path]] = {}
    for path in files:
        by_folder.setdefault(path.parent, []).append(path)
    _check_layout(folder, by_folder)
    out: list[tuple[Path, ImportedRun]] = []
    for parent, paths in by_folder.items():
        rel = parent.relative_to(folder)
        for path in paths:
            content = read_content(path)
            if content.kind != "json" or not isinstance(content.documents[0], dict):
                raise InteropError(f"{path}: not a vllm bench serve result: expected one object")
            data = content.documents[0]
            if not vllm_import.looks_like(data):
                raise InteropError(
                    f"{path}: not a vllm bench serve result (no duration, completed, "
                    "request_throughput)"
                )
            run = vllm_import.import_result(data, path, None)
            repeat = int(RUN_FILE.match(path.name).group(1))  # type: ignore[union-attr]
            run.label = f"{rel.as_posix()} run {repeat}"
            run.config["settings"] = settings_of(data)
            target = rel / f"repeat-{repeat}" if len(paths) > 1 else rel
            out.append((target, run))
    failures = sorted(folder.rglob("*.failure.json"))
    notes = (
        [f"{len(failures)} failed run(s) left out (vLLM's *.failure.json), e.g. {failures[0]}"]
        if failures
        else []
    )
    if not out:
        raise InteropError(f"{folder}: a vLLM sweep folder without any run=<k>.json result")
    return out, notes
