"""What the HTTP client itself did during a run: its own overhead, and how tokens were counted.

Client overhead is the wall time (time.perf_counter_ns, whatever clock timestamps the events)
from a network read's arrival to its events being handed to the harness: SSE parsing, JSON
decoding, counting tokens, building events. It is the part of every TTFT and ITL that the
measuring side adds. Requests that are no part of the measured run are left out: the warm-up
(ids starting with "warmup-") and run.accuracy's, sent after it ("accuracy-").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

WARMUP_PREFIX = "warmup-"
ACCURACY_PREFIX = "accuracy-"  # harness/measuring/accuracy.py's request ids


@dataclass
class RequestTally:
    """One request's client-side facts, folded into `ClientStats` when it ends."""

    request_id: str
    requested_output_tokens: int
    ignore_eos: bool
    build_ns: int = 0
    overhead_ns: list[int] = field(default_factory=list)  # one per network read
    counted_output_tokens: int = 0
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    chunks_by_source: Counter[str] = field(default_factory=Counter)
    count_rule: str | None = None  # how this request's chunks were counted (backend.RULES)
    dropped_fields: tuple[str, ...] = ()


class ClientStats:
    """Running totals; `live` is a dict kept up to date, `snapshot()` adds percentiles."""

    def __init__(self) -> None:
        self.live: dict[str, Any] = {}
        self._overhead: list[int] = []  # every chunk's, for percentiles on demand
        self._overhead_sum = 0
        self._overhead_max = 0
        self._build_sum = 0
        self._totals: Counter[str] = Counter()
        self._sources: Counter[str] = Counter()
        self._rules: Counter[str] = Counter()
        self._dropped: Counter[str] = Counter()
        self._refresh()

    def finish(self, tally: RequestTally, failed: bool, closed: bool = False) -> None:
        """`closed`: the harness closed the stream before its end (a cancelled request), which
        is no failure of the server's."""
        if tally.request_id.startswith((WARMUP_PREFIX, ACCURACY_PREFIX)):
            return
        t = self._totals
        failed = failed and not closed
        t[
            "requests_closed" if closed else "requests_failed" if failed else "requests_finished"
        ] += 1
        self._overhead.extend(tally.overhead_ns)
        self._overhead_sum += sum(tally.overhead_ns)
        self._overhead_max = max(self._overhead_max, *tally.overhead_ns, 0)
        self._build_sum += tally.build_ns
        self._sources.update(tally.chunks_by_source)
        if tally.count_rule is not None:
            self._rules[tally.count_rule] += 1
        self._dropped.update(tally.dropped_fields)
        if not failed and not closed:
            counted = tally.counted_output_tokens
            t["output_tokens_requested"] += tally.requested_output_tokens
            t["output_tokens_counted"] += counted
            if counted < tally.requested_output_tokens:
                t["requests_shorter_than_requested"] += 1
            if tally.ignore_eos and counted != tally.requested_output_tokens:
                t["ignore_eos_requests_not_exact"] += 1
            if tally.usage_output_tokens is not None:
                t["requests_with_usage"] += 1
                t["output_tokens_usage"] += tally.usage_output_tokens
                if tally.usage_output_tokens != counted:
                    t["requests_usage_count_mismatch"] += 1
        self._refresh()

    def merge(self, other: ClientStats) -> None:
        """Add another client's figures to these (`run.num_clients` > 1: each client process
        has its own backend; the run's `engine.client` is all of them together)."""
        self._overhead.extend(other._overhead)
        self._overhead_sum += other._overhead_sum
        self._overhead_max = max(self._overhead_max, other._overhead_max)
        self._build_sum += other._build_sum
        self._totals.update(other._totals)
        self._sources.update(other._sources)
        self._rules.update(other._rules)
        self._dropped.update(other._dropped)
        self._refresh()

    def _refresh(self) -> None:
        chunks = len(self._overhead)
        requests = sum(
            self._totals[k] for k in ("requests_finished", "requests_failed", "requests_closed")
        )
        self.live.update(
            {
                **{
                    k: self._totals.get(k, 0)
                    for k in (
                        "requests_finished",
                        "requests_failed",
                        "requests_closed",
                        "output_tokens_requested",
                        "output_tokens_counted",
                        "output_tokens_usage",
                        "requests_with_usage",
                        "requests_usage_count_mismatch",
                        "requests_shorter_than_requested",
                        "ignore_eos_requests_not_exact",
                    )
                },
                "chunks": chunks,
                "chunks_by_token_source": dict(self._sources),
                "requests_by_count_rule": dict(self._rules),
                "dropped_sampling_fields": dict(self._dropped),
                "client_overhead_s_total": self._overhead_sum / 1e9,
                "client_overhead_per_chunk_mean_us": self._overhead_sum / chunks / 1e3
                if chunks
                else None,
                "client_overhead_per_chunk_max_us": self._overhead_max / 1e3 if chunks else None,
                "request_build_mean_us": self._build_sum / requests / 1e3 if requests else None,
            }
        )

    def snapshot(self) -> dict[str, Any]:
        """`live` plus per-chunk overhead percentiles (computed now, over every chunk)."""
        out = dict(self.live)
        if self._overhead:
            values = np.asarray(self._overhead, dtype=float) / 1e3
            out["client_overhead_per_chunk_p50_us"] = float(np.percentile(values, 50))
            out["client_overhead_per_chunk_p99_us"] = float(np.percentile(values, 99))
        return out
