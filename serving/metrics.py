"""What /metrics exports: engine state as the engine thread last published it (read at scrape
time, never from the engine itself, which another thread steps), and token counters and
latency histograms updated as requests stream, and speculative decoding's counters as the
engine thread reports steps. Names follow vLLM's, with the `inferlab_` prefix (docs/serving.md
has the crosswalk)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engines.base import StepRecord
from engines.builtin.backend import BuiltinBackend
from engines.builtin.step_stats import EngineGauges
from serving.prometheus import CollectorRegistry, Naming, ScrapeCollector, Scraped, Series, render

FINISH_REASONS = ("stop", "length")  # aborts: inferlab_requests_aborted_total
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, backend: BuiltinBackend, in_flight: Callable[[], int]) -> None:
        self.backend = backend
        self.in_flight = in_flight
        r = self.registry = CollectorRegistry()

        def counter(
            name: str,
            help_text: str,
            labels: Sequence[str] = (),
            values: Sequence[Sequence[str]] = (),
        ) -> Series:
            return Series(r, "counter", help_text, [Naming(name)], labels, values)

        def histogram(name: str, help_text: str, buckets: Sequence[float]) -> Series:
            return Series(r, "histogram", help_text, [Naming(name, buckets=buckets)])

        def gauge(key: str, name: str, help_text: str) -> Scraped:
            return Scraped(key, "gauge", help_text, [Naming(name)])

        r.register(
            ScrapeCollector(
                [
                    gauge(
                        "running",
                        "inferlab_num_requests_running",
                        "Sequences the engine is running (holding KV memory).",
                    ),
                    gauge(
                        "waiting",
                        "inferlab_num_requests_waiting",
                        "Sequences queued in the engine, waiting for a slot or KV memory.",
                    ),
                    gauge(
                        "admitted",
                        "inferlab_num_requests_admitted",
                        "Sequences the server has admitted and not yet finished (the bound "
                        "that max_queue_len sets).",
                    ),
                    gauge(
                        "kv_usage",
                        "inferlab_kv_cache_usage_ratio",
                        "KV cache memory reserved for live sequences over the pool's "
                        "capacity (0 to 1).",
                    ),
                    gauge(
                        "kv_reserved",
                        "inferlab_kv_cache_reserved_bytes",
                        "KV cache bytes reserved for live sequences.",
                    ),
                    gauge(
                        "kv_capacity",
                        "inferlab_kv_cache_capacity_bytes",
                        "KV cache pool size in bytes.",
                    ),
                ],
                self._scrape,
            )
        )
        self.prompt_tokens = counter(
            "inferlab_prompt_tokens_total", "Prompt tokens of requests that were prefilled."
        )
        self.generation_tokens = counter(
            "inferlab_generation_tokens_total", "Output tokens generated."
        )
        self.request_success = counter(
            "inferlab_request_success_total",
            "Sequences (choices) finished, by finish reason.",
            ["finished_reason"],
            [(reason,) for reason in FINISH_REASONS],
        )
        self.requests_rejected = counter(
            "inferlab_requests_rejected_total",
            "HTTP requests refused with 503 because the admission queue was full.",
        )
        self.requests_invalid = counter(
            "inferlab_requests_invalid_total", "HTTP requests refused with a 400 error."
        )
        self.requests_aborted = counter(
            "inferlab_requests_aborted_total",
            "Requests aborted before they finished (the client went away).",
        )
        self.ttft = histogram(
            "inferlab_time_to_first_token_seconds",
            "From the request's arrival at the server to its first output token.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inferlab_inter_token_latency_seconds",
            "Between consecutive output tokens of one sequence.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "inferlab_e2e_request_latency_seconds",
            "From the request's arrival at the server to its last sequence finishing.",
            E2E_BUCKETS,
        )

        spec_positions = _spec_positions(backend)
        if spec_positions:
            self.spec_drafts = counter(
                "inferlab_spec_decode_num_drafts_total",
                "Speculative decoding: verifying rows (a sequence's drafts checked in a step).",
            )
            self.spec_draft_tokens = counter(
                "inferlab_spec_decode_num_draft_tokens_total", "Drafts proposed."
            )
            self.spec_accepted_tokens = counter(
                "inferlab_spec_decode_num_accepted_tokens_total", "Drafts kept."
            )
            positions = [(str(i),) for i in range(spec_positions)]
            self.spec_drafts_per_pos = counter(
                "inferlab_spec_decode_num_draft_tokens_per_pos_total",
                "Drafts proposed at each position (0: the first draft).",
                ["position"],
                positions,
            )
            self.spec_accepted_per_pos = counter(
                "inferlab_spec_decode_num_accepted_tokens_per_pos_total",
                "Drafts kept at each position (0: the first draft).",
                ["position"],
                positions,
            )
            backend.step_observers.append(self.observe_step)

    def observe_step(self, record: StepRecord) -> None:
        """Speculative decoding's counters, from each step the engine thread reports."""
        if not record.spec_draft_tokens:
            return
        self.spec_drafts.inc(record.spec_drafts_by_position[0])
        self.spec_draft_tokens.inc(record.spec_draft_tokens)
        self.spec_accepted_tokens.inc(record.spec_accepted_tokens)
        for counter, counts in (
            (self.spec_drafts_per_pos, record.spec_drafts_by_position),
            (self.spec_accepted_per_pos, record.spec_accepted_by_position),
        ):
            for i, count in enumerate(counts):
                counter.inc(count, position=str(i))

    def _stats(self) -> EngineGauges:
        thread = self.backend.engine_thread  # None once the backend is closed
        return EngineGauges() if thread is None else thread.stats

    def _scrape(self) -> dict[str, float]:
        """The values read at scrape time, from one snapshot of the engine."""
        stats = self._stats()
        return {
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "admitted": self.in_flight(),
            "kv_usage": _kv_usage(stats),
            "kv_reserved": stats.kv_bytes_reserved,
            "kv_capacity": stats.kv_pool_bytes,
        }

    def render(self) -> bytes:
        return render(self.registry)


def _spec_positions(backend: BuiltinBackend) -> int:
    """k, the draft positions to count; 0 without speculative decoding."""
    spec = backend.config.speculative()
    return spec.num_speculative_tokens if spec is not None else 0


def _kv_usage(stats: EngineGauges) -> float:
    capacity = stats.kv_pool_bytes
    return stats.kv_bytes_reserved / capacity if capacity else 0.0
