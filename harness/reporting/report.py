"""`inferlab report DIR... [--out DIR]`: report.md and report.html for runs and sweeps.

The report is a list of blocks (headings, paragraphs, tables, figures) rendered twice: as
Markdown with the figures as PNG files beside it, and as one HTML page with the same figures
embedded. Every section draws on columns that other parts of the harness add (monitor samples,
phase times, roofline counters); a section whose columns are absent is replaced by a one-line
note saying what it needs.
"""

from __future__ import annotations

import argparse
import base64
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pandas as pd

from harness.measuring.checks import parse_checks
from harness.measuring.metrics import find_metric
from harness.measuring.roofline import Roof, decode_only, measured_step_s, prefill_only
from harness.reporting import adapters, figures, pareto, speculative
from harness.reporting.formatting import format_metric
from harness.reporting.results import Results, load
from harness.run_folder import (
    SEARCH_FILE,
    UnreadableFile,
    read_search_records,
    read_sweep_summary,
    read_timeslices,
    refuse_run_file,
)
from harness.running.capacity_sweep import console_line, record_problem
from models.files import UserFileError, check_regular_file, given_output_path

MAIN_METRICS = (
    "num_completed",
    "num_failed",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "itl_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "output_tok_per_s",
    "req_per_s",
    "offered_req_per_s",
    "goodput_req_per_s",
    "slo_attainment",
    "mean_batch_size",
    "kv_utilization_mean",
    "num_preemptions",
    "prefix_cache_hit_rate",
    "kv_tier_hit_rate_host",
    "kv_tier_hit_rate_disk",
    "kv_transfer_fraction",
    # structured output (docs/structured_output.md) and run.accuracy, where the run has them
    "structured_validity",
    "tool_call_validity",
    "structured_mask_fraction",
    "ttft_p50_s_structured",
    "tpot_p50_s_structured",
    "accuracy",
    "mbu_decode_mean",
    "mfu_prefill_mean",
    "peak_vram_bytes",
    "peak_rss_bytes",
    "gpu_util_mean",
    "cpu_util_mean",
    "energy_j",
    "j_per_output_token",
    # engine=openai: the server's own view (docs/interop.md)
    "server_ttft_p50_s",
    "server_itl_p50_s",
    "ttft_outside_server_mean_s",
    "server_num_requests_running_mean",
    "server_kv_cache_usage_peak",
)
SPREAD_METRICS = ("output_tok_per_s", "ttft_p50_s", "tpot_p50_s", "itl_p50_s", "e2e_p50_s")
PHASES = ("tokenize_s", "queue_s", "prefill_s", "decode_s", "detokenize_s")
ROOFLINE_COLUMNS = ("flops", "weight_bytes_read", "kv_bytes_read")
SAMPLE_PLOTS = (
    "rss_bytes",
    "cpu_util",
    "gpu_util",
    "gpu_mem_used_bytes",
    "gpu_power_w",
    "torch_cuda_allocated_bytes",
    "server_num_requests_running",
    "server_num_requests_waiting",
    "server_kv_cache_usage",
)
RATE_HINTS = ("rate", "concurrency", "qps")
MARKDOWN_FILE, HTML_FILE, VARIANTS_FILE = "report.md", "report.html", "report_variants.csv"


# the document -----------------------------------------------------------------------------
@dataclass
class Block:
    kind: str  # heading | text | note | table | figure
    text: str = ""
    level: int = 2
    frame: pd.DataFrame | None = None
    path: Path | None = None


class Document:
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.blocks: list[Block] = []
        self.figures: list[Path] = []

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(Block("heading", text, level=level))

    def text(self, text: str) -> None:
        self.blocks.append(Block("text", text))

    def note(self, text: str) -> None:
        self.blocks.append(Block("note", text))

    def table(self, frame: pd.DataFrame) -> None:
        self.blocks.append(Block("table", frame=frame))

    def output(self, name: str) -> Path:
        """The file `name` in the report's folder, once it is known not to be a run's own
        (a report.md left there as a link to a run's summary.json)."""
        path = self.out_dir / name
        refuse_run_file(path, "--out")
        if path.exists():  # a FIFO there blocked the report for ever, a device took it
            try:
                check_regular_file(path)
            except UserFileError as exc:
                raise UserFileError(f"--out: {exc}") from None
        return path

    def figure(self, fig: Any, name: str, caption: str) -> None:
        path = self.output(f"{name}.png")
        figures.save(fig, str(path))
        self.figures.append(path)
        self.blocks.append(Block("figure", caption, path=path))

    def markdown(self) -> str:
        out = []
        for block in self.blocks:
            if block.kind == "heading":
                out.append(f"{'#' * block.level} {block.text}")
            elif block.kind == "text":
                out.append(block.text)
            elif block.kind == "note":
                out.append(f"*{block.text}*")
            elif block.kind == "table":
                out.append(_markdown_table(block.frame))
            elif block.kind == "figure":
                assert block.path is not None  # figure() gives each figure block its path
                out.append(f"![{block.text}]({block.path.name})\n\n{block.text}")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        blocks: list[dict[str, Any]] = []
        for block in self.blocks:
            item: dict[str, Any] = {"kind": block.kind, "text": block.text, "level": block.level}
            if block.kind == "table":
                assert block.frame is not None  # table() gives each table block its frame
                item["header"] = [str(c) for c in block.frame.columns]
                item["rows"] = [
                    [_cell(v) for v in values] for values in block.frame.itertuples(index=False)
                ]
            elif block.kind == "figure":
                assert block.path is not None  # figure() gives each figure block its path
                item["png"] = base64.b64encode(block.path.read_bytes()).decode()
            blocks.append(item)
        return _templates().get_template("report.html.j2").render(title=title, blocks=blocks)


@functools.cache
def _templates() -> jinja2.Environment:
    # Autoescape on: titles, cells and captions come from run names, overrides and metric
    # values, none of them trusted markup. StrictUndefined: a misspelt field in the template
    # fails loudly instead of rendering empty.
    return jinja2.Environment(
        loader=jinja2.PackageLoader("harness.reporting", "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "-"
    return str(value)


def _markdown_table(frame: pd.DataFrame) -> str:
    def row(cells: list[Any]) -> str:
        return (
            "| " + " | ".join(_cell(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
        )

    lines = [row(list(frame.columns)), "| " + " | ".join("---" for _ in frame.columns) + " |"]
    lines += [row(list(values)) for values in frame.itertuples(index=False)]
    return "\n".join(lines)


# formatting -------------------------------------------------------------------------------
def _first_runs(res: Results) -> list[str]:
    """One run per variant (the first), for figures that cannot pool repeats."""
    return list(res.runs.groupby("variant", sort=False)["run_id"].first())


def _limited(res: Results, doc: Document, run_ids: list[str]) -> list[str]:
    if len(run_ids) > figures.MAX_LINES:
        doc.note(f"Showing the first {figures.MAX_LINES} of {len(run_ids)} variants.")
    return run_ids[: figures.MAX_LINES]


# sections ---------------------------------------------------------------------------------
def section_overview(res: Results, doc: Document, paths: list[str]) -> None:
    runs = res.runs
    counts = runs["status"].value_counts()
    doc.text(
        f"Source: {', '.join(f'`{p}`' for p in paths)}. {len(runs)} run(s), "
        f"{runs['variant'].nunique()} variant(s); status: "
        + ", ".join(f"{n} {status}" for status, n in counts.items())
        + "."
    )
    if res.swept:
        doc.text("Swept parameters: " + ", ".join(f"`{k}`" for k in res.swept) + ".")
    machines = runs["machine"].dropna().unique()
    commits = runs["git_commit"].dropna().unique()
    if len(machines):
        doc.text(
            "Machine: "
            + "; ".join(str(m) for m in machines)
            + ". Commit: "
            + ", ".join(str(c)[:12] for c in commits)
            + (" (uncommitted changes)" if runs["git_dirty"].fillna(False).any() else "")
            + "."
        )
    if len(machines) > 1 or runs["hostname_hash"].dropna().nunique() > 1:
        doc.note("These runs come from different machines: compare their timings with care.")
    invalid = runs[runs["window_valid"].eq(False)]
    if len(invalid):
        doc.note(
            f"{len(invalid)} run(s) have a measurement window that is not valid (shorter "
            "than run.window asks, or no request completed inside it under overload): "
            "their throughputs are over the whole run, their latencies over the "
            "window's requests."
        )


def variant_table(res: Results) -> pd.DataFrame:
    """The tidy per-variant table (raw numbers): swept parameters, status, main metrics, and
    the coefficient of variation over repeats where there are repeats."""
    variants = res.variants
    metrics = [m for m in MAIN_METRICS if m in variants.columns and variants[m].notna().any()]
    columns = ["variant", *res.swept, "status"]
    if (variants["runs"] > 1).any():
        columns.append("runs")
    table = variants[columns + metrics].copy()
    spread = res.spread
    for metric in SPREAD_METRICS:
        rows = spread[spread["metric"] == metric].set_index("variant")
        if len(rows) and metric in table:
            table[f"{metric}_cv"] = table["variant"].map(rows["cv"])
    return table


def section_variants(res: Results, doc: Document) -> None:
    doc.heading("Variants")
    table = variant_table(res)
    table.to_csv(doc.output(VARIANTS_FILE), index=False)
    if (res.variants["runs"] > 1).any():
        doc.text(
            "With repeats each metric is the median over the complete runs; `_cv` columns "
            "give the coefficient of variation across them."
        )
    shown = table.copy()
    for column in shown.columns:
        if column in MAIN_METRICS:
            shown[column] = [format_metric(column, v) for v in shown[column]]
        elif column.endswith("_cv"):
            shown[column] = [f"{v:.1%}" if pd.notna(v) else "-" for v in shown[column]]
    doc.table(shown)
    doc.text("The same table with raw numbers: `report_variants.csv`.")
    failed = res.runs[res.runs["status"] != "complete"]
    if len(failed):
        doc.table(failed[["run_id", "status", "error"]].fillna("-"))


def section_latency(res: Results, doc: Document) -> None:
    doc.heading("Latency distributions")
    latencies = res.latencies()
    missing = [run_id for run_id, _ in res.without_requests_table()]
    if latencies.empty:
        names = ", ".join(missing)
        doc.note(
            f"Skipped: no requests table (requests.parquet or requests.jsonl) in {names}."
            if missing
            else "Skipped: no completed requests."
        )
        return
    keep = set(_limited(res, doc, list(latencies["variant"].drop_duplicates())))
    latencies = latencies[latencies["variant"].isin(keep)]
    doc.figure(
        figures.latency_cdfs(latencies),
        "latency_cdf",
        "TTFT, ITL and E2E latency CDFs per variant (requests inside each run's "
        "measurement window; repeats pooled).",
    )
    stats = (
        latencies.groupby(["variant", "latency"], sort=False)["value_s"]
        .describe(percentiles=[0.5, 0.9, 0.99])
        .reset_index()
    )
    rows = []
    for _, row in stats.iterrows():
        rows.append(
            {
                "variant": row["variant"],
                "latency": row["latency"],
                "n": int(row["count"]),
                **{q: format_metric("x_s", row[q]) for q in ("50%", "90%", "99%", "max")},
            }
        )
    doc.table(pd.DataFrame(rows).rename(columns={"50%": "p50", "90%": "p90", "99%": "p99"}))


def _slo(res: Results) -> dict[str, float | None]:
    for run_id in res.runs["run_id"]:
        slo = ((res.config(run_id).get("run") or {}).get("slo")) or {}
        if any(v is not None for v in slo.values()):
            return slo
    return {}


def section_load(res: Results, doc: Document) -> None:
    doc.heading("Throughput vs latency")
    variants = res.variants
    if "offered_req_per_s" not in variants or variants["offered_req_per_s"].dropna().nunique() < 2:
        doc.note(
            "Skipped: not a load sweep (needs variants at two or more offered request "
            "rates: open-loop arrivals, `offered_req_per_s`)."
        )
        return
    x = "output_tok_per_s"
    ys = [
        y
        for y in ("ttft_p99_s", "tpot_p99_s", "e2e_p99_s")
        if y in variants and variants[y].notna().any()
    ]
    rate_keys = [k for k in res.swept if any(h in k for h in RATE_HINTS)]
    series_keys = [k for k in res.swept if k not in rate_keys]
    points = variants.dropna(subset=["offered_req_per_s"]).sort_values("offered_req_per_s")
    points = points.assign(
        series=points.apply(
            lambda r: ", ".join(f"{k}={r[k]}" for k in series_keys) or "all", axis=1
        )
    )
    slo = _slo(res)
    bounds = {
        "ttft_p99_s": slo.get("ttft_s"),
        "tpot_p99_s": slo.get("tpot_s"),
        "e2e_p99_s": slo.get("e2e_s"),
    }
    doc.figure(
        figures.throughput_latency(points, x, ys, bounds),
        "throughput_latency",
        "p99 latency against achieved output throughput, one point per offered rate; "
        "dashed: the SLO (run.slo).",
    )
    set_bounds = {k: v for k, v in slo.items() if v is not None}
    doc.text(
        "SLO: "
        + (
            ", ".join(f"{k} <= {v}" for k, v in set_bounds.items())
            if set_bounds
            else "none set (run.slo)"
        )
        + "."
    )
    columns = [
        "series",
        "offered_req_per_s",
        "req_per_s",
        "output_tok_per_s",
        *ys,
        "goodput_req_per_s",
        "slo_attainment",
    ]
    table = points[[c for c in columns if c in points]].copy()
    for column in table.columns[1:]:
        table[column] = [format_metric(column, v) for v in table[column]]
    doc.table(table)
    for summary in _sweep_summaries(res):
        if summary.get("saturation_req_per_s"):
            doc.text(
                f"Saturation: {summary['saturation_req_per_s']:g} req/s "
                f"({summary.get('saturation_definition', '')})."
            )
        elif summary.get("saturation_note"):
            doc.text(f"Saturation: not found ({summary['saturation_note']}).")
        if summary.get("peak_req_per_s"):
            doc.text(f"Highest achieved rate: {summary['peak_req_per_s']:.4g} req/s.")


def _load_cell(load: Any) -> str:
    return f"{load:.4g}" if isinstance(load, float) else _cell(load)


def section_search(res: Results, doc: Document) -> None:
    """A capacity search's answer (search.json in a sweep folder, docs/capacity.md): its line,
    its points and the figure of each SLO metric against load."""
    folders = sorted({Path(p).parent for p in res.runs.loc[res.runs["sweep"].notna(), "path"]})
    found, problems = [], []
    for folder in folders:
        try:
            records = read_search_records(folder)
        except UnreadableFile as exc:  # a damaged search.json: said, and the rest reported
            problems.append(str(exc))
            continue
        usable = []
        for k, record in enumerate(records):
            why = record_problem(record)
            if why is None:
                usable.append(record)
            else:
                problems.append(f"{folder / SEARCH_FILE}: record {k}: {why}")
        if usable:
            found.append((folder, usable))
    if not found and not problems:
        return  # no search ran: no section (most reports)
    doc.heading("Capacity search")
    for problem in problems:
        doc.note(f"Left out: {problem}.")
    for index, (folder, records) in enumerate(found):
        for record in records:
            line = console_line(record).removeprefix("search").removeprefix(": ")
            doc.text(f"`{folder.name}`: {line}")
            metrics = list(dict.fromkeys(c.split()[0] for c in record.get("slo") or []))
            rows = [
                {
                    **(record.get("grid") or {}),
                    "job": point.get("job"),
                    "run": point.get("role"),
                    "load": _load_cell(point.get("load")),
                    "meets": "yes" if point.get("meets") else "no",
                    **{m: format_metric(m, (point.get("metrics") or {}).get(m)) for m in metrics},
                    "missed": "; ".join(point.get("failed_checks") or []),
                }
                for point in record.get("points") or []
            ]
            doc.table(pd.DataFrame(rows))
        name = "capacity_search" if len(found) == 1 else f"capacity_search_{index}"
        doc.figure(
            figures.capacity_search(records),
            name,
            "Each SLO metric against the load of the search's runs: o meets the SLO, x misses "
            "it; dashed: the bound, dotted: the answer (the highest load measured to meet).",
        )


def _sweep_summaries(res: Results) -> list[dict[str, Any]]:

    folders = {Path(p).parent for p in res.runs.loc[res.runs["sweep"].notna(), "path"]}
    out = []
    for folder in sorted(folders):
        summary = read_sweep_summary(folder)
        if summary is not None:
            out.append(summary)
    return out


def section_timeline(res: Results, doc: Document) -> None:
    doc.heading("Batch size and KV memory over time")
    steps = res.steps
    if steps.empty or not {"end_s", "num_seqs", "kv_bytes_used"} <= set(steps.columns):
        doc.note("Skipped: no engine steps recorded (steps table).")
        return
    run_ids = _limited(res, doc, _first_runs(res))
    shown = res.join(steps[steps["run_id"].isin(run_ids)])
    doc.figure(
        figures.timeline(shown),
        "timeline",
        "Sequences per engine step and KV bytes (used, reserved) over time; the first "
        "run of each variant.",
    )


#: timeslices.csv's columns the report's table shows, with their headings
TIMESLICE_COLUMNS = {
    "requests_sent": "sent",
    "requests_completed": "completed",
    "requests_failed": "failed",
    "requests_cancelled": "cancelled",
    "in_flight": "in flight",
    "output_tok_per_s": "output_tok_per_s",
    "ttft_p50_s": "ttft_p50_s",
    "ttft_p99_s": "ttft_p99_s",
    "itl_p99_s": "itl_p99_s",
}


def section_timeslices(res: Results, doc: Document) -> None:
    """One run over time, from its timeslices.csv: only for a report on a single run (over
    many, per-run tables would swamp it), and only where the run wrote the file."""
    if len(res.runs) != 1:
        return
    table = read_timeslices(Path(res.runs["path"].iloc[0]))
    if table is None or table.empty or not set(TIMESLICE_COLUMNS) <= set(table.columns):
        return
    doc.heading("Timeslices")
    doc.figure(
        figures.timeslices(table),
        "timeslices",
        "Output tokens/s of completed requests, and TTFT p99 of the first tokens, per slice "
        "(timeslices.csv; docs/metrics.md).",
    )
    shown = pd.DataFrame(
        {
            "slice (s)": [
                f"{a:g}-{b:g}"
                for a, b in zip(table["slice_start_s"], table["slice_end_s"], strict=True)
            ]
        }
    )
    for column, heading in TIMESLICE_COLUMNS.items():
        if column in ("requests_failed", "requests_cancelled") and not table[column].any():
            continue  # a column of zeros says nothing
        values = table[column]
        shown[heading] = (
            values.astype(int).astype(str).tolist()
            if column.startswith(("requests_", "in_"))
            else [format_metric(column, v) for v in values]
        )
    doc.table(shown)


MEMORY_ORDER = (
    "memory_weights_bytes",
    "memory_packed_weights_bytes",
    "memory_kv_pool_bytes",
    "memory_kv_reserved_bytes",
    "memory_kv_used_bytes",
    "memory_other_bytes",
    "memory_peak_bytes",
)


def memory_parts(variants: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series | None]:
    """Disjoint memory parts per variant (bytes) and the peak: the KV metrics nest (used within
    reserved within the pool), so the bars stack used, reserved-but-unused and the pool's free
    rest; memory_* kinds this report does not know are stacked as they are."""
    frame = variants.set_index("variant")

    def column(name: str) -> pd.Series | None:
        if name in frame and frame[name].notna().any():
            return pd.to_numeric(frame[name], errors="coerce")
        return None

    weights, pool = column("memory_weights_bytes"), column("memory_kv_pool_bytes")
    reserved, used = column("memory_kv_reserved_bytes"), column("memory_kv_used_bytes")
    parts = pd.DataFrame(index=frame.index)
    if weights is not None:
        parts["weights"] = weights
    if (packed := column("memory_packed_weights_bytes")) is not None:
        parts["packed weight copies"] = packed
    if used is not None:
        parts["KV in use"] = used
    if reserved is not None:
        parts["KV reserved, unused"] = reserved - (used if used is not None else 0)
    if pool is not None:
        inner = reserved if reserved is not None else used
        parts["KV pool, free"] = pool - (inner if inner is not None else 0)
    if (other := column("memory_other_bytes")) is not None:
        parts["other (activations, workspace)"] = other
    for name in frame.columns:
        if (
            name.startswith("memory_")
            and name not in MEMORY_ORDER
            and (extra := column(name)) is not None
        ):
            parts[name.removeprefix("memory_").removesuffix("_bytes")] = extra
    return parts.clip(lower=0), column("memory_peak_bytes")


def section_memory(res: Results, doc: Document) -> None:
    doc.heading("Memory breakdown")
    variants = res.variants
    present = [c for c in variants.columns if c.startswith("memory_") and variants[c].notna().any()]
    if not present:
        doc.note(
            "Skipped: no memory breakdown recorded (summary metrics `memory_*`, from the monitor)."
        )
        return
    parts, peak = memory_parts(variants)
    if len(parts.columns):
        doc.figure(
            figures.stacked_bars(
                parts / 2**20,
                "MiB",
                marks=None if peak is None else peak / 2**20,
                mark_label="peak of the run",
            ),
            "memory",
            "Memory per variant: weights, their packed copies (CPU kernels), KV "
            "cache (in use, reserved but unused, the "
            "pool's free rest) and other (activations, workspace); black tick: the "
            "run's peak. On a CPU without kv_cache_prefault the KV pool is mapped "
            "lazily: its free part holds no pages, so the peak can sit below the bar "
            "(docs/monitoring.md).",
        )
    ordered = [c for c in MEMORY_ORDER if c in present]
    table = variants[["variant", *ordered, *[c for c in present if c not in ordered]]].copy()
    for name in table.columns[1:]:
        table[name] = [format_metric(name, v) for v in table[name]]
    doc.table(table)


def section_samples(res: Results, doc: Document) -> None:
    doc.heading("Resources over time")
    samples = res.samples
    plots = [c for c in SAMPLE_PLOTS if c in samples and samples[c].notna().any()]
    if samples.empty or not plots:
        doc.note("Skipped: no monitor samples (samples table).")
        return
    run_ids = _limited(res, doc, _first_runs(res))
    shown = res.join(samples[samples["run_id"].isin(run_ids)])
    doc.figure(
        figures.samples_timeline(shown, plots),
        "samples",
        "Monitor samples over time; the first run of each variant.",
    )


def section_phases(res: Results, doc: Document) -> None:
    doc.heading("Phase breakdown")
    requests = res.requests
    phases = [p for p in PHASES if p in requests and requests[p].notna().any()]
    if not phases:
        doc.note(
            "Skipped: no per-request phase times (requests columns " + ", ".join(PHASES) + ")."
        )
        return
    done = requests[
        (requests["status"] == "ok")
        & requests.get("in_window", pd.Series(True, index=requests.index))
    ]
    done = res.join(done)
    means = done.groupby("variant", sort=False)[phases].mean()
    doc.figure(
        figures.stacked_bars(means, "mean time per request (ms)", scale=1e3),
        "phases",
        "Mean time per completed request in each phase, per variant.",
    )
    table = means.reset_index()
    e2e = (done["last_token_s"] - done["arrival_s"]).groupby(done["variant"], sort=False).mean()
    table["sum of phases"] = means.sum(axis=1).to_numpy()
    table["e2e (mean)"] = table["variant"].map(e2e)
    for column in table.columns[1:]:
        table[column] = [format_metric("x_s", v) for v in table[column]]
    doc.table(table)


def section_adapters(res: Results, doc: Document) -> None:
    table = adapters.adapter_table(res.join(res.requests))
    if table.empty:
        return  # no LoRA traffic: the section is left out, not noted as skipped
    doc.heading("LoRA adapters")
    doc.text(
        "Completed requests in the measured window, per variant and adapter (requests.parquet "
        "`lora`; docs/lora.md)."
    )
    for column in ("ttft_p50_s", "tpot_p50_s"):
        table[column] = [format_metric(column, v) for v in table[column]]
    doc.table(table)


def hardware_roof(res: Results) -> Roof | None:
    """The hardware spec the first run that recorded one measured on, for its compute dtype."""
    for run_id in res.runs["run_id"]:
        summary = res.summary(run_id)
        dtype = str((summary.get("engine") or {}).get("dtype") or "")
        roof = Roof.of(summary.get("hardware"), dtype)
        if roof is not None and (roof.peak_flops or roof.memory_bandwidth):
            return roof
    return None


def roofline_points(res: Results) -> pd.DataFrame:
    """Per step: arithmetic intensity (FLOPs / bytes moved), achieved FLOP/s over the measured
    step time (end_s - start_s, the time MBU, MFU and predicted_s are defined against, so a
    point sits at MFU x peak), whether the step prefilled, whether it was decode-only or
    prefill-only (the steps of mbu_decode_mean and mfu_prefill_mean), and the
    roofline-predicted time next to the measured."""
    steps = res.steps
    moved = sum(
        steps[c].fillna(0)
        for c in ("weight_bytes_read", "kv_bytes_read", "kv_bytes_written")
        if c in steps
    )
    measured = measured_step_s(steps)
    points = pd.DataFrame(
        {
            "run_id": steps["run_id"],
            "intensity": steps["flops"] / moved,
            "flops_per_s": steps["flops"] / measured,
            "prefill": steps["prefill_tokens"].fillna(0) > 0,
            "decode_only": decode_only(steps),
            "prefill_only": prefill_only(steps),
            "measured_s": measured,
        }
    )
    for column in ("predicted_s", "mbu", "mfu"):
        if column in steps:
            points[column] = steps[column]
    points = points.replace([np.inf, -np.inf], np.nan).dropna(subset=["intensity", "flops_per_s"])
    return res.join(points[points["flops_per_s"] > 0])


def section_roofline(res: Results, doc: Document) -> None:
    doc.heading("Roofline")
    steps = res.steps
    if steps.empty or not all(c in steps and steps[c].notna().any() for c in ROOFLINE_COLUMNS):
        doc.note(
            "Skipped: no per-step roofline counters (steps columns "
            + ", ".join(ROOFLINE_COLUMNS)
            + ")."
        )
        return
    points = roofline_points(res)
    if points.empty:
        doc.note("Skipped: no step with FLOPs and a measured time.")
        return
    run_ids = set(_limited(res, doc, _first_runs(res)))
    roof = hardware_roof(res)
    peak, bandwidth = (roof.peak_flops, roof.memory_bandwidth) if roof else (None, None)
    doc.figure(
        figures.roofline(
            points[points["run_id"].isin(run_ids)], peak, bandwidth, roof.overlap if roof else 1.0
        ),
        "roofline",
        "Per step: achieved FLOP/s against arithmetic intensity "
        "(circles decode-only, triangles with prefill)"
        + (
            f" under the roofline of {(roof and roof.name) or 'the recorded hardware'}"
            if peak and bandwidth
            else "; no hardware spec recorded, so no roofline drawn"
        )
        + "; and predicted against measured step time. The first run of each variant.",
    )
    rows = []
    for variant, group in points.groupby("variant", sort=False):
        decode, prefill = group[group["decode_only"]], group[group["prefill_only"]]
        row: dict[str, Any] = {"variant": variant, "steps": len(group)}
        if "mbu" in group:
            row["MBU decode (mean)"] = _fraction(decode["mbu"].mean())
        if "mfu" in group:
            row["MFU prefill (mean)"] = _fraction(prefill["mfu"].mean())
        if "predicted_s" in group:
            ratio = (group["measured_s"] / group["predicted_s"]).replace([np.inf, -np.inf], np.nan)
            row["measured / predicted (median)"] = (
                f"{ratio.median():.2f}" if ratio.notna().any() else "-"
            )
        rows.append(row)
    doc.table(pd.DataFrame(rows))
    doc.text(
        "Over every step of every run of the variant (the summary's `mbu_decode_mean`, "
        "`mfu_prefill_mean` and `roofline_ratio_p50` cover the measurement window): MBU "
        "over decode-only steps, MFU over prefill-only steps, measured = `end_s - start_s` "
        "(docs/roofline.md)."
    )


def _fraction(value: float) -> str:
    return f"{value:.1%}" if pd.notna(value) else "-"


def section_runs(res: Results, doc: Document) -> None:
    doc.heading("Runs")
    columns = [
        c
        for c in (
            "run_id",
            "variant",
            "repeat",
            "round",
            "status",
            "duration_s",
            "num_completed",
            "config_hash",
        )
        if c in res.runs
    ]
    table = res.runs[columns].copy()
    if "duration_s" in table:
        table["duration_s"] = [format_metric("duration_s", v) for v in table["duration_s"]]
    doc.table(table.dropna(axis=1, how="all"))


def section_speculative(res: Results, doc: Document) -> None:
    variants = res.variants
    if "spec_acceptance_rate" not in variants or variants["spec_acceptance_rate"].isna().all():
        return  # nothing speculated: the section is left out, not noted as skipped
    doc.heading("Speculative decoding")
    table = speculative.speedups(res)
    if table.empty:
        doc.note(
            "Skipped: needs variants with and without `engine.speculative_config` that share "
            "their other swept settings."
        )
        return
    axis = speculative.load_axis(res)
    series = [c for c in table.columns if c not in speculative.MEASURED and c != axis]
    points = table.assign(
        series=table[series].astype(str).agg(", ".join, axis=1) if series else "all"
    )
    doc.figure(
        figures.speculative_speedups(points, axis),
        "speculative_speedup",
        f"Output tokens/s with speculation over the same settings without it: against {axis} "
        "(left; dashed: no gain) and against the acceptance rate (right).",
    )
    shown = table.copy()
    for column in ("speedup", "tpot_speedup"):
        shown[column] = [f"{v:.2f}x" if pd.notna(v) else "-" for v in shown[column]]
    for column in shown.columns:
        metric = "output_tok_per_s" if column == "baseline_tok_per_s" else column
        if find_metric(metric) is not None:
            shown[column] = [format_metric(metric, v) for v in shown[column]]
    doc.table(shown.fillna("-"))
    doc.text("Where speculation stops paying (speed-up in tokens/s below 1):")
    doc.table(speculative.stops_paying(table, axis).fillna("never, in the loads measured"))


SECTIONS: tuple[Callable[[Results, Document], None], ...] = (
    section_variants,
    section_latency,
    section_load,
    section_search,
    section_speculative,
    section_timeline,
    section_timeslices,
    section_memory,
    section_samples,
    section_phases,
    section_adapters,
    section_roofline,
    section_runs,
)


def write_report(
    paths: list[str | Path],
    out_dir: str | Path,
    title: str | None = None,
    slos: list[str] | tuple[str, ...] = (),
) -> dict[str, Path]:
    """Write report.md, report.html, report_variants.csv and the figures into `out_dir`;
    `slos` ('tpot_p99_s <= 0.05', harness/measuring/checks.py) name the best configuration
    under each in the decision section."""
    for k, text in enumerate(slos):  # before anything is loaded or written
        parse_checks(text, f"--slo[{k}]")
    res = load(*paths)
    for _, folder in res.without_requests_table():
        print(
            f"inferlab report: warning: {folder}: no requests.parquet or requests.jsonl, though "
            "its summary counts completed requests; its per-request figures and tables are "
            "left out",
            file=sys.stderr,
        )
    out = Path(out_dir)
    doc = Document(out)
    files = [doc.output(name) for name in (MARKDOWN_FILE, HTML_FILE, VARIANTS_FILE)]
    out.mkdir(parents=True, exist_ok=True)
    title = title or f"inferlab report: {', '.join(Path(p).name for p in paths)}"
    doc.heading(title, level=1)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    doc.text(f"Generated {stamp} by `inferlab report`.")
    section_overview(res, doc, [str(p) for p in paths])
    for section in SECTIONS:
        section(res, doc)
        if section is section_load:  # the decision follows the load curves it summarizes
            pareto.section_decision(res, doc, slos)
    markdown_file, html_file, variants_file = files
    markdown_file.write_text(doc.markdown())
    html_file.write_text(doc.html(title))
    return {
        "markdown": markdown_file,
        "html": html_file,
        "variants": variants_file,
        **{p.stem: p for p in doc.figures},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="inferlab report",
        description="report.md and report.html (tables, figures) for run / sweep folders",
    )
    parser.add_argument(
        "paths", nargs="+", help="run, sweep, repeats or A/B gate folders, or folders above them"
    )
    parser.add_argument("--out", help="output folder (default: the one folder given)")
    parser.add_argument("--title", help="report title")
    parser.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="CHECK",
        help="an SLO such as 'tpot_p99_s <= 0.05' (repeatable): the decision section names "
        "the configuration with the most throughput per device that meets it",
    )
    args = parser.parse_args(argv)
    if args.out is None and len(args.paths) > 1:
        parser.error("--out: required when several folders are given")
    out = args.out or args.paths[0]
    try:
        if args.out is not None:
            given_output_path(args.out, "--out", "a folder path")
        written = write_report(args.paths, out, args.title, args.slo)
    except (FileNotFoundError, ValueError) as exc:
        print(f"inferlab report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out is a file, or a folder that cannot be written (or is full)
        where = exc.filename or out
        print(
            f"inferlab report: --out {out}: cannot write {where}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    print(f"report: {written['markdown']}, {written['html']} ({len(written) - 3} figure(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
