"""Which Prometheus series of which server means what: the name maps the server scrape reads.

One canonical quantity (`num_requests_running`, `ttft`, ...) maps to the sample names each
server exports for it, in order of preference (a newer name first, an older one after). Only
names each server documents are listed; a quantity a server does not export is absent from
its map, and so from the run's figures, never zero. Sources: vLLM's v1 `loggers.py`, SGLang's
docs/references/production_metrics.md, TGI's docs reference/metrics, llama.cpp's
tools/server/README.md (`--metrics`), NVIDIA's dcgm-exporter default counters, and
serving/metrics.py for `inferlab serve`. docs/interop.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "counter", "histogram"]
# how label sets of one series are combined (vLLM labels each engine and model)
Combine = Literal["sum", "mean"]


@dataclass(frozen=True)
class Quantity:
    name: str
    kind: Kind
    unit: str
    combine: Combine = "sum"
    description: str = ""


QUANTITIES = {
    q.name: q
    for q in (
        Quantity("num_requests_running", "gauge", "requests", description="in the running batch"),
        Quantity("num_requests_waiting", "gauge", "requests", description="queued in the engine"),
        Quantity(
            "kv_cache_usage",
            "gauge",
            "fraction",
            "mean",
            "KV cache in use over its capacity (0 to 1)",
        ),
        Quantity("prompt_tokens", "counter", "tokens", description="prompt tokens prefilled"),
        Quantity("generation_tokens", "counter", "tokens", description="output tokens"),
        Quantity(
            "prefix_cache_queries", "counter", "tokens", description="prompt tokens looked up"
        ),
        Quantity(
            "prefix_cache_hits", "counter", "tokens", description="prompt tokens found cached"
        ),
        Quantity("num_preemptions", "counter", "count", description="sequences preempted"),
        Quantity(
            "requests_finished",
            "counter",
            "requests",
            description="sequences finished (requests x n; vLLM counts its child requests)",
        ),
        Quantity("spec_decode_draft_tokens", "counter", "tokens", description="drafts proposed"),
        Quantity("spec_decode_accepted_tokens", "counter", "tokens", description="drafts kept"),
        Quantity("ttft", "histogram", "s", description="arrival at the server -> first token"),
        Quantity("itl", "histogram", "s", description="between consecutive output tokens"),
        Quantity("tpot", "histogram", "s", description="per request: decode time / tokens"),
        Quantity("e2e", "histogram", "s", description="arrival at the server -> finished"),
        Quantity("queue_time", "histogram", "s", description="waiting before first scheduled"),
    )
}

# server -> quantity -> sample names (counters with their `_total`; histograms by base name)
SERVER_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "inferlab": {
        "num_requests_running": ("inferlab_num_requests_running",),
        "num_requests_waiting": ("inferlab_num_requests_waiting",),
        "kv_cache_usage": ("inferlab_kv_cache_usage_ratio",),
        "prompt_tokens": ("inferlab_prompt_tokens_total",),
        "generation_tokens": ("inferlab_generation_tokens_total",),
        "prefix_cache_queries": ("inferlab_prefix_cache_queries_total",),
        "prefix_cache_hits": ("inferlab_prefix_cache_hits_total",),
        "num_preemptions": ("inferlab_num_preemptions_total",),
        "requests_finished": ("inferlab_request_success_total",),
        "spec_decode_draft_tokens": ("inferlab_spec_decode_num_draft_tokens_total",),
        "spec_decode_accepted_tokens": ("inferlab_spec_decode_num_accepted_tokens_total",),
        "ttft": ("inferlab_time_to_first_token_seconds",),
        "itl": ("inferlab_inter_token_latency_seconds",),
        "e2e": ("inferlab_e2e_request_latency_seconds",),
        "queue_time": ("inferlab_request_queue_time_seconds",),
    },
    "vllm": {
        "num_requests_running": ("vllm:num_requests_running",),
        "num_requests_waiting": ("vllm:num_requests_waiting",),
        # v1 renamed gpu_cache_usage_perc; both are a fraction despite the name
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prompt_tokens": ("vllm:prompt_tokens_total",),
        "generation_tokens": ("vllm:generation_tokens_total",),
        "prefix_cache_queries": ("vllm:prefix_cache_queries_total",),
        "prefix_cache_hits": ("vllm:prefix_cache_hits_total",),
        "num_preemptions": ("vllm:num_preemptions_total",),
        "requests_finished": ("vllm:request_success_total",),
        "spec_decode_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total",),
        "spec_decode_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total",),
        "ttft": ("vllm:time_to_first_token_seconds",),
        # v1's per-token gap; v0's time_per_output_token_seconds observed the same gaps
        "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "tpot": ("vllm:request_time_per_output_token_seconds",),
        "e2e": ("vllm:e2e_request_latency_seconds",),
        "queue_time": ("vllm:request_queue_time_seconds",),
    },
    "sglang": {
        "num_requests_running": ("sglang:num_running_reqs",),
        "num_requests_waiting": ("sglang:num_queue_reqs",),
        "kv_cache_usage": ("sglang:token_usage",),
        "prompt_tokens": ("sglang:prompt_tokens_total",),
        "generation_tokens": ("sglang:generation_tokens_total",),
        "num_preemptions": ("sglang:num_retracted_reqs_total",),
        "ttft": ("sglang:time_to_first_token_seconds",),
        "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        "e2e": ("sglang:e2e_request_latency_seconds",),
        "queue_time": ("sglang:queue_time_seconds",),
    },
    "tgi": {
        # TGI's exporter writes counters without `_total`; the parser adds it
        "num_requests_running": ("tgi_batch_current_size",),
        "num_requests_waiting": ("tgi_queue_size",),
        "requests_finished": ("tgi_request_success_total",),
        "tpot": ("tgi_request_mean_time_per_token_duration",),
        "e2e": ("tgi_request_duration",),
        "queue_time": ("tgi_request_queue_duration",),
    },
    "llamacpp": {
        "num_requests_running": ("llamacpp:requests_processing",),
        "num_requests_waiting": ("llamacpp:requests_deferred",),
        "kv_cache_usage": ("llamacpp:kv_cache_usage_ratio",),
        "prompt_tokens": ("llamacpp:prompt_tokens_total",),
        "generation_tokens": ("llamacpp:tokens_predicted_total",),
    },
}

# A page with several servers' names (`inferlab serve` also speaks vLLM's): the first that
# matches names it.
DETECT_ORDER = ("inferlab", "vllm", "sglang", "tgi", "llamacpp")

# NVIDIA dcgm-exporter's default counters -> the monitor's GPU columns, with the scale from
# DCGM's unit (MiB, W, mJ, percent). One GPU: the `gpu` label picks it.
DCGM_COLUMNS: dict[str, tuple[str, float]] = {
    "gpu_util": ("DCGM_FI_DEV_GPU_UTIL", 0.01),
    "gpu_mem_used_bytes": ("DCGM_FI_DEV_FB_USED", float(2**20)),
    "gpu_power_w": ("DCGM_FI_DEV_POWER_USAGE", 1.0),
    "_gpu_energy_mj": ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 1.0),
}
