"""Every metric `inferlab serve` exports, under each of its names: `inferlab_*` and vLLM's
(v1 engine) `vllm:*`, so vLLM's Grafana dashboards work on it. One table; `serving/metrics.py`
builds the Prometheus metrics from it and says where each value comes from.

vLLM's names, types, labels (`model_name`, `engine`, plus `finished_reason` / `position`) and
bucket bounds are those of vllm/v1/metrics/loggers.py and vllm/v1/spec_decode/metrics.py.
A metric of vLLM's that the engine cannot produce (iteration tokens, LoRA, sleep state, KV
block residency, ...) is not exported at all, never as a made-up zero; one with no vLLM
counterpart has only its `inferlab_` name. `vllm:gpu_cache_usage_perc` and
`vllm:time_per_output_token_seconds` are the older names of two of them, kept for dashboards
written before vLLM renamed them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

#: What `serve.metrics_names` may list.
NAME_SETS = ("inferlab", "vllm")
#: Labels every `vllm:` series carries: the served model's name and the engine's index (one
#: engine here, "0"; vLLM numbers its data-parallel engines).
VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"

Buckets = tuple[float, ...] | Callable[[int], tuple[float, ...]]  # a callable: of max_model_len


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's bounds for token counts (`build_1_2_5_buckets`): 1, 2, 5, 10, 20, 50, ... up to
    max_model_len."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(float(mantissa * scale))
        scale *= 10


# ---- vLLM's bounds -----------------------------------------------------------------------------

VLLM_TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
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
    160.0,
    640.0,
    2560.0,
)
VLLM_ITL_BUCKETS: tuple[float, ...] = (
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
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
VLLM_REQUEST_LATENCY_BUCKETS: Buckets = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# ---- inferlab_'s bounds: finer at the low end, where a CPU engine's small models live ----------


def _refined(bounds: tuple[float, ...], finer: tuple[float, ...], top: float) -> tuple[float, ...]:
    """vLLM's `bounds` up to `top`, and the `finer` ones between them."""
    return tuple(sorted({bound for bound in bounds if bound <= top} | set(finer)))


# vLLM's bounds, and more between 0.1 and 1 s, where a CPU engine's TTFTs fall: from vLLM's
# (0.1, 0.25] alone, server_ttft_p50_s of TTFTs near 0.15 s was 0.175 s whatever they were
TTFT_BUCKETS: Buckets = _refined(
    VLLM_TTFT_BUCKETS, (0.0025, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8), top=80.0
)
# vLLM's up to 2.5 s, and below its 10 ms, where a CPU engine's small models' ITLs fall
ITL_BUCKETS: Buckets = _refined(VLLM_ITL_BUCKETS, (0.0005, 0.001, 0.0025, 0.005), top=2.5)
E2E_BUCKETS: Buckets = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)

N_BUCKETS: Buckets = (1.0, 2.0, 5.0, 10.0, 20.0)


@dataclass(frozen=True)
class MetricSpec:
    """One quantity and its names. `key` names the `ServerMetrics` attribute that updates it,
    or, for `scraped` ones, the value the server reads at scrape time."""

    key: str
    kind: Literal["counter", "gauge", "histogram"]
    inferlab: str
    vllm: tuple[str, ...]  # vLLM's current name first, then older ones; () for none
    help: str
    labels: tuple[str, ...] = ()  # its own labels, besides vLLM's model_name and engine
    buckets: Buckets = ()  # histograms: inferlab_'s bounds
    vllm_buckets: Buckets = ()  # and vLLM's
    scraped: bool = False  # read at scrape time (engine snapshot, admission count)
    needs: Literal["spec_decode", "prefix_caching", "kv_tiers"] | None = (
        None  # exported only with it
    )


METRICS: tuple[MetricSpec, ...] = (
    # ---- engine and server state, read at scrape time ------------------------------------------
    MetricSpec(
        "num_requests_running",
        "gauge",
        "inferlab_num_requests_running",
        ("vllm:num_requests_running",),
        "Sequences the engine is running (holding KV memory).",
        scraped=True,
    ),
    MetricSpec(
        "num_requests_waiting",
        "gauge",
        "inferlab_num_requests_waiting",
        ("vllm:num_requests_waiting",),
        "Sequences queued in the engine, waiting for a slot or KV memory.",
        scraped=True,
    ),
    MetricSpec(
        "num_requests_admitted",
        "gauge",
        "inferlab_num_requests_admitted",
        (),
        "Sequences the server has admitted and not yet finished (the bound that "
        "max_queue_len sets).",
        scraped=True,
    ),
    MetricSpec(
        "kv_cache_usage",
        "gauge",
        "inferlab_kv_cache_usage_ratio",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "KV cache memory reserved for live sequences over the pool's capacity (0 to 1; 1 "
        "means 100 percent).",
        scraped=True,
    ),
    MetricSpec(
        "kv_cache_reserved_bytes",
        "gauge",
        "inferlab_kv_cache_reserved_bytes",
        (),
        "KV cache bytes reserved for live sequences.",
        scraped=True,
    ),
    MetricSpec(
        "kv_cache_capacity_bytes",
        "gauge",
        "inferlab_kv_cache_capacity_bytes",
        (),
        "KV cache pool size in bytes.",
        scraped=True,
    ),
    MetricSpec(
        "num_preemptions",
        "counter",
        "inferlab_num_preemptions_total",
        ("vllm:num_preemptions_total",),
        "Recompute preemptions: a running sequence lost its KV memory and went back to the queue.",
        scraped=True,
    ),
    MetricSpec(
        "prefix_cache_queries",
        "counter",
        "inferlab_prefix_cache_queries_total",
        ("vllm:prefix_cache_queries_total",),
        "Prefix cache queries, in tokens: each admission's tokens looked up in the cache.",
        scraped=True,
        needs="prefix_caching",
    ),
    MetricSpec(
        "prefix_cache_hits",
        "counter",
        "inferlab_prefix_cache_hits_total",
        ("vllm:prefix_cache_hits_total",),
        "Prefix cache hits, in tokens: of the queried tokens, those found cached.",
        scraped=True,
        needs="prefix_caching",
    ),
    MetricSpec(
        "kv_host_tier_hits",
        "counter",
        "inferlab_kv_host_tier_hits_total",
        (),
        "KV tiers: prompt tokens loaded back from the host-memory tier instead of recomputed.",
        scraped=True,
        needs="kv_tiers",
    ),
    MetricSpec(
        "kv_host_tier_blocks",
        "gauge",
        "inferlab_kv_host_tier_blocks",
        (),
        "KV tiers: blocks the host-memory tier holds.",
        scraped=True,
        needs="kv_tiers",
    ),
    MetricSpec(
        "kv_disk_tier_hits",
        "counter",
        "inferlab_kv_disk_tier_hits_total",
        (),
        "KV tiers: prompt tokens loaded back from the disk tier instead of recomputed.",
        scraped=True,
        needs="kv_tiers",
    ),
    MetricSpec(
        "kv_disk_tier_blocks",
        "gauge",
        "inferlab_kv_disk_tier_blocks",
        (),
        "KV tiers: blocks the disk tier holds.",
        scraped=True,
        needs="kv_tiers",
    ),
    # ---- counted as requests stream ------------------------------------------------------------
    MetricSpec(
        "prompt_tokens",
        "counter",
        "inferlab_prompt_tokens_total",
        ("vllm:prompt_tokens_total",),
        "Prompt tokens of requests that were prefilled.",
    ),
    MetricSpec(
        "generation_tokens",
        "counter",
        "inferlab_generation_tokens_total",
        ("vllm:generation_tokens_total",),
        "Output tokens generated.",
    ),
    MetricSpec(
        "request_success",
        "counter",
        "inferlab_request_success_total",
        ("vllm:request_success_total",),
        "Sequences (prompt x choice, as vLLM's child requests) finished, by finish reason.",
        labels=("finished_reason",),
    ),
    MetricSpec(
        "requests_rejected",
        "counter",
        "inferlab_requests_rejected_total",
        (),
        "HTTP requests refused with 503 because the admission queue was full.",
    ),
    MetricSpec(
        "requests_invalid",
        "counter",
        "inferlab_requests_invalid_total",
        (),
        "HTTP requests refused with a 400 error.",
    ),
    MetricSpec(
        "requests_aborted",
        "counter",
        "inferlab_requests_aborted_total",
        (),
        "Requests aborted before they finished (the client went away).",
    ),
    # ---- latencies -----------------------------------------------------------------------------
    MetricSpec(
        "ttft",
        "histogram",
        "inferlab_time_to_first_token_seconds",
        ("vllm:time_to_first_token_seconds",),
        "Per sequence: from the request's arrival at the server to its first output token.",
        buckets=TTFT_BUCKETS,
        vllm_buckets=VLLM_TTFT_BUCKETS,
    ),
    MetricSpec(
        "itl",
        "histogram",
        "inferlab_inter_token_latency_seconds",
        ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "Between consecutive outputs of one sequence (a step's tokens arrive together).",
        buckets=ITL_BUCKETS,
        vllm_buckets=VLLM_ITL_BUCKETS,
    ),
    MetricSpec(
        "e2e",
        "histogram",
        "inferlab_e2e_request_latency_seconds",
        ("vllm:e2e_request_latency_seconds",),
        "Per finished sequence: from the request's arrival at the server to its finish.",
        buckets=E2E_BUCKETS,
        vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "queue_time",
        "histogram",
        "inferlab_request_queue_time_seconds",
        ("vllm:request_queue_time_seconds",),
        "Per finished sequence: its prompt's time in the engine's queue (taken -> first step).",
        buckets=E2E_BUCKETS,
        vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "prefill_time",
        "histogram",
        "inferlab_request_prefill_time_seconds",
        ("vllm:request_prefill_time_seconds",),
        "Per finished sequence: from its prompt's first step to its first output token.",
        buckets=E2E_BUCKETS,
        vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "decode_time",
        "histogram",
        "inferlab_request_decode_time_seconds",
        ("vllm:request_decode_time_seconds",),
        "Per finished sequence: from its first output token to its last one.",
        buckets=E2E_BUCKETS,
        vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "inference_time",
        "histogram",
        "inferlab_request_inference_time_seconds",
        ("vllm:request_inference_time_seconds",),
        "Per finished sequence: from its prompt's first step to its last token (prefill + decode).",
        buckets=E2E_BUCKETS,
        vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS,
    ),
    # ---- sizes ---------------------------------------------------------------------------------
    MetricSpec(
        "request_prompt_tokens",
        "histogram",
        "inferlab_request_prompt_tokens",
        ("vllm:request_prompt_tokens",),
        "Prompt tokens of each finished sequence's prompt.",
        buckets=token_buckets,
        vllm_buckets=token_buckets,
    ),
    MetricSpec(
        "request_generation_tokens",
        "histogram",
        "inferlab_request_generation_tokens",
        ("vllm:request_generation_tokens",),
        "Output tokens of each finished sequence.",
        buckets=token_buckets,
        vllm_buckets=token_buckets,
    ),
    MetricSpec(
        "request_max_num_generation_tokens",
        "histogram",
        "inferlab_request_max_num_generation_tokens",
        ("vllm:request_max_num_generation_tokens",),
        "The most output tokens among a finished prompt's n choices.",
        buckets=token_buckets,
        vllm_buckets=token_buckets,
    ),
    MetricSpec(
        "request_params_n",
        "histogram",
        "inferlab_request_params_n",
        ("vllm:request_params_n",),
        "The n parameter of each finished prompt.",
        buckets=N_BUCKETS,
        vllm_buckets=N_BUCKETS,
    ),
    MetricSpec(
        "request_params_max_tokens",
        "histogram",
        "inferlab_request_params_max_tokens",
        ("vllm:request_params_max_tokens",),
        "The max_tokens parameter of each finished sequence (the context left when unset).",
        buckets=token_buckets,
        vllm_buckets=token_buckets,
    ),
    # ---- speculative decoding (engine.speculative_config) --------------------------------------
    MetricSpec(
        "spec_drafts",
        "counter",
        "inferlab_spec_decode_num_drafts_total",
        ("vllm:spec_decode_num_drafts_total",),
        "Speculative decoding: verifying rows (a sequence's drafts checked in a step).",
        needs="spec_decode",
    ),
    MetricSpec(
        "spec_draft_tokens",
        "counter",
        "inferlab_spec_decode_num_draft_tokens_total",
        ("vllm:spec_decode_num_draft_tokens_total",),
        "Drafts proposed.",
        needs="spec_decode",
    ),
    MetricSpec(
        "spec_accepted_tokens",
        "counter",
        "inferlab_spec_decode_num_accepted_tokens_total",
        ("vllm:spec_decode_num_accepted_tokens_total",),
        "Drafts kept.",
        needs="spec_decode",
    ),
    MetricSpec(
        "spec_accepted_per_pos",
        "counter",
        "inferlab_spec_decode_num_accepted_tokens_per_pos_total",
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total",),
        "Drafts kept at each position (0: the first draft).",
        labels=("position",),
        needs="spec_decode",
    ),
    MetricSpec(
        "spec_drafts_per_pos",
        "counter",
        "inferlab_spec_decode_num_draft_tokens_per_pos_total",
        (),
        "Drafts proposed at each position (0: the first draft).",
        labels=("position",),
        needs="spec_decode",
    ),
)


def resolve(buckets: Buckets, max_model_len: int) -> tuple[float, ...]:
    return buckets(max_model_len) if callable(buckets) else buckets
