"""A server's own view during a run: its Prometheus `/metrics` scraped by the monitor.

`ServerScrape.read` is a monitor reader (harness/measuring/monitors.py) run every
`run.monitor.server_interval_s`, at the measured run's start and at its end. Each scrape:
- keeps every series of the page, change-encoded (a row when a value differs from the previous
  scrape's; one `SCRAPE_SERIES` row per scrape with the GET's duration), for
  `server_metrics.parquet`, so any series can be read back at any scrape;
- returns the canonical gauges and counters (server_names.py) as `server_*` columns of
  `samples.parquet`, counters since the first scrape.

`server_figures` turns the kept series into the run's figures over a span: the histograms' and
counters' differences between the scrapes that bracket it (so warm-up requests, finished before
the scrape at the measured start, are left out), and the gauges' time-weighted means and peaks.
`DcgmScrape` reads a GPU's counters from an NVIDIA dcgm-exporter into the monitor's GPU columns.
Pages are parsed with prometheus_client's reference parser. docs/interop.md.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from engines.base import now_ns
from harness.measuring.server_names import (
    DCGM_COLUMNS,
    DETECT_ORDER,
    QUANTITIES,
    SERVER_NAMES,
)

SERVER_COLUMNS = [f"server_{q.name}" for q in QUANTITIES.values() if q.kind in ("gauge", "counter")]
SERVER_SERIES_COLUMNS = ["time_s", "name", "labels", "value"]
# one row per scrape: how long the GET took (s); also marks every scrape's time
SCRAPE_SERIES = "inferlab_scrape_duration_seconds"
# histogram figures: these percentiles, estimated as Prometheus' histogram_quantile does
PERCENTILES = (50, 90, 99)

Sample = tuple[str, str, float]  # name, labels (JSON, sorted keys), value
Fetch = Callable[[str, float], str]


def http_get(url: str, timeout_s: float) -> str:
    response = httpx.get(url, timeout=timeout_s)
    response.raise_for_status()
    return response.text


def parse_page(text: str) -> list[Sample]:
    """Every sample of a Prometheus text page; ValueError when it is not one."""
    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = json.dumps(dict(sorted(sample.labels.items())), separators=(",", ":"))
            out.append((sample.name, labels, float(sample.value)))
    return out


def detect_server(names: Iterable[str]) -> str | None:
    """The server whose names the page uses (DETECT_ORDER breaks ties)."""
    present = set(names)
    for server in DETECT_ORDER:
        for candidates in SERVER_NAMES[server].values():
            for name in candidates:
                if name in present or f"{name}_count" in present:
                    return server
    return None


@dataclass(frozen=True)
class Histogram:
    bounds: tuple[float, ...]  # upper bounds, +Inf last
    cumulative: tuple[float, ...]  # observations <= each bound
    sum: float
    count: float

    def minus(self, before: Histogram) -> Histogram | None:
        """The observations since `before`; None when the buckets differ or a count fell."""
        if self.bounds != before.bounds:
            return None
        counts = tuple(a - b for a, b in zip(self.cumulative, before.cumulative, strict=True))
        if min(counts, default=0.0) < 0 or self.count < before.count:
            return None
        return Histogram(self.bounds, counts, self.sum - before.sum, self.count - before.count)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear inside the bucket that holds rank q * count;
        in the +Inf bucket, the largest finite bound (a floor, as Prometheus reports)."""
        if self.count <= 0:
            return None
        rank = q * self.cumulative[-1]
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower_bound
                if cumulative == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                    cumulative - lower_count
                )
            lower_bound, lower_count = bound, cumulative
        return lower_bound


def quantities(samples: Iterable[Sample], server: str) -> dict[str, Any]:
    """The canonical quantities in `samples`: floats for gauges and counters (label sets
    combined), Histograms for histograms."""
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in samples:
        by_name.setdefault(name, []).append((json.loads(labels), value))
    present = set(by_name)
    out: dict[str, Any] = {}
    for quantity, candidates in SERVER_NAMES[server].items():
        spec = QUANTITIES[quantity]
        if spec.kind == "histogram":
            base = next((n for n in candidates if f"{n}_count" in present), None)
            if base is not None:
                out[quantity] = _histogram(by_name, base)
            continue
        series = next((n for n in candidates if n in present), None)
        if series is None:
            continue
        values = [value for _, value in by_name[series]]
        out[quantity] = float(np.mean(values) if spec.combine == "mean" else np.sum(values))
    return out


def _histogram(by_name: dict[str, list[tuple[dict[str, str], float]]], base: str) -> Histogram:
    buckets: dict[float, float] = {}
    for labels, value in by_name.get(f"{base}_bucket", []):
        bound = float(labels.get("le", "nan"))
        if not math.isnan(bound):
            buckets[bound] = buckets.get(bound, 0.0) + value
    bounds = tuple(sorted(buckets))
    total = sum(v for _, v in by_name.get(f"{base}_sum", []))
    count = sum(v for _, v in by_name.get(f"{base}_count", []))
    return Histogram(bounds, tuple(buckets[b] for b in bounds), total, count)


class ServerScrape:
    """Scrapes one server's /metrics as a monitor reader; keeps the series it saw."""

    def __init__(self, url: str, timeout_s: float = 2.0, fetch: Fetch = http_get) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.fetch = fetch
        self.server: str | None = None
        self.num_scrapes = 0
        self.failures: list[str] = []
        self._rows: list[tuple[int, str, str, float]] = []  # time_ns, name, labels, value
        self._last: dict[tuple[str, str], float] = {}
        self._first_counters: dict[str, float] = {}

    def read(self) -> dict[str, float]:
        start = now_ns()
        began = time.perf_counter()
        try:
            samples = parse_page(self.fetch(self.url, self.timeout_s))
        except Exception as exc:
            if not self.num_scrapes:  # nothing there: the monitor notes it and stops asking
                raise
            attempt = self.num_scrapes + len(self.failures) + 1
            self.failures.append(f"scrape {attempt}: {type(exc).__name__}: {exc}")
            return {}
        took = time.perf_counter() - began
        if self.server is None:
            self.server = detect_server(name for name, _, _ in samples)
            if self.server is None:
                raise ValueError(f"{self.url}: no series of a known server ({DETECT_ORDER})")
        self.num_scrapes += 1
        self._rows.append((start, SCRAPE_SERIES, "{}", took))
        for name, labels, value in samples:
            if self._last.get((name, labels)) != value:
                self._last[(name, labels)] = value
                self._rows.append((start, name, labels, value))
        row: dict[str, float] = {}
        for quantity, value in quantities(samples, self.server).items():
            kind = QUANTITIES[quantity].kind
            if kind == "gauge":
                row[f"server_{quantity}"] = value
            elif kind == "counter":
                first = self._first_counters.setdefault(quantity, value)
                row[f"server_{quantity}"] = value - first
        return row

    def series(self, t0_ns: int) -> pd.DataFrame:
        """The kept series: `time_s` on the run's clock, change-encoded (docs/interop.md)."""
        frame = pd.DataFrame(self._rows, columns=["time_ns", "name", "labels", "value"])
        frame.insert(0, "time_s", (frame.pop("time_ns") - t0_ns) / 1e9)
        return frame[SERVER_SERIES_COLUMNS]

    def info(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "server": self.server,
            "num_scrapes": self.num_scrapes,
            "failed_scrapes": len(self.failures),
            "first_failures": self.failures[:5],
        }


class DcgmScrape:
    """One GPU's utilization, memory, power and energy from an NVIDIA dcgm-exporter, for the
    monitor's GPU columns (a server's GPU on another machine)."""

    def __init__(
        self, url: str, gpu: int = 0, timeout_s: float = 2.0, fetch: Fetch = http_get
    ) -> None:
        self.url, self.gpu, self.timeout_s, self.fetch = url, gpu, timeout_s, fetch

    def read(self) -> dict[str, float]:
        row: dict[str, float] = {}
        for name, labels, value in parse_page(self.fetch(self.url, self.timeout_s)):
            if json.loads(labels).get("gpu") != str(self.gpu):
                continue
            for column, (series, scale) in DCGM_COLUMNS.items():
                # the parser names a counter's sample `_total` whether the page did or not
                if name in (series, f"{series}_total"):
                    row[column] = value * scale
        if not row:
            raise ValueError(f"{self.url}: no DCGM_FI_DEV_* series for gpu {self.gpu}")
        return row


# ---- figures ------------------------------------------------------------------------------


def state_at(series: pd.DataFrame, time_s: float) -> list[Sample]:
    """Every series' value at `time_s`: its last row at or before it."""
    upto = series[series["time_s"] <= time_s]
    last = upto.groupby(["name", "labels"], sort=False).tail(1)
    return list(zip(last["name"], last["labels"], last["value"].astype(float), strict=True))


def server_figures(
    series: pd.DataFrame,
    samples: pd.DataFrame,
    server: str,
    span: tuple[float, float],
) -> dict[str, Any]:
    """The run's server-side figures over `span` (run time, s): see docs/interop.md."""
    scrapes = series.loc[series["name"] == SCRAPE_SERIES, "time_s"].to_numpy(float)
    if len(scrapes) < 2:
        return {}
    start, end = span
    before = scrapes[scrapes <= start]
    after = scrapes[scrapes >= end]
    first = float(before.max()) if len(before) else float(scrapes.min())
    last = float(after.min()) if len(after) else float(scrapes.max())
    if last <= first:
        return {}
    then = quantities(state_at(series, first), server)
    now = quantities(state_at(series, last), server)
    out: dict[str, Any] = {}
    for quantity in ("ttft", "itl", "tpot", "e2e", "queue_time"):
        if quantity not in now or quantity not in then:
            continue
        observed = now[quantity].minus(then[quantity])
        if observed is None or observed.count <= 0:
            continue
        out[f"server_{quantity}_mean_s"] = observed.mean()
        for p in PERCENTILES:
            out[f"server_{quantity}_p{p}_s"] = observed.quantile(p / 100)
    for quantity in (
        "prompt_tokens",
        "generation_tokens",
        "num_preemptions",
        "requests_finished",
    ):
        if quantity in now and quantity in then and now[quantity] >= then[quantity]:
            out[f"server_{quantity}"] = now[quantity] - then[quantity]
    queries = now.get("prefix_cache_queries", 0.0) - then.get("prefix_cache_queries", 0.0)
    if queries > 0:
        hits = now.get("prefix_cache_hits", 0.0) - then.get("prefix_cache_hits", 0.0)
        out["server_prefix_cache_hit_rate"] = hits / queries
    inside = samples[(samples["time_s"] >= first) & (samples["time_s"] <= last)]
    for quantity in ("num_requests_running", "num_requests_waiting", "kv_cache_usage"):
        column = f"server_{quantity}"
        if column not in inside or inside[column].isna().all():
            continue
        out[f"{column}_peak"] = float(inside[column].max())
        if quantity != "kv_cache_usage":
            out[f"{column}_mean"] = _step_mean(inside[["time_s", column]].dropna(), first, last)
    return {k: v for k, v in out.items() if v is not None}


def _step_mean(points: pd.DataFrame, start: float, end: float) -> float | None:
    """Time-weighted mean of a gauge read at `points`, each value held until the next read."""
    if len(points) < 2 or end <= start:
        return None
    t = points.iloc[:, 0].to_numpy(float)
    v = points.iloc[:, 1].to_numpy(float)
    held = np.diff(np.append(t, end))
    return float(np.sum(v * held) / np.sum(held)) if np.sum(held) > 0 else None
