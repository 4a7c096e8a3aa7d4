"""`inferlab report` on a real tiny load sweep: report.md, report.html and figures with the real
numbers; sections render when their columns exist (planted, known values) and are skipped with
a note when they do not; repeats add spread columns."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import markupsafe
import pandas as pd
import pytest

from harness import cli
from harness.measuring.roofline import Roof
from harness.reporting.report import (
    PHASES,
    Document,
    format_metric,
    hardware_roof,
    memory_parts,
    roofline_points,
    section_roofline,
)
from harness.reporting.results import load

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

ROOFLINE = [
    "flops",
    "weight_bytes_read",
    "kv_bytes_read",
    "kv_bytes_written",
    "predicted_s",
    "mbu",
    "mfu",
]


@pytest.fixture(scope="module")
def sweep(tiny_rate_sweep: Path) -> Path:
    return tiny_rate_sweep


def jobs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if (p / "summary.json").is_file())


def cells(markdown_row: str) -> list[str]:
    return [c.strip() for c in markdown_row.strip().strip("|").split("|")]


def edit_table(run: Path, table: str, **columns: object) -> None:
    frame = pd.read_parquet(run / f"{table}.parquet")
    for name, value in columns.items():
        if value is None:
            frame = frame.drop(columns=name, errors="ignore")
        else:
            frame[name] = value(frame) if callable(value) else value
    frame.to_parquet(run / f"{table}.parquet", index=False)


def edit_summary(run: Path, edit: object) -> None:
    summary = json.loads((run / "summary.json").read_text())
    edit(summary)  # type: ignore[operator]
    (run / "summary.json").write_text(json.dumps(summary))


def test_report_writes_markdown_html_and_figures(
    sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert cli.main(["report", str(sweep), "--out", str(out)]) == 0
    assert "report.md" in capsys.readouterr().out
    markdown = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    for figure in ("latency_cdf", "throughput_latency", "timeline"):
        assert (out / f"{figure}.png").stat().st_size > 5000
        assert f"({figure}.png)" in markdown
    pngs = sorted(out.glob("*.png"))
    assert page.count("data:image/png;base64,") == len(pngs)
    variants = pd.read_csv(out / "report_variants.csv")
    assert variants["workload.arrival.rate"].tolist() == [100, 400]
    for job in jobs(sweep):
        metrics = json.loads((job / "summary.json").read_text())["metrics"]
        row = variants[
            variants["variant"] == f"workload.arrival.rate={[100, 400][int(job.name)]}"
        ].iloc[0]
        assert row["ttft_p50_s"] == pytest.approx(metrics["ttft_p50_s"], rel=1e-12)
        assert row["output_tok_per_s"] == pytest.approx(metrics["output_tok_per_s"], rel=1e-12)
        for name in ("ttft_p50_s", "tpot_p50_s", "e2e_p99_s"):
            shown = format_metric(name, metrics[name])
            assert re.search(r"\d", shown)
            assert shown in markdown and shown in page
    assert "SLO: ttft_s <= 0.5" in markdown
    # the same content: every table cell of the markdown is in the html
    for line in markdown.splitlines():
        if line.startswith("| ") and "---" not in line:
            for cell in line.strip("| ").split(" | "):
                assert str(markupsafe.escape(cell)) in page  # as the template escapes it


def test_a_single_run_gets_its_timeslices(sweep: Path, tmp_path: Path) -> None:
    job = jobs(sweep)[0]
    table = pd.read_csv(job / "timeslices.csv")  # the real run wrote it
    assert table["requests_sent"].sum() == 8
    out = tmp_path / "report"
    assert cli.main(["report", str(job), "--out", str(out)]) == 0
    markdown = (out / "report.md").read_text()
    assert "## Timeslices" in markdown and "(timeslices.png)" in markdown
    assert (out / "timeslices.png").stat().st_size > 5000
    first = f"{table['slice_start_s'][0]:g}-{table['slice_end_s'][0]:g}"
    assert f"| {first} | {table['requests_sent'][0]} |" in markdown
    # over several runs: no per-run timeline
    assert cli.main(["report", str(sweep), "--out", str(tmp_path / "sweep")]) == 0
    assert "## Timeslices" not in (tmp_path / "sweep" / "report.md").read_text()


def test_sections_render_from_their_columns(sweep: Path, tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    shutil.copytree(sweep, planted)
    for job in jobs(planted):
        edit_table(
            job,
            "requests",
            tokenize_s=0.001,
            queue_s=0.002,
            prefill_s=0.010,
            decode_s=0.020,
            detokenize_s=0.0005,
        )
        edit_table(
            job,
            "steps",
            flops=2e9,
            weight_bytes_read=1e9,
            kv_bytes_read=0.0,
            kv_bytes_written=0.0,
            mbu=0.5,
            mfu=0.25,
            predicted_s=lambda f: (f["end_s"] - f["start_s"]) / 2,
        )
        pd.DataFrame(
            {
                "time_s": [0.0, 0.05, 0.1],
                "rss_bytes": [2**30, 2**30 + 2**20, 2**30],
                "cpu_util": [0.5, 1.0, 0.75],
            }
        ).to_parquet(job / "samples.parquet")

        def plant(summary: dict) -> None:
            summary["metrics"].update(
                memory_weights_bytes=3 * 2**20,
                memory_packed_weights_bytes=2**21,
                memory_kv_pool_bytes=4 * 2**20,
                memory_kv_reserved_bytes=2**20,
                memory_kv_used_bytes=2**19,
                memory_other_bytes=2**20,
                memory_peak_bytes=6 * 2**20,
            )
            summary["hardware"] = {
                "name": "testchip",
                "peak_flops": {"float32": 1e12},
                "memory_bandwidth": 1e11,
            }

        edit_summary(job, plant)
    out = tmp_path / "report"
    assert cli.main(["report", str(planted), "--out", str(out)]) == 0
    markdown = (out / "report.md").read_text()
    assert "Skipped" not in markdown
    for figure in ("memory", "samples", "phases", "roofline"):
        assert (out / f"{figure}.png").is_file(), figure
    phase_row = next(
        line
        for line in markdown.splitlines()
        if line.startswith("| workload.arrival.rate=100 | 1.00 ms")
    )
    assert cells(phase_row)[1:7] == [
        "1.00 ms",
        "2.00 ms",
        "10.00 ms",
        "20.00 ms",
        "0.50 ms",
        "33.50 ms",
    ]
    roofline_row = next(
        line
        for line in markdown.splitlines()
        if line.startswith("| workload.arrival.rate=400 |") and "50.0%" in line
    )
    assert cells(roofline_row)[2:5] == ["50.0%", "25.0%", "2.00"]
    assert "roofline of testchip" in markdown
    assert (
        "| workload.arrival.rate=100 | 3.00 MiB | 2.00 MiB | 4.00 MiB | 1.00 MiB "
        "| 512.00 KiB | 1.00 MiB | 6.00 MiB |"
    ) in markdown
    res = load(planted)
    parts, peak = memory_parts(res.variants)
    assert parts.iloc[0].tolist() == [3 * 2**20, 2**21, 2**19, 2**19, 3 * 2**20, 2**20]
    assert peak.iloc[0] == 6 * 2**20


def test_sections_without_their_columns_are_skipped_with_a_note(
    sweep: Path, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(sweep / "0", bare)
    edit_table(bare, "requests", **dict.fromkeys(PHASES))
    edit_table(bare, "steps", **dict.fromkeys(ROOFLINE))
    (bare / "samples.parquet").unlink(missing_ok=True)
    edit_summary(
        bare,
        lambda s: s["metrics"].update(
            {k: None for k in list(s["metrics"]) if k.startswith("memory_")}
        ),
    )
    assert cli.main(["report", str(bare)]) == 0
    markdown = (bare / "report.md").read_text()
    skipped = [line for line in markdown.splitlines() if line.startswith("*Skipped:")]
    assert len(skipped) == 5  # load sweep, memory, samples, phases, roofline
    assert (bare / "latency_cdf.png").is_file() and (bare / "timeline.png").is_file()
    assert not (bare / "roofline.png").exists() and not (bare / "phases.png").exists()


def test_a_run_whose_requests_table_is_gone_is_named_not_called_empty(
    sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run folder without requests.parquet and requests.jsonl (deleted, or lost in a copy)
    gave a report whose latency section said "Skipped: no completed requests." beside a
    variants table counting its completed requests, and nothing on the terminal."""
    run = tmp_path / "run"
    shutil.copytree(sweep / "0", run)
    (run / "requests.parquet").unlink()
    (run / "requests.jsonl").unlink(missing_ok=True)
    assert cli.main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert err == (
        f"inferlab report: warning: {run}: no requests.parquet or requests.jsonl, though its "
        "summary counts completed requests; its per-request figures and tables are left out\n"
    )
    markdown = (run / "report.md").read_text()
    assert "Skipped: no completed requests." not in markdown
    assert "*Skipped: no requests table (requests.parquet or requests.jsonl) in run.*" in markdown


def test_an_imported_run_without_per_request_data_is_no_missing_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A vLLM result without --save-detailed is imported without a requests table: nothing is
    missing, and the report says no more than that it has no completed requests' rows."""
    run = tmp_path / "imported"
    summary_only = Path(__file__).resolve().parents[2] / "fixtures" / "vllm" / "summary_only.json"
    assert cli.main(["import", str(summary_only), "--out", str(run)]) == 0
    capsys.readouterr()
    assert cli.main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    assert "no requests.parquet" not in capsys.readouterr().err
    assert "Skipped: no requests table" not in (tmp_path / "report" / "report.md").read_text()


def test_repeats_add_spread_columns(sweep: Path, tmp_path: Path) -> None:
    repeats = tmp_path / "repeats"
    values = []
    for k in range(3):
        shutil.copytree(sweep / "0", repeats / f"repeat-{k}")
        values.append(100.0 + 10 * k)
        edit_summary(
            repeats / f"repeat-{k}", lambda s, v=values[-1]: s["metrics"].update(output_tok_per_s=v)
        )
    (repeats / "summary.json").write_text(
        json.dumps(
            {
                "status": "complete",
                "repeats": 3,
                "metrics": {"output_tok_per_s": 110.0},
                "metrics_spread": {
                    "output_tok_per_s": {
                        "median": 110.0,
                        "min": 100.0,
                        "max": 120.0,
                        "std": 10.0,
                        "cv": 10.0 / 110.0,
                        "values": values,
                    }
                },
            }
        )
    )
    out = tmp_path / "report"
    assert cli.main(["report", str(repeats), "--out", str(out)]) == 0
    variants = pd.read_csv(out / "report_variants.csv")
    assert variants.loc[0, "runs"] == 3 and variants.loc[0, "output_tok_per_s"] == 110.0
    assert variants.loc[0, "output_tok_per_s_cv"] == pytest.approx(10.0 / 110.0)
    assert "9.1%" in (out / "report.md").read_text()


def test_bad_arguments_are_named(
    tmp_path: Path, sweep: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["report", str(sweep / "0"), str(sweep / "1")])  # --out required
    assert "--out" in capsys.readouterr().err


class StubResults:
    """What the roofline section reads of a Results: one run, one variant."""

    def __init__(self, steps: pd.DataFrame, summary: dict) -> None:
        self.steps = steps.assign(run_id="r")
        self.runs = pd.DataFrame({"run_id": ["r"], "variant": ["v"]})
        self._summary = summary

    def join(self, frame: pd.DataFrame, *columns: str) -> pd.DataFrame:
        return frame.assign(variant="v")

    def summary(self, run_id: str) -> dict:
        return self._summary

    def provenance(self, run_id: str) -> dict:
        return {}


def test_roofline_section_uses_the_metric_definitions(tmp_path: Path) -> None:
    # a prefill-only, a mixed and a decode-only step; the forward is half of each step
    steps = pd.DataFrame(
        {
            "start_s": [0.0, 1.0, 2.0],
            "end_s": [1.0, 2.0, 4.0],
            "forward_s": [0.5, 0.5, 1.0],
            "num_prefill_seqs": [1, 1, 0],
            "num_decode_seqs": [0, 1, 2],
            "prefill_tokens": [10, 5, 0],
            "decode_tokens": [0, 1, 2],
            "flops": [4e9, 2e9, 1e8],
            "weight_bytes_read": [1e9, 1e9, 1e9],
            "kv_bytes_read": [0.0, 1e6, 2e6],
            "kv_bytes_written": [1e7, 6e6, 2e6],
            "predicted_s": [0.5, 0.25, 1.0],
            "mbu": [0.1, 0.9, 0.2],
            "mfu": [0.4, 0.9, 0.01],
        }
    )
    res = StubResults(
        steps,
        {
            "engine": {"dtype": "float32"},
            "hardware": {"name": "chip", "peak_flops": {"float32": 1e10}, "memory_bandwidth": 1e9},
        },
    )
    points = roofline_points(res)  # type: ignore[arg-type]
    # measured = end_s - start_s, as MBU / MFU / predicted_s are defined
    assert points["measured_s"].tolist() == [1.0, 1.0, 2.0]
    assert points["flops_per_s"].tolist() == [4e9, 2e9, 5e7]
    doc = Document(tmp_path)
    section_roofline(res, doc)  # type: ignore[arg-type]
    # MBU over the decode-only step, MFU over the prefill-only one (not the mixed one),
    # measured / predicted = 2, 4, 2 -> median 2
    assert "| v | 3 | 20.0% | 40.0% | 2.00 |" in doc.markdown()


def test_roofline_peak_is_the_runs_own_dtype() -> None:
    spec = {"name": "chip", "peak_flops": {"float32": 1e12, "int8": 8e12}, "memory_bandwidth": 1e11}
    res = StubResults(pd.DataFrame(), {"engine": {"dtype": "bfloat16"}, "hardware": spec})
    # no bfloat16 peak: no compute roof, never another dtype's
    assert hardware_roof(res) == Roof("chip", None, 1e11, 1.0)  # type: ignore[arg-type]
    res = StubResults(pd.DataFrame(), {"engine": {"dtype": "float32"}, "hardware": spec})
    # no measured overlap: the standard roofline; a measured one, for the run's dtype
    assert hardware_roof(res) == Roof("chip", 1e12, 1e11, 1.0)  # type: ignore[arg-type]
    measured = StubResults(
        pd.DataFrame(),
        {"engine": {"dtype": "float32"}, "hardware": {**spec, "overlap": {"float32": 0.1}}},
    )
    assert hardware_roof(measured) == Roof("chip", 1e12, 1e11, 0.1)  # type: ignore[arg-type]
    # one spelling: a spec in other words (peak_tflops, bandwidth_gb_s) is no spec
    other = {"name": "chip", "peak_tflops": {"float32": 1.0}, "bandwidth_gb_s": 100}
    res = StubResults(pd.DataFrame(), {"engine": {"dtype": "float32"}, "hardware": other})
    assert hardware_roof(res) is None  # type: ignore[arg-type]


def test_speculative_section_pairs_each_variant_with_its_baseline(tmp_path: Path) -> None:
    """A sweep of speculation off / ngram x two concurrencies: each ngram variant is divided by
    the variant without speculation at its own concurrency (read from the run configs)."""
    sweep = tmp_path / "sweep"
    code = cli.main(
        [
            "run",
            "-m",
            "model=tiny",
            "engine.speculative_config=null,{method:ngram,num_speculative_tokens:3,"
            "prompt_lookup_min:1}",
            "workload.arrival.process=closed",
            "workload.arrival.concurrency=1,2",
            "workload.num_requests=4",
            "workload.input_len=16",
            "workload.output_len=16",
            "run.warmup_requests=0",
            "run.progress=false",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    assert code == 0
    from harness.reporting import speculative

    res = load(sweep)
    table = speculative.speedups(res).set_index("workload.arrival.concurrency")
    assert list(table["speculation"]) == ["ngram k=3 lookup 4..1"] * 2
    variants = res.variants.set_index("variant")
    for concurrency, row in table.iterrows():
        base = variants[
            (variants["workload.arrival.concurrency"] == concurrency)
            & variants["spec_acceptance_rate"].isna()
        ]["output_tok_per_s"]
        assert row["baseline_tok_per_s"] == base.item()
        assert row["speedup"] == pytest.approx(row["output_tok_per_s"] / base.item())
        assert row["spec_acceptance_rate"] > 0
    paths = cli_report(sweep, tmp_path / "report")
    markdown = paths.read_text()
    assert "## Speculative decoding" in markdown and "speculative_speedup.png" in markdown
    assert "Where speculation stops paying" in markdown


def cli_report(folder: Path, out: Path) -> Path:
    assert cli.main(["report", str(folder), "--out", str(out)]) == 0
    return out / "report.md"


def test_a_speculating_variant_pairs_only_with_the_same_engine_without_it(
    tmp_path: Path,
) -> None:
    """variant=int8,fp32,ngram_k2: ngram_k2 computes in float32 like fp32, so fp32 is its
    baseline, whichever comes first in the sweep (hostile-user pass: it was int8's)."""
    sweep = tmp_path / "sweep"
    args = ["run", "-m", "model=tiny", "variant=int8,fp32,ngram_k2"]
    args += ["workload.num_requests=2", "workload.input_len=8", "workload.output_len=8"]
    args += ["run.warmup_requests=0", "run.progress=false", f"hydra.sweep.dir={sweep}"]
    assert cli.main(args) == 0
    from harness.reporting import speculative

    res = load(sweep)
    [row] = speculative.speedups(res).to_dict("records")
    variants = res.variants.set_index("variant")["output_tok_per_s"]
    fp32 = variants[[v for v in variants.index if "fp32" in v]].item()
    assert row["speculation"] == "ngram k=2 lookup 4..1"
    assert row["baseline_tok_per_s"] == fp32


def test_an_out_that_cannot_be_written_is_named(
    tmp_path: Path, sweep: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --out naming a file (or a folder that cannot be written) ended in a Python traceback
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for out in (a_file, a_file / "report"):
        assert cli.main(["report", str(sweep), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith(f"inferlab report: --out {out}: cannot write") and "Traceback" not in err
        )
        assert len(err.strip().splitlines()) == 1
    assert a_file.read_text() == "mine"
