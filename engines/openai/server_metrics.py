"""A server's own speculative-decoding counters, read from its Prometheus `/metrics`.

Read once before the measured requests and once after; the difference is the run's. Series
names are data: vLLM's (`vllm:spec_decode_*`) and `inferlab serve`'s (the same names with the
`inferlab_` prefix). Counters are summed over every label set but `position` (vLLM labels each
engine and model). A page with both (`inferlab serve` exports its counters under both names)
is read under one of them, `inferlab_` first (it also counts drafts per position), never summed
across the two. Parsed with prometheus_client's reference parser.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

# prefix -> whose names, in the order a page with both is read; each counter is
# <prefix>spec_decode_<name>_total
SERVER_PREFIXES = {"inferlab_": "inferlab", "vllm:": "vllm"}
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POSITION = ("num_draft_tokens_per_pos", "num_accepted_tokens_per_pos")
# positions read from a `position` label; a larger one (a broken or hostile server) is ignored
MAX_POSITIONS = 64


@dataclass(frozen=True)
class SpecDecodeCounters:
    server: str  # whose names matched: vllm | inferlab
    num_drafts: float  # verifying rows: a sequence's drafts checked in one step
    num_draft_tokens: float
    num_accepted_tokens: float
    # position 0, 1, ... (vLLM has no drafts-per-position series: empty for it)
    num_draft_tokens_per_pos: tuple[float, ...]
    num_accepted_tokens_per_pos: tuple[float, ...]

    def since(self, before: SpecDecodeCounters) -> SpecDecodeCounters | None:
        """The counts between `before` (a read at the start) and this one; None where any
        counter went down (the server restarted, or another process behind the URL)."""

        def minus(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(x - (b[i] if i < len(b) else 0.0) for i, x in enumerate(a))

        run = SpecDecodeCounters(
            self.server,
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            minus(self.num_draft_tokens_per_pos, before.num_draft_tokens_per_pos),
            minus(self.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos),
        )
        counts = [
            *(getattr(run, name) for name in COUNTERS),
            *run.num_draft_tokens_per_pos,
            *run.num_accepted_tokens_per_pos,
        ]
        return None if self.server != before.server or min(counts) < 0 else run

    def to_dict(self) -> dict[str, Any]:
        return {
            "server": self.server,
            **{name: getattr(self, name) for name in COUNTERS},
            **{name: list(getattr(self, name)) for name in PER_POSITION},
        }


#: The most a /metrics page may hold: a vLLM page is ~100 kB; one far larger is not a
#: metrics page.
MAX_PAGE_BYTES = 32 * 1024 * 1024


def get_page(
    client: httpx.Client, url: str, timeout_s: float, max_bytes: int = MAX_PAGE_BYTES
) -> str:
    """GET a /metrics page, `timeout_s` bounding the whole GET and not only each read: a page
    that trickles in (a byte a second never trips httpx's read timeout) would otherwise hold
    the caller, and the run with it, for as long as the server likes. Raises httpx.HTTPError
    (a refusal, an error status, a timeout) or ValueError (a page over `max_bytes`)."""
    deadline = time.monotonic() + timeout_s
    with client.stream("GET", url, timeout=timeout_s) as response:
        response.raise_for_status()
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise ValueError(f"{url}: a page over {max_bytes} bytes; not read further")
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"{url}: the page took over {timeout_s:g} s; not read")
        return body.decode(response.encoding or "utf-8", errors="replace")


def server_root(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port: where a server has /metrics and vLLM's
    profiler endpoints, not under /v1."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def metrics_url(base_url: str) -> str:
    """Where an OpenAI-compatible server serves /metrics."""
    return f"{server_root(base_url)}/metrics"


def parse_spec_decode(text: str) -> SpecDecodeCounters | None:
    """The speculative-decoding counters in a /metrics page; None where it has none."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_pos: dict[str, dict[str, dict[int, float]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(float))
    )
    for family in text_string_to_metric_families(text):
        for prefix, who in SERVER_PREFIXES.items():
            stem = f"{prefix}spec_decode_"
            if not family.name.startswith(stem):
                continue
            name = family.name[len(stem) :]
            for sample in family.samples:
                if sample.name != f"{family.name}_total":  # _created and the like
                    continue
                if name in PER_POSITION and "position" in sample.labels:
                    position = sample.labels["position"]
                    if position.isdigit() and int(position) < MAX_POSITIONS:
                        per_pos[who][name][int(position)] += sample.value
                elif name in COUNTERS:
                    totals[who][name] += sample.value
    server = next(
        (who for who in SERVER_PREFIXES.values() if "num_draft_tokens" in totals[who]), None
    )
    if server is None:
        return None

    def positions(name: str) -> tuple[float, ...]:
        counts = per_pos[server].get(name, {})
        return tuple(counts.get(i, 0.0) for i in range(max(counts, default=-1) + 1))

    return SpecDecodeCounters(
        server,
        totals[server]["num_drafts"],
        totals[server]["num_draft_tokens"],
        totals[server]["num_accepted_tokens"],
        positions("num_draft_tokens_per_pos"),
        positions("num_accepted_tokens_per_pos"),
    )
