"""What /metrics exports, built from the table in serving/metric_names.py under the naming sets
the server was started with (`metrics_names`: `inferlab_*`, vLLM's `vllm:*`, or both), and
where each value comes from:

- engine state (running, waiting, KV use, preemptions, prefix-cache lookups) from the snapshot
  the engine thread publishes after every step, read at scrape time, never from the engine
  itself, which another thread steps;
- token counters and per-request histograms, updated as requests stream
  (serving/request_metrics.py);
- speculative decoding's counters from each step the engine thread reports.

Every name of one quantity is updated by the same call, so its values are equal whatever the
naming; only histogram bounds differ (inferlab_'s are finer at the low end; vLLM's are
vLLM's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from engines.base import StepRecord
from engines.builtin.backend import BuiltinBackend
from engines.builtin.step_stats import EngineGauges
from serving.metric_names import (
    ENGINE_INDEX,
    METRICS,
    NAME_SETS,
    MetricSpec,
    resolve,
)
from serving.prometheus import (
    CollectorRegistry,
    Naming,
    ScrapeCollector,
    Scraped,
    Series,
    render,
)

FINISH_REASONS = ("stop", "length")  # aborts: inferlab_requests_aborted_total


class ServerMetrics:
    """The server's metrics. Each attribute below is one quantity of the table, under every
    name the server exports it with (none: it counts nothing)."""

    prompt_tokens: Series
    generation_tokens: Series
    request_success: Series
    requests_rejected: Series
    requests_invalid: Series
    requests_aborted: Series
    ttft: Series
    itl: Series
    e2e: Series
    queue_time: Series
    prefill_time: Series
    decode_time: Series
    inference_time: Series
    request_prompt_tokens: Series
    request_generation_tokens: Series
    request_max_num_generation_tokens: Series
    request_params_n: Series
    request_params_max_tokens: Series
    spec_drafts: Series
    spec_draft_tokens: Series
    spec_accepted_tokens: Series
    spec_accepted_per_pos: Series
    spec_drafts_per_pos: Series

    def __init__(
        self,
        backend: BuiltinBackend,
        in_flight: Callable[[], int],
        model_name: str,
        name_sets: Sequence[str] = NAME_SETS,
    ) -> None:
        assert backend.engine is not None, "load() first"
        self.backend = backend
        self.in_flight = in_flight
        self.model_name = model_name
        self.name_sets = tuple(name_sets)
        self.registry = CollectorRegistry()
        engine = backend.engine
        self.max_model_len = engine.limits.max_model_len
        spec_positions = _spec_positions(backend)
        features = {
            "spec_decode": spec_positions > 0,
            "prefix_caching": bool(engine.config.enable_prefix_caching),
            "kv_tiers": engine.kv_tiers is not None,
        }
        scraped: list[Scraped] = []
        for spec in METRICS:
            exported = spec.needs is None or features[spec.needs]
            namings = self.namings(spec) if exported else []
            if spec.scraped:
                kind: Literal["counter", "gauge"] = "counter" if spec.kind == "counter" else "gauge"
                if namings:
                    scraped.append(Scraped(spec.key, kind, spec.help, namings))
                continue
            assert spec.key in type(self).__annotations__, f"{spec.key}: no attribute to update it"
            setattr(self, spec.key, self._series(spec, namings, spec_positions))
        self.registry.register(ScrapeCollector(scraped, self._scrape))
        if features["spec_decode"]:
            backend.step_observers.append(self.observe_step)

    def namings(self, spec: MetricSpec) -> list[Naming]:
        """The names `spec` is exported under, in this server's naming sets."""
        namings = []
        if "inferlab" in self.name_sets:
            namings.append(Naming(spec.inferlab, {}, resolve(spec.buckets, self.max_model_len)))
        if "vllm" in self.name_sets:
            labels = {"model_name": self.model_name, "engine": ENGINE_INDEX}
            buckets = resolve(spec.vllm_buckets, self.max_model_len)
            namings += [Naming(name, labels, buckets) for name in spec.vllm]
        return namings

    def _series(self, spec: MetricSpec, namings: list[Naming], spec_positions: int) -> Series:
        # label values known in advance are exported at 0 before the first event, as vLLM does
        values: Iterable[Sequence[str]] = ()
        if spec.labels == ("finished_reason",):
            values = [(reason,) for reason in FINISH_REASONS]
        elif spec.labels == ("position",):
            values = [(str(i),) for i in range(spec_positions)]
        kind: Literal["counter", "histogram"] = (
            "histogram" if spec.kind == "histogram" else "counter"
        )
        return Series(self.registry, kind, spec.help, namings, spec.labels, values)

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
        """The values read at scrape time (the `scraped` rows of the table), from one snapshot
        of the engine."""
        stats = self._stats()
        capacity = stats.kv_pool_bytes
        return {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "num_requests_admitted": self.in_flight(),
            "kv_cache_usage": stats.kv_bytes_reserved / capacity if capacity else 0.0,
            "kv_cache_reserved_bytes": stats.kv_bytes_reserved,
            "kv_cache_capacity_bytes": capacity,
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "kv_host_tier_hits": stats.kv_tier_hits[0],
            "kv_disk_tier_hits": stats.kv_tier_hits[1],
            "kv_host_tier_blocks": stats.kv_tier_blocks[0],
            "kv_disk_tier_blocks": stats.kv_tier_blocks[1],
        }

    def render(self) -> bytes:
        return render(self.registry)


def _spec_positions(backend: BuiltinBackend) -> int:
    """k, the draft positions to count; 0 without speculative decoding."""
    spec = backend.config.speculative()
    return spec.num_speculative_tokens if spec is not None else 0
