"""An ImportedRun written as a normal run folder (docs/run_folder.md): `summary.json` (status,
the lab-named metrics, their definitions, the source metrics left unmapped), `requests.parquet`
where the file has per-request data, `provenance.json` (which tool, which files and their
SHA-256, when imported) and `config.yaml` (what the file says about the workload and target).
No tokens or steps table: no other tool records the engine's steps or per-token times."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from harness.interop.imported import ImportedRun
from harness.interop.recompute import request_rows
from harness.interop.sources import sha256_of
from harness.run_folder import (
    table_path,
    write_config,
    write_parquet_atomic,
    write_provenance,
    write_summary,
)


def summary_of(run: ImportedRun) -> dict[str, Any]:
    return {
        "status": run.status,
        "error": run.error,
        "metrics": dict(run.metrics),
        "imported": {"tool": run.tool, "tool_version": run.tool_version, "benchmark": run.label},
        "definitions": {name: d.to_dict() for name, d in run.definitions.items()},
        "unmapped": list(run.unmapped),
        "superseded": list(run.superseded),
        "notes": list(run.notes),
        "unusable_values": dict(run.unusable_values),
        "warnings": list(run.warnings),
    }


def provenance_of(run: ImportedRun, imported_at: datetime) -> dict[str, Any]:
    return {
        "imported": {
            "tool": run.tool,
            "tool_version": run.tool_version,
            "format": run.format,
            "benchmark": run.label,
            "files": [
                {"path": str(path.resolve()), "sha256": sha256_of(path)} for path in run.files
            ],
            "imported_at": imported_at.isoformat(timespec="seconds"),
            "imported_by": "inferlab import",
        }
    }


def write_imported_run(run: ImportedRun, out_dir: Path, imported_at: datetime) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_config(out_dir, run.config)
    write_provenance(out_dir, provenance_of(run, imported_at))
    if run.requests is not None:
        write_parquet_atomic(request_rows(run.requests), table_path(out_dir, "requests", "parquet"))
    write_summary(out_dir, summary_of(run))  # last: a folder with a summary is whole
