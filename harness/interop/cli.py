"""`inferlab export` and `inferlab import` (docs/interop.md).

    inferlab export RUN [--format vllm] [--out FILE|DIR] [--percentile-metrics ...]
                        [--metric-percentiles 99] [--summary-only]
    inferlab import FILE|VLLM_SWEEP_DIR [--out DIR]
                    [--format auto|vllm|guidellm|aiperf|genai-perf|llmperf] [--benchmark K]

Exit status 0, or 2 with one line naming the file and what is wrong (as `inferlab report`
and `inferlab gate` do for bad input).
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from harness.interop import vllm_sweep
from harness.interop.detect import ALLOWED, FORMATS, load
from harness.interop.errors import InteropError
from harness.interop.vllm_export import check_percentiles, run_folders, vllm_result, write_json
from harness.interop.vllm_format import EXPORT_PERCENTILE_METRICS, PERCENTILE_METRICS
from harness.interop.write import write_imported_run
from harness.run_folder import RunFileRefused, refuse_run_file
from models.files import UserFileError, given_output_path

EXPORT_FILE = "vllm_bench_serve.json"
IMPORT_ROOT = Path("results") / "imported"


def _guarded(prog: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except (InteropError, RunFileRefused, UserFileError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
    except OSError as exc:  # an unreadable folder, an unwritable output
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{prog}: error: {where}{exc.strerror or exc}", file=sys.stderr)
    except RecursionError:
        print(f"{prog}: error: an input is nested too deeply", file=sys.stderr)
    except Exception:  # a bug, not bad input: say so, with the traceback
        traceback.print_exc()
        print(
            f"{prog}: internal error (the traceback above is a bug, please report it)",
            file=sys.stderr,
        )
    return 2


# export ------------------------------------------------------------------------------------
def _export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferlab export",
        description="Write a run folder as another tool's result file: the JSON of "
        "`vllm bench serve --save-result --save-detailed`. A sweep or a run with repeats "
        "exports each of its runs.",
    )
    parser.add_argument("run", help="a run folder (or a sweep / repeats folder above runs)")
    parser.add_argument("--format", default="vllm", choices=["vllm"], help="(default: vllm)")
    parser.add_argument(
        "--out",
        help=f"output file for one run (default: RUN/{EXPORT_FILE}); a folder when RUN holds "
        f"several runs (default: each run's own folder, {EXPORT_FILE})",
    )
    parser.add_argument(
        "--percentile-metrics",
        default=",".join(EXPORT_PERCENTILE_METRICS),
        help="vLLM's --percentile-metrics: which statistics to write, of "
        f"{','.join(PERCENTILE_METRICS)} (default: %(default)s; vLLM's own default leaves "
        "out e2el)",
    )
    parser.add_argument(
        "--metric-percentiles",
        default="99",
        help="vLLM's --metric-percentiles: comma-separated percentiles (default: %(default)s)",
    )
    parser.add_argument(
        "--summary-only",
        action="store_true",
        help="leave out the per-request lists, as vLLM does without --save-detailed",
    )
    return parser


def _percentile_metrics(text: str) -> tuple[str, ...]:
    metrics = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
    if unknown or not metrics:
        raise InteropError(
            f"--percentile-metrics: {text!r} is invalid; allowed: comma-separated names of "
            f"{','.join(PERCENTILE_METRICS)}"
        )
    return metrics


def _export_file(folder: Path, root: Path, out: str | None, several: bool) -> Path:
    if out is None:
        return folder / EXPORT_FILE
    if not several and folder == root:
        return Path(out)
    # sweep 3/repeat-0 -> OUT/3-repeat-0.json
    name = "-".join(folder.relative_to(root).parts) or root.name
    return Path(out) / f"{name}.json"


def export_main(argv: list[str]) -> int:
    args = _export_parser().parse_args(argv)

    def run() -> int:
        metrics = _percentile_metrics(args.percentile_metrics)
        if args.out is not None:
            given_output_path(args.out, "--out", "a file or folder path")
        percentiles = check_percentiles(args.metric_percentiles)
        root = Path(args.run)
        folders = run_folders(root)
        outs = [
            _export_file(folder, root, args.out, several=len(folders) > 1) for folder in folders
        ]
        for out in outs:  # before anything is written: none or all
            refuse_run_file(out, "--out")
        exported = 0
        for folder, out in zip(folders, outs, strict=True):
            try:
                result = vllm_result(folder, metrics, percentiles, detailed=not args.summary_only)
            except InteropError as exc:
                if len(folders) == 1:
                    raise
                # a sweep's failed job (no request measured) does not stop its other runs
                print(f"inferlab export: skipped: {exc}", file=sys.stderr)
                continue
            write_json(out, result)
            exported += 1
            status = result.get("inferlab_status")
            print(
                f"export: {out} ({result['completed']} completed, {result['failed']} failed "
                f"of {result['num_prompts']} requests"
                + (f"; the run did not finish: {status}" if status else "")
                + ")"
            )
        if not exported:
            raise InteropError(f"{root}: none of its {len(folders)} runs could be exported")
        return 0

    return _guarded("inferlab export", run)


# import ------------------------------------------------------------------------------------
def _import_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferlab import",
        description="Read another tool's result file into a run folder that `inferlab "
        "report` and `inferlab gate` compare with the lab's own runs (summary.json in the "
        "lab's metric names and units; `definitions` says where each came from and whether "
        "the tool computes it the lab's way).",
    )
    parser.add_argument(
        "file",
        help="a result file: vllm bench serve JSON, guidellm JSON/YAML report, AIPerf "
        "profile_export_aiperf.json/.csv or profile_export.jsonl, genai-perf "
        "profile_export_genai_perf.json/.csv, LLMPerf *_summary.json or "
        "*_individual_responses.json (or the folder holding it)",
    )
    parser.add_argument(
        "--out",
        help=f"the run folder to write (default: {IMPORT_ROOT}/<time>_<tool>_<file name>); "
        "with several benchmarks in the file, one folder each in it (benchmark-<k>/)",
    )
    parser.add_argument(
        "--format", default="auto", help=f"auto (from the content) or one of {ALLOWED}"
    )
    parser.add_argument(
        "--benchmark",
        type=int,
        metavar="K",
        help="import only the K-th benchmark (0-based) of a file holding several (a guidellm "
        "sweep, vLLM results appended to one file)",
    )
    return parser


def _default_out(tool: str, source: Path, now: datetime) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", source.stem) or "result"
    return IMPORT_ROOT / f"{now.astimezone().strftime('%Y-%m-%d_%H-%M-%S')}_{tool}_{name}"


def import_main(argv: list[str]) -> int:
    args = _import_parser().parse_args(argv)

    def run() -> int:
        if args.format != "auto" and args.format not in FORMATS:
            raise InteropError(f"--format: {args.format!r} is invalid; allowed: auto|{ALLOWED}")
        given_out = (
            None if args.out is None else given_output_path(args.out, "--out", "a folder path")
        )
        if args.format in ("auto", "vllm") and vllm_sweep.is_sweep_folder(Path(args.file)):
            return _import_vllm_sweep(Path(args.file), given_out, args.benchmark)
        runs = load(Path(args.file), args.format)
        if args.benchmark is not None:
            if not 0 <= args.benchmark < len(runs):
                raise InteropError(
                    f"--benchmark: {args.benchmark} is invalid; allowed: 0 to {len(runs) - 1} "
                    f"({args.file} holds {len(runs)} benchmark(s))"
                )
            runs = [runs[args.benchmark]]
        now = datetime.now(timezone.utc)
        out = given_out or _default_out(runs[0].tool, runs[0].files[0], now)
        refuse_run_file(out, "--out")
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise InteropError(f"--out: {out} exists and is not an empty folder; choose another")
        targets = [out] if len(runs) == 1 else [out / f"benchmark-{k}" for k in range(len(runs))]
        for imported, target in zip(runs, targets, strict=True):
            write_imported_run(imported, target, now)
            for warning in imported.warnings:
                print(f"inferlab import: warning: {warning}", file=sys.stderr)
            differ = sum(not d.same_as_lab for d in imported.definitions.values())
            rows = 0 if imported.requests is None else len(imported.requests)
            version = f" {imported.tool_version}" if imported.tool_version else ""
            print(
                f"import: {imported.tool}{version}"
                + (f" {imported.label}" if imported.label else "")
                + f" -> {target}: {len(imported.metrics)} metrics ({differ} defined "
                f"differently from the lab's: summary.json definitions), {rows} request rows"
            )
        return 0

    return _guarded("inferlab import", run)


def _import_vllm_sweep(folder: Path, given_out: Path | None, benchmark: int | None) -> int:
    """A `vllm bench sweep serve` folder: one run folder per combination (repeats as
    repeat-<k>/) under the output, which `inferlab report` reads as the sweep's variants."""
    if benchmark is not None:
        raise InteropError(
            f"--benchmark: {folder} is a vLLM sweep folder; it is imported whole (give one "
            "of its run=<k>.json files to import one result)"
        )
    runs, notes = vllm_sweep.import_sweep(folder)
    now = datetime.now(timezone.utc)
    out = given_out or _default_out("vllm-sweep", folder, now)
    refuse_run_file(out, "--out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InteropError(f"--out: {out} exists and is not an empty folder; choose another")
    for target, imported in runs:
        write_imported_run(imported, out / target, now)
        for warning in imported.warnings:
            print(f"inferlab import: warning: {warning}", file=sys.stderr)
    for note in notes:
        print(f"inferlab import: warning: {note}", file=sys.stderr)
    combinations = len(
        {target.parent if target.name.startswith("repeat-") else target for target, _ in runs}
    )
    print(
        f"import: vllm sweep {folder} -> {out}: {len(runs)} result(s) of {combinations} "
        f"combination(s); `inferlab report {out}` draws their Pareto frontier"
    )
    return 0
