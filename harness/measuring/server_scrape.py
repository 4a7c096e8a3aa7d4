"""A server's own view during a run: its Prometheus `/metrics` scraped by the monitor.

`ServerScrape.read` is a monitor reader (harness/measuring/monitors.py) run every
`run.monitor.server_interval_s`, at the measured run's start and at its end. Each scrape:
- fetches and keeps the page; after the run, `parse` reads them all;
- every series goes to `server_metrics.parquet`, change-encoded (a row when a value differs
  from the previous scrape's; one `SCRAPE_SERIES` row per scrape with the GET's duration), so
  any series can be read back at any scrape;
- the canonical gauges and counters (server_names.py) become `server_*` columns of
  `samples.parquet`, counters since the first scrape.

`server_figures` turns the kept series into the run's figures over a span: the histograms' and
counters' differences between the scrapes that bracket it (so warm-up requests, finished before
the scrape at the measured start, are left out), and the gauges' time-weighted means and peaks.
`DcgmScrape` reads a GPU's counters from an NVIDIA dcgm-exporter into the monitor's GPU columns.
Pages are parsed with prometheus_client's reference parser. docs/interop.md.
"""

from __future__ import annotations

import functools
import json
import math
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from engines.base import now_ns
from engines.openai.server_metrics import MAX_PAGE_BYTES, get_page
from harness.measuring.server_names import (
    DCGM_COLUMNS,
    DETECT_ORDER,
    QUANTITIES,
    SERVER_NAMES,
)

SERVER_COLUMNS = [f"server_{q.name}" for q in QUANTITIES.values() if q.kind in ("gauge", "counter")]
SERVER_SERIES_COLUMNS = ["time_s", "name", "labels", "value"]
# the monitor's private column: which kept page a sample row scraped
SCRAPE_INDEX = "_server_scrape"
# one row per scrape: how long the GET took (s); also marks every scrape's time
SCRAPE_SERIES = "inferlab_scrape_duration_seconds"
# histogram figures: these percentiles, estimated as Prometheus' histogram_quantile does
PERCENTILES = (50, 90, 99)

Sample = tuple[str, str, float]  # name, labels (JSON, sorted keys), value
Fetch = Callable[[str, float], str]


def http_fetcher(max_bytes: int = MAX_PAGE_BYTES) -> Fetch:
    """GET with one kept client: a new httpx client per request costs ~20 ms of CPU (its SSL
    context), which the client process would pay every scrape. `timeout_s` bounds the whole
    GET (a page trickling in does not hold the scrape), and a page over `max_bytes` is an
    error (engines.openai.server_metrics.get_page)."""
    client = httpx.Client()

    def get(url: str, timeout_s: float) -> str:
        return get_page(client, url, timeout_s, max_bytes)

    return get


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
    wanted = _names_read(server)
    by_name: dict[str, list[tuple[str, float]]] = {}
    for name, labels, value in samples:
        if name in wanted:
            by_name.setdefault(name, []).append((labels, value))
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


@functools.cache
def _names_read(server: str) -> frozenset[str]:
    """The sample names `quantities` reads for `server` (histograms: their three series)."""
    names = set()
    for quantity, candidates in SERVER_NAMES[server].items():
        for name in candidates:
            if QUANTITIES[quantity].kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            else:
                names.add(name)
    return frozenset(names)


def _histogram(by_name: dict[str, list[tuple[str, float]]], base: str) -> Histogram:
    buckets: dict[float, float] = {}
    for labels, value in by_name.get(f"{base}_bucket", []):
        try:
            bound = float(json.loads(labels).get("le", "nan"))
        except ValueError:  # not a bound: a broken page's bucket, left out
            continue
        if not math.isnan(bound):
            buckets[bound] = buckets.get(bound, 0.0) + value
    bounds = tuple(sorted(buckets))
    total = sum(v for _, v in by_name.get(f"{base}_sum", []))
    count = sum(v for _, v in by_name.get(f"{base}_count", []))
    return Histogram(bounds, tuple(buckets[b] for b in bounds), total, count)


class ServerScrape:
    """Scrapes one server's /metrics as a monitor reader. During the run a scrape only fetches
    and keeps the page (compressed): parsing a vLLM-sized page takes ~15 ms of pure Python,
    which would hold the GIL the client's event loop needs. `parse` reads them all after."""

    def __init__(self, url: str, timeout_s: float = 2.0, fetch: Fetch | None = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.fetch = fetch or http_fetcher()
        self.server: str | None = None
        self.failures: list[str] = []
        self._pages: list[tuple[int, float, bytes]] = []  # time_ns, GET seconds, zlib text
        self.resets: list[str] = []  # counters that fell between scrapes (a restart), by parse
        self._parsed: tuple[pd.DataFrame, pd.DataFrame] | None = None

    @property
    def num_scrapes(self) -> int:
        return len(self._pages)

    def read(self) -> dict[str, float]:
        start = now_ns()
        began = time.perf_counter()
        try:
            text = self.fetch(self.url, self.timeout_s)
        except Exception as exc:
            if not self._pages:  # nothing there: the monitor notes it and stops asking
                raise
            attempt = len(self._pages) + len(self.failures) + 1
            self.failures.append(f"scrape {attempt}: {type(exc).__name__}: {exc}")
            return {}
        took = time.perf_counter() - began
        if self.server is None:  # once, when the monitor starts: before the warm-up
            self.server = detect_server(name for name, _, _ in parse_page(text))
            if self.server is None:
                raise ValueError(f"{self.url}: no series of a known server {DETECT_ORDER}")
        self._pages.append((start, took, zlib.compress(text.encode(), 1)))
        self._parsed = None
        # the monitor's row points at this page; `columns` fills it in after the run
        return {SCRAPE_INDEX: float(len(self._pages) - 1)}

    def parse(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Every page parsed: the `server_*` columns per scrape (counters since the first),
        and the series change-encoded (time_ns, name, labels, value)."""
        if self._parsed is not None:
            return self._parsed
        assert self.server is not None or not self._pages
        columns: list[dict[str, float]] = []
        rows: list[tuple[int, str, str, float]] = []
        last: dict[tuple[str, str], float] = {}
        first_counters: dict[str, float] = {}
        # a counter that falls started again from 0 (a restarted server): what it had counted
        # is carried, as Prometheus' increase() does, so the columns never count backwards
        previous: dict[str, float] = {}
        carried: dict[str, float] = {}
        self.resets = []
        for number, (time_ns, took, packed) in enumerate(self._pages):
            try:
                samples = parse_page(zlib.decompress(packed).decode())
            except Exception as exc:  # one torn page (any parser error): its row stays empty
                self.failures.append(f"a page not parsed: {type(exc).__name__}: {exc}")
                columns.append({})
                continue
            rows.append((time_ns, SCRAPE_SERIES, "{}", took))
            for name, labels, value in samples:
                if last.get((name, labels)) != value:
                    last[(name, labels)] = value
                    rows.append((time_ns, name, labels, value))
            row: dict[str, float] = {}
            for quantity, value in quantities(samples, self.server or "").items():
                kind = QUANTITIES[quantity].kind
                if kind == "gauge":
                    row[f"server_{quantity}"] = value
                elif kind == "counter":
                    if value < previous.get(quantity, value):
                        carried[quantity] = carried.get(quantity, 0.0) + previous[quantity]
                        self.resets.append(
                            f"scrape {number + 1}: {quantity} fell from {previous[quantity]:g} "
                            f"to {value:g} (the server restarted?)"
                        )
                    previous[quantity] = value
                    total = value + carried.get(quantity, 0.0)
                    row[f"server_{quantity}"] = total - first_counters.setdefault(quantity, total)
            columns.append(row)
        self._parsed = (
            pd.DataFrame(columns, index=range(len(columns)), columns=SERVER_COLUMNS, dtype=float),
            pd.DataFrame(rows, columns=["time_ns", "name", "labels", "value"]),
        )
        return self._parsed

    def series(self, t0_ns: int) -> pd.DataFrame:
        """The kept series: `time_s` on the run's clock, change-encoded (docs/interop.md)."""
        frame = self.parse()[1].copy()
        frame.insert(0, "time_s", (frame.pop("time_ns") - t0_ns) / 1e9)
        return frame[SERVER_SERIES_COLUMNS]

    def info(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "server": self.server,
            "num_scrapes": self.num_scrapes,
            "failed_scrapes": len(self.failures),
            "first_failures": self.failures[:5],
            **({"counter_resets": self.resets[:5]} if self.resets else {}),
        }


class DcgmScrape:
    """One GPU's utilization, memory, power and energy from an NVIDIA dcgm-exporter, for the
    monitor's GPU columns (a server's GPU on another machine)."""

    def __init__(
        self, url: str, gpu: int = 0, timeout_s: float = 2.0, fetch: Fetch | None = None
    ) -> None:
        self.url, self.gpu, self.timeout_s = url, gpu, timeout_s
        self.fetch = fetch or http_fetcher()

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
    if fell_between(series, server, first, last):
        # a restarted server's counters and histograms started again: their differences
        # between the bracketing scrapes count neither the run nor anything else
        now, then = _gauges(now), _gauges(then)
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


def fell_between(series: pd.DataFrame, server: str, start: float, end: float) -> bool:
    """Whether a counter or a histogram's count or bucket of `server` fell from one scrape to
    the next in (start, end]: the server restarted (or a label set went away)."""
    names: set[str] = set()
    for quantity, candidates in SERVER_NAMES[server].items():
        kind = QUANTITIES[quantity].kind
        if kind == "counter":
            names.update(candidates)
        elif kind == "histogram":
            names.update(n + suffix for n in candidates for suffix in ("_count", "_bucket"))
    rows = series[series["name"].isin(names) & (series["time_s"] <= end)]
    if rows.empty:
        return False
    rows = rows.sort_values("time_s", kind="stable")
    change = rows.groupby(["name", "labels"], sort=False)["value"].diff()
    return bool(((change < 0) & (rows["time_s"] > start)).any())


def _gauges(values: dict[str, Any]) -> dict[str, Any]:
    return {q: v for q, v in values.items() if QUANTITIES[q].kind == "gauge"}


def _step_mean(points: pd.DataFrame, start: float, end: float) -> float | None:
    """Time-weighted mean of a gauge read at `points`, each value held until the next read."""
    if len(points) < 2 or end <= start:
        return None
    t = points.iloc[:, 0].to_numpy(float)
    v = points.iloc[:, 1].to_numpy(float)
    held = np.diff(np.append(t, end))
    return float(np.sum(v * held) / np.sum(held)) if np.sum(held) > 0 else None
