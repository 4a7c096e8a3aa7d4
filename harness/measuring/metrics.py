"""The metric registry and the summary computed from a run's records.

Every summary metric has a stable snake_case name, a unit, the direction that is better, and a
kind: `deterministic` (counts and bytes: equal inputs give equal values, so gates compare them
exactly) or `timing` (noisy: gates compare them statistically). Definitions follow
docs/metrics.md (vLLM's conventions: TPOT excludes the first token, ITL pools every gap).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

from harness.measuring.phases import CAUSES, itl_by_cause
from harness.measuring.roofline import decode_only, prefill_only, roofline_summary

Better = Literal["lower", "higher", "none"]
Kind = Literal["deterministic", "timing"]


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    better: Better
    kind: Kind
    description: str


class MetricRegistry(dict[str, Metric]):
    """The registered metrics by name. Iterating lists the declared ones (docs/metrics.md's
    table); a lookup (`in`, `[]`, `get`) also finds every member of a latency family that
    `run.percentiles` can ask for (`ttft_p95_s`, `itl_p75_s`), derived from the family's
    declaration: no fixed list of percentiles anywhere a name is checked."""

    def __missing__(self, name: str) -> Metric:
        metric = family_member(name)
        if metric is None:
            raise KeyError(name)
        return metric

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or (
            isinstance(name, str) and family_member(name) is not None
        )

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default


REGISTRY = MetricRegistry()


def register(name: str, unit: str, better: Better, kind: Kind, description: str) -> Metric:
    if dict.__contains__(REGISTRY, name):
        raise ValueError(f"metric {name!r} is registered twice")
    metric = Metric(name, unit, better, kind, description)
    REGISTRY[name] = metric
    return metric


def find_metric(name: str) -> Metric | None:
    """The metric called `name`: a registered one, or a latency family's member (None: no such
    metric)."""
    found: Metric | None = REGISTRY.get(name)
    return found


@dataclass(frozen=True)
class LatencyFamily:
    """A latency measured per request (or per gap, ITL) whose summary holds its mean, std and
    percentiles: `{name}_mean_s`, `{name}_std_s`, `{name}_p95_s`, `{name}_p999_s` (99.9)."""

    name: str
    what: str
    over: str  # what the statistics are taken over
    #: the statistics every summary holds, whatever `run.percentiles` says: the names the
    #: report, the gate and existing baselines read
    always: tuple[str, ...]


#: `run.percentiles`' default; every family's summary holds these (and its `always` ones)
DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
#: decimals a percentile may have: its name spells them all (p99999 for 99.999)
PERCENTILE_DECIMALS = 4

LATENCY_FAMILIES: dict[str, LatencyFamily] = {
    family.name: family
    for family in (
        LatencyFamily(
            "ttft",
            "time to first token: first output token - arrival (queueing included)",
            "requests",
            ("mean", "p50", "p90", "p99"),
        ),
        LatencyFamily(
            "tpot",
            "time per output token: (last - first token) / (N - 1), requests with N > 1",
            "requests",
            ("mean", "p50", "p99"),
        ),
        LatencyFamily(
            "e2e", "end-to-end latency: last token - arrival", "requests", ("mean", "p50", "p99")
        ),
        LatencyFamily("queue", "queueing: first scheduled - arrival", "requests", ("p50", "p99")),
        LatencyFamily(
            "itl",
            "inter-token latency",
            "every gap between consecutive tokens (pooled)",
            ("mean", "p50", "p90", "p99", "p999", "max"),
        ),
    )
}


def percentile_stat(q: float) -> str:
    """The statistic's name for percentile `q`: p50, p5, p999 (99.9), p9999 (99.99), p001
    (0.1): the integer part, two digits wide when decimals follow it, then the decimals, as
    vLLM's and guidellm's names read once the point is dropped."""
    text = f"{q:.{PERCENTILE_DECIMALS}f}".rstrip("0").rstrip(".")
    whole, _, decimals = text.partition(".")
    return "p" + (whole.zfill(2) + decimals if decimals else whole)


def stat_percentile(stat: str) -> float | None:
    """The percentile a statistic's name stands for (p999 -> 99.9), None when `stat` is not
    the canonical name of one in (0, 100) (p05 is spelled p5)."""
    match = re.fullmatch(r"p(\d+)", stat)
    if match is None:
        return None
    digits = match[1]
    q = float(digits) if len(digits) <= 2 else float(f"{digits[:2]}.{digits[2:]}")
    return q if 0 < q < 100 and percentile_stat(q) == stat else None


def family_stats(family: LatencyFamily, percentiles: Iterable[float]) -> tuple[str, ...]:
    """The statistics a summary holds for `family` under `run.percentiles` = `percentiles`:
    mean, std, its `always` ones and every listed percentile, in increasing order, then max."""
    wanted = {percentile_stat(q) for q in percentiles}
    wanted |= {stat for stat in family.always if stat_percentile(stat) is not None}
    ordered = sorted(wanted, key=lambda stat: stat_percentile(stat) or 0.0)
    return ("mean", "std", *ordered, *(("max",) if "max" in family.always else ()))


def _describe_stat(family: LatencyFamily, stat: str) -> str:
    if stat == "mean":
        return f"{family.what}, mean over {family.over}"
    if stat == "std":
        return f"{family.what}, standard deviation over {family.over} (numpy, ddof=0, as vLLM)"
    if stat == "max":
        return f"{family.what}, max over {family.over}"
    q = stat_percentile(stat)
    return f"{family.what}, p{q:g} over {family.over} (numpy, linear interpolation)"


def family_member(name: str) -> Metric | None:
    """A latency family's statistic named `{family}_{stat}_s` (stat: mean, std, max where the
    family has it, or a percentile's canonical name), None for any other name."""
    match = re.fullmatch(r"([a-z0-9]+)_(mean|std|max|p\d+)_s", name)
    if match is None or match[1] not in LATENCY_FAMILIES:
        return None
    family, stat = LATENCY_FAMILIES[match[1]], match[2]
    if (stat == "max" and "max" not in family.always) or (
        stat.startswith("p") and stat_percentile(stat) is None
    ):
        return None
    return Metric(name, "s", "lower", "timing", _describe_stat(family, stat))


for _family in LATENCY_FAMILIES.values():  # the default summary's names, in the docs' table
    for _stat in family_stats(_family, DEFAULT_PERCENTILES):
        _member = family_member(f"{_family.name}_{_stat}_s")
        assert _member is not None
        register(_member.name, _member.unit, _member.better, _member.kind, _member.description)
register("output_tok_per_s", "tok/s", "higher", "timing", "output tokens / run duration")
register("input_tok_per_s", "tok/s", "higher", "timing", "prompt tokens / run duration")
register("total_tok_per_s", "tok/s", "higher", "timing", "(prompt + output tokens) / run duration")
register("req_per_s", "req/s", "higher", "timing", "completed requests / run duration")
register("duration_s", "s", "none", "timing", "first arrival to last completion")
register(
    "offered_req_per_s",
    "req/s",
    "none",
    "deterministic",
    "requests / arrival span, as the workload scheduled them (open loop, > 1 distinct time)",
)
register(
    "goodput_req_per_s",
    "req/s",
    "higher",
    "timing",
    "completed requests meeting every configured SLO (ttft, tpot, e2e) / run duration",
)
register(
    "slo_attainment",
    "fraction",
    "higher",
    "timing",
    "completed requests meeting every configured SLO / completed requests",
)
register(
    "send_lateness_p99_s",
    "s",
    "lower",
    "timing",
    "p99 of sent - arrival: how late the driver handed requests over",
)
register(
    "saturation_req_per_s",
    "req/s",
    "higher",
    "timing",
    "load sweep: the highest offered rate still served at >= 90% (sweep_summary.json)",
)
register(
    "kv_utilization_mean",
    "fraction",
    "higher",
    "deterministic",
    "mean over steps of KV bytes holding tokens / KV bytes reserved (steps reserving any)",
)
register(
    "kv_utilization_at_peak",
    "fraction",
    "higher",
    "deterministic",
    "KV bytes holding tokens / reserved, at the step reserving the most",
)
register(
    "max_concurrent_seqs",
    "seqs",
    "higher",
    "deterministic",
    "most sequences holding KV memory at once",
)
register(
    "num_preemptions",
    "count",
    "lower",
    "deterministic",
    "sequences preempted (KV dropped, recomputed later) during the run",
)
register(
    "spec_acceptance_rate",
    "fraction",
    "higher",
    "deterministic",
    "speculative decoding: drafts the target kept / drafts it verified (over the steps)",
)
register(
    "spec_mean_accepted_length",
    "tokens",
    "higher",
    "deterministic",
    "speculative decoding: tokens a verifying step gives a sequence (kept drafts + 1), mean",
)
# vLLM's per-position acceptance, made conditional: ngram proposes fewer than k drafts when its
# match runs out, so a position's rate counts only the rows that proposed a draft there.
SPEC_POSITIONS = 8
for _position in range(1, SPEC_POSITIONS + 1):
    register(
        f"spec_acceptance_rate_pos{_position}",
        "fraction",
        "higher",
        "deterministic",
        f"speculative decoding: of the drafts proposed at position {_position}, the share kept",
    )
register(
    "moe_routing_entropy",
    "fraction",
    "none",
    "deterministic",
    "mixture of experts: the entropy of the run's tokens per expert over its most (1: every "
    "expert took the same share)",
)
register(
    "moe_expert_time_fraction",
    "fraction",
    "none",
    "timing",
    "mixture of experts: the experts' MLPs' share of the step time (routing and grouping "
    "excluded), over the run",
)
register(
    "moe_imbalance_p50",
    "ratio",
    "lower",
    "deterministic",
    "mixture of experts: per step, the busiest expert's tokens over the mean; the median step",
)
register(
    "moe_imbalance_p90",
    "ratio",
    "lower",
    "deterministic",
    "mixture of experts: per step, the busiest expert's tokens over the mean; the p90 step",
)
register(
    "spec_draft_time_fraction",
    "fraction",
    "lower",
    "timing",
    "speculative decoding: the proposer's time / the steps' time",
)
register(
    "structured_requests",
    "count",
    "none",
    "deterministic",
    "structured output: requests that carried a constraint (workload.structured_fraction)",
)
register(
    "structured_validity",
    "fraction",
    "higher",
    "deterministic",
    "structured output: completed constrained requests whose output satisfies its constraint "
    "(jsonschema for a schema; vLLM's structured-output benchmark's correct rate)",
)
register(
    "tool_call_requests",
    "count",
    "none",
    "deterministic",
    "tool calls: requests that offered the model tools (workload type tool_calls)",
)
register(
    "tool_call_validity",
    "fraction",
    "higher",
    "deterministic",
    "tool calls: completed requests with tools whose calls are valid (each names an offered "
    "function, its arguments satisfy the function's schema), of those that had to call "
    "(tool_choice required or named) or did (auto)",
)
register(
    "structured_mask_fraction",
    "fraction",
    "lower",
    "timing",
    "structured output: the grammar masks' time (filling and applying them) / the steps' time",
)
for _class in ("structured", "free"):
    for _name, _what in (("ttft", "time to first token"), ("tpot", "time per output token")):
        register(
            f"{_name}_p50_s_{_class}",
            "s",
            "lower",
            "timing",
            f"structured output: the median {_what} of the {_class} requests alone",
        )
register(
    "prefix_cache_hit_rate",
    "fraction",
    "higher",
    "deterministic",
    "prompt tokens served from the prefix cache / prompt tokens",
)
for _tier in ("host", "disk"):
    register(
        f"kv_tier_hit_rate_{_tier}",
        "fraction",
        "higher",
        "deterministic",
        f"KV tiers: prompt tokens loaded back from the {_tier} tier instead of recomputed, "
        "over every admission (a preempted request's readmission too) / prompt tokens",
    )
register(
    "kv_transfer_fraction",
    "fraction",
    "lower",
    "timing",
    "KV tiers: time moving blocks between the pool and the tiers before the forward, and "
    "reading the disk tier, / the steps' time",
)
register(
    "kv_bytes_per_token",
    "B",
    "lower",
    "deterministic",
    "KV bytes per token: 2 x layers x kv_heads x head_dim x bytes (+ scales)",
)
register(
    "weight_bytes",
    "B",
    "lower",
    "deterministic",
    "bytes of all model weights (per rank under tensor parallelism: its shard)",
)
for _name, _what in (
    ("comm_share", "all steps"),
    ("comm_share_decode", "decode-only steps"),
    ("comm_share_prefill", "prefill-only steps"),
):
    register(
        _name,
        "fraction",
        "lower",
        "timing",
        f"tensor parallelism: time in the forward's collectives / step time, {_what}",
    )
register(
    "broadcast_share",
    "fraction",
    "lower",
    "timing",
    "tensor parallelism: time broadcasting each step's inputs to the ranks / step time",
)
register(
    "comm_bytes_decode_mean",
    "B",
    "lower",
    "deterministic",
    "tensor parallelism: bytes rank 0 sends into a decode step's collectives, mean",
)
register(
    "linear_weight_bytes",
    "B",
    "lower",
    "deterministic",
    "bytes of the blocks' linear layers (where weight quantization applies)",
)
register(
    "top1_agreement",
    "fraction",
    "higher",
    "deterministic",
    "quality probe: argmax agrees with the fp32 reference (positions with a clear margin)",
)
register(
    "kl_mean",
    "nats",
    "lower",
    "deterministic",
    "quality probe: mean KL(fp32 reference || this variant) of next-token distributions",
)
register(
    "accuracy",
    "fraction",
    "higher",
    "deterministic",
    "run.accuracy: the task's items scored right: multiple_choice, the highest-loglikelihood "
    "choice is the target (lm-eval's acc); generate_until, the first filter's output matches "
    "the target (lm-eval's exact_match)",
)
register(
    "accuracy_items",
    "items",
    "none",
    "deterministic",
    "run.accuracy: the task's items scored",
)
register(
    "quality_positions",
    "positions",
    "none",
    "deterministic",
    "quality probe: prompt positions top1_agreement counts (reference margin > min_margin)",
)
register(
    "max_abs_logit_error",
    "logit",
    "lower",
    "deterministic",
    "quality probe: largest |logit - fp32 reference logit|",
)
register(
    "perplexity",
    "ppl",
    "lower",
    "deterministic",
    "quality probe: perplexity over the probe's prompts (real checkpoints only)",
)
register(
    "kv_gather_fraction",
    "fraction",
    "none",
    "timing",
    "share of forward time the CPU attention path spent copying K/V out of the cache",
)
register(
    "padding_fraction",
    "fraction",
    "lower",
    "deterministic",
    "padding tokens / all tokens computed (prefill + decode + padding)",
)
#: a capacity search's answers (search.json, sweep_summary.json; docs/capacity.md): a sweep's
#: figures, never in a run's summary
SWEEP_ANSWERS = ("max_rate_at_slo", "max_concurrency_at_slo")
for _answer, _unit, _load in zip(
    SWEEP_ANSWERS, ("req/s", "requests"), ("request rate", "concurrency"), strict=True
):
    register(
        _answer,
        _unit,
        "higher",
        "timing",
        f"capacity search: the highest {_load} measured to meet run.search.slo",
    )
register("num_requests", "count", "none", "deterministic", "requests in the measured run")
register("num_completed", "count", "higher", "deterministic", "requests that finished")
register("num_failed", "count", "lower", "deterministic", "requests that failed")
register(
    "num_cancelled",
    "count",
    "none",
    "deterministic",
    "requests the harness cancelled (a run bound reached): neither completed nor failed",
)
register("num_steps", "count", "lower", "deterministic", "engine steps in the measured run")
register("mean_batch_size", "seqs", "higher", "deterministic", "sequences per engine step")
register("output_tokens_total", "tokens", "none", "deterministic", "output tokens generated")
register("input_tokens_total", "tokens", "none", "deterministic", "prompt tokens processed")
register(
    "prefill_tokens_total",
    "tokens",
    "lower",
    "deterministic",
    "tokens computed in prefill (recomputation included)",
)
register("padding_tokens_total", "tokens", "lower", "deterministic", "padding tokens computed")
register(
    "kv_bytes_reserved_peak",
    "B",
    "lower",
    "deterministic",
    "largest KV bytes reserved for live sequences at a step",
)
register(
    "kv_bytes_used_peak", "B", "none", "deterministic", "largest KV bytes holding tokens at a step"
)
register(
    "cold_start_s",
    "s",
    "lower",
    "timing",
    "model load (weights, tokenizer) plus the first engine step",
)
register("load_s", "s", "lower", "timing", "backend load: model build, weights, tokenizer")
# A server's own /metrics, scraped during engine=openai runs (harness/measuring/server_scrape.py,
# docs/interop.md): the difference of its counters and histograms between the scrapes that
# bracket the run; percentiles estimated from the buckets as Prometheus' histogram_quantile.
for _quantity, _what in (
    ("ttft", "server's TTFT (its arrival -> first token)"),
    ("itl", "server's inter-token latency"),
    ("tpot", "server's per-request time per output token"),
    ("e2e", "server's end-to-end latency (its arrival -> finished)"),
    ("queue_time", "server's queue time"),
):
    register(f"server_{_quantity}_mean_s", "s", "lower", "timing", f"{_what}, mean")
    for _p in (50, 90, 99):
        register(
            f"server_{_quantity}_p{_p}_s",
            "s",
            "lower",
            "timing",
            f"{_what}, p{_p} estimated from its histogram's buckets",
        )
register(
    "ttft_outside_server_mean_s",
    "s",
    "lower",
    "timing",
    "client TTFT from the send minus the server's TTFT, means: connection, request and first "
    "chunk's trips, HTTP parsing before the server's clock starts",
)
for _quantity, _what in (
    ("prompt_tokens", "prompt tokens the server prefilled"),
    ("generation_tokens", "output tokens the server generated"),
    # a request with n choices counts n (vLLM's request_success counts sequences)
    ("requests_finished", "sequences (requests x n) the server finished"),
):
    register(f"server_{_quantity}", "count", "none", "deterministic", f"{_what} during the run")
register(
    "server_num_preemptions",
    "count",
    "lower",
    "timing",
    "sequences the server preempted during the run",
)
register(
    "server_prefix_cache_hit_rate",
    "fraction",
    "higher",
    "timing",
    "server's prefix-cache hits / lookups (tokens) during the run",
)
register(
    "server_kv_cache_usage_peak",
    "fraction",
    "lower",
    "timing",
    "largest KV cache usage the server reported (0 to 1)",
)
for _gauge, _what in (("running", "in the server's running batch"), ("waiting", "queued")):
    register(
        f"server_num_requests_{_gauge}_mean",
        "requests",
        "none",
        "timing",
        f"requests {_what}, time-weighted mean of the scrapes",
    )
    register(
        f"server_num_requests_{_gauge}_peak", "requests", "none", "timing", f"most requests {_what}"
    )

# The monitor (harness/measuring/monitors.py, docs/monitoring.md): sampled, so all timing-kind.
register("peak_rss_bytes", "B", "lower", "timing", "largest process RSS sampled (psutil)")
register(
    "cpu_util_mean",
    "fraction",
    "none",
    "timing",
    "process CPU time / wall time / CPUs the process may use, time-weighted over samples",
)
register(
    "gpu_util_mean",
    "fraction",
    "higher",
    "timing",
    "NVML GPU utilization (share of time a kernel ran), time-weighted over samples",
)
register(
    "peak_vram_bytes",
    "B",
    "lower",
    "timing",
    "largest GPU memory in use sampled by NVML (whole device: CUDA context, others too)",
)
register(
    "energy_j",
    "J",
    "lower",
    "timing",
    "GPU energy: difference of NVML's total-energy counter (else integrated power)",
)
register(
    "j_per_output_token",
    "J/tok",
    "lower",
    "timing",
    "energy_j / output tokens completed in the same span",
)
register(
    "memory_weights_bytes",
    "B",
    "lower",
    "deterministic",
    "memory breakdown: model weights (= weight_bytes)",
)
register(
    "memory_packed_weights_bytes",
    "B",
    "lower",
    "deterministic",
    "memory breakdown: packed copies of the weights kept beside them for the CPU kernels "
    "(= packed_weight_bytes; engine.prepack_weights)",
)
register(
    "memory_kv_pool_bytes",
    "B",
    "lower",
    "timing",
    "memory breakdown: KV pool allocated at load (sized from free memory unless "
    "engine.kv_cache_memory_bytes is set, so not deterministic)",
)
register(
    "memory_kv_reserved_bytes",
    "B",
    "lower",
    "deterministic",
    "memory breakdown: peak KV bytes reserved for live sequences (= kv_bytes_reserved_peak)",
)
register(
    "memory_kv_used_bytes",
    "B",
    "none",
    "deterministic",
    "memory breakdown: peak KV bytes holding tokens (= kv_bytes_used_peak)",
)
register(
    "memory_peak_bytes",
    "B",
    "lower",
    "timing",
    "peak memory of the run: torch CUDA peak allocated (GPU); weights + RSS growth over "
    "the post-load RSS (CPU)",
)
register(
    "memory_other_bytes",
    "B",
    "lower",
    "timing",
    "memory breakdown: activations and workspace: GPU peak - weights - KV pool; CPU RSS "
    "growth - KV in use (an upper bound; docs/monitoring.md)",
)
register(
    "mbu_decode_mean",
    "fraction",
    "higher",
    "timing",
    "roofline: mean MBU over decode-only steps (docs/roofline.md)",
)
register("mbu_mean", "fraction", "higher", "timing", "roofline: mean MBU over all steps")
register(
    "mfu_prefill_mean", "fraction", "higher", "timing", "roofline: mean MFU over prefill-only steps"
)
register("mfu_mean", "fraction", "higher", "timing", "roofline: mean MFU over all steps")
register(
    "roofline_decode_ratio_p50",
    "ratio",
    "lower",
    "timing",
    "roofline: median of measured / predicted step time over decode-only steps",
)
register(
    "roofline_ratio_p50",
    "ratio",
    "lower",
    "timing",
    "roofline: median of measured / predicted step time over all steps",
)
register(
    "mfu_overall",
    "fraction",
    "higher",
    "timing",
    "roofline: the run's FLOPs / its summed step time / peak FLOP/s (time-weighted MFU)",
)
register(
    "mbu_verify_mean",
    "fraction",
    "higher",
    "timing",
    "roofline: mean MBU over speculative decoding's verifying steps",
)
register(
    "roofline_verify_ratio_p50",
    "ratio",
    "lower",
    "timing",
    "roofline: median of measured / predicted step time over verifying steps",
)
for _steps in ("decode", "verify"):
    register(
        f"flops_per_byte_{_steps}_mean",
        "FLOP/B",
        "none",
        "deterministic",
        f"roofline: mean arithmetic intensity (FLOPs / bytes moved) of the {_steps} steps"
        + (" (k+1 tokens a sequence, the weights read once)" if _steps == "verify" else ""),
    )
register(
    "roofline_fraction",
    "fraction",
    "higher",
    "timing",
    "roofline: summed predicted / summed measured step time (share of the roofline's "
    "speed reached)",
)
for _cause in CAUSES:
    register(
        f"itl_p99_{_cause}_s",
        "s",
        "lower",
        "timing",
        f"ITL p99 over the gaps attributed to {_cause} (harness/measuring/phases.py)",
    )
    register(
        f"itl_spike_share_{_cause}",
        "fraction",
        "none",
        "timing",
        f"share of the gaps >= the pooled ITL p99 attributed to {_cause}",
    )
register(
    "harness_overhead_fraction",
    "fraction",
    "lower",
    "timing",
    "driver's own work (event handling, rows, record sinks) / wall time of the run",
)


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _stats(
    family: LatencyFamily, values: np.ndarray, percentiles: Iterable[float]
) -> dict[str, float | None]:
    """The family's statistics over `values` (None each where there is no value)."""
    out: dict[str, float | None] = {}
    for stat in family_stats(family, percentiles):
        name = f"{family.name}_{stat}_s"
        if not len(values):
            out[name] = None
        elif stat == "mean":
            out[name] = float(values.mean())
        elif stat == "std":  # ddof=0, as vLLM's np.std
            out[name] = float(values.std())
        elif stat == "max":
            out[name] = float(values.max())
        else:
            out[name] = _pct(values, stat_percentile(stat) or 0.0)
    return out


def per_request_latencies(requests: pd.DataFrame) -> pd.DataFrame:
    """TTFT, TPOT, E2E and queue time per completed request (seconds)."""
    done = requests[requests["status"] == "ok"]
    out = pd.DataFrame({"request_id": done["request_id"]})
    out["ttft_s"] = done["first_token_s"] - done["arrival_s"]
    out["e2e_s"] = done["last_token_s"] - done["arrival_s"]
    out["queue_s"] = done["scheduled_s"] - done["arrival_s"]
    n = done["output_tokens"]
    out["tpot_s"] = ((done["last_token_s"] - done["first_token_s"]) / (n - 1)).where(n > 1)
    return out


def inter_token_latencies(tokens: pd.DataFrame, ok_ids: Iterable[str]) -> np.ndarray:
    """Every gap between consecutive output tokens of a request, pooled over requests."""
    ok = tokens[tokens["request_id"].isin(set(ok_ids))]
    if ok.empty:
        return np.empty(0)
    ordered = ok.sort_values(["request_id", "index"])
    gaps = ordered.groupby("request_id", sort=False)["time_s"].diff().dropna()
    return gaps.to_numpy(dtype=float)


def kv_summary(steps: pd.DataFrame, requests: pd.DataFrame) -> dict[str, Any]:
    """KV memory measured per step: utilization, concurrency, preemptions, prefix hits."""
    out: dict[str, Any] = {}
    if len(steps) and "kv_gather_s" in steps and steps["forward_s"].sum() > 0:
        out["kv_gather_fraction"] = float(steps["kv_gather_s"].sum() / steps["forward_s"].sum())
    if len(steps) and "kv_bytes_reserved" in steps:
        reserving = steps[steps["kv_bytes_reserved"] > 0]
        if len(reserving):
            utilization = reserving["kv_bytes_used"] / reserving["kv_bytes_reserved"]
            out["kv_utilization_mean"] = float(utilization.mean())
            peak = reserving.loc[reserving["kv_bytes_reserved"].idxmax()]
            out["kv_utilization_at_peak"] = float(peak["kv_bytes_used"] / peak["kv_bytes_reserved"])
        if "num_running" in steps and steps["num_running"].notna().any():
            out["max_concurrent_seqs"] = int(steps["num_running"].max())
        out["num_preemptions"] = int(steps["num_preempted"].fillna(0).sum())
    prompt = requests["prompt_tokens"].fillna(0).sum() if len(requests) else 0
    if prompt:
        out["prefix_cache_hit_rate"] = float(
            requests["cached_prompt_tokens"].fillna(0).sum() / prompt
        )
        for tier in ("host", "disk"):
            column = f"cached_prompt_tokens_{tier}"
            if column in requests and requests[column].notna().any():
                out[f"kv_tier_hit_rate_{tier}"] = float(requests[column].fillna(0).sum() / prompt)
    if len(steps) and "kv_transfer_s" in steps and steps["kv_bytes_saved"].fillna(0).sum():
        moving = steps["kv_transfer_s"].fillna(0).sum() + steps["kv_disk_read_s"].fillna(0).sum()
        busy = (steps["end_s"] - steps["start_s"]).sum()
        if busy > 0:
            out["kv_transfer_fraction"] = float(moving / busy)
    return out


def spec_summary(steps: pd.DataFrame) -> dict[str, Any]:
    """Speculative decoding's counts over the steps (those of the window, when there is one:
    every figure over the same span), where any drafts were verified."""
    if "spec_draft_tokens" not in steps or not steps["spec_draft_tokens"].fillna(0).sum():
        return {}
    drafts = float(steps["spec_draft_tokens"].fillna(0).sum())
    kept = float(steps["spec_accepted_tokens"].fillna(0).sum())
    proposed, accepted = (
        _sum_lists(steps[column]) if column in steps else np.zeros(0)
        for column in ("spec_drafts_by_position", "spec_accepted_by_position")
    )
    out = {"spec_acceptance_rate": kept / drafts}
    if len(proposed):  # position 1 counts every verifying row
        out["spec_mean_accepted_length"] = (kept + proposed[0]) / proposed[0]
    for i in range(min(len(proposed), SPEC_POSITIONS)):
        kept_here = accepted[i] if i < len(accepted) else 0.0
        out[f"spec_acceptance_rate_pos{i + 1}"] = float(kept_here / proposed[i])
    step_time = float((steps["end_s"] - steps["start_s"]).sum())
    if "draft_s" in steps and step_time > 0:
        out["spec_draft_time_fraction"] = float(steps["draft_s"].fillna(0).sum()) / step_time
    return out


def expert_imbalance(tokens: Sequence[int]) -> float | None:
    """A step's busiest expert's tokens over the mean per expert (1: even; the experts'
    count: one expert took them all); None for a dense model or a step with no tokens."""
    total = sum(tokens)
    return max(tokens) * len(tokens) / total if total else None


def moe_summary(steps: pd.DataFrame) -> dict[str, Any]:
    """Mixture of experts over the steps: the imbalance per step (median, p90), and the
    routing's entropy over the run's tokens per expert, over its most (ln of the experts: 1
    when every expert took the same share)."""
    if "moe_expert_tokens" not in steps:
        return {}
    totals = _sum_lists(steps["moe_expert_tokens"])
    if len(totals) < 2 or not totals.sum():
        return {}
    shares = totals / totals.sum()
    entropy = -float(np.sum(shares[shares > 0] * np.log(shares[shares > 0])))
    imbalance = steps["moe_imbalance"].dropna().astype(float)
    timed = {"moe_expert_s", "start_s", "end_s"} <= set(steps)
    step_time = float((steps["end_s"] - steps["start_s"]).sum()) if timed else 0.0
    return {
        "moe_routing_entropy": entropy / float(np.log(len(totals))),
        "moe_imbalance_p50": float(imbalance.median()),
        "moe_imbalance_p90": float(imbalance.quantile(0.9)),
        "moe_expert_time_fraction": float(steps["moe_expert_s"].sum()) / step_time
        if step_time > 0
        else None,
    }


def comm_summary(steps: pd.DataFrame) -> dict[str, Any]:
    """Tensor parallelism's communication as a share of step time, over all steps and over
    decode-only and prefill-only ones, where any was measured (rank 0's view)."""
    if "comm_s" not in steps or not steps["comm_s"].fillna(0).sum():
        return {}
    seconds = (steps["end_s"] - steps["start_s"]).astype(float)
    out: dict[str, Any] = {}
    for name, rows in (
        ("comm_share", seconds.notna()),
        ("comm_share_decode", decode_only(steps)),
        ("comm_share_prefill", prefill_only(steps)),
    ):
        total = float(seconds[rows].sum())
        if total > 0:
            out[name] = float(steps.loc[rows, "comm_s"].fillna(0).sum()) / total
    total = float(seconds.sum())
    if "broadcast_s" in steps and total > 0:
        out["broadcast_share"] = float(steps["broadcast_s"].fillna(0).sum()) / total
    decodes = steps.loc[decode_only(steps), "comm_bytes"].dropna()
    if len(decodes):
        out["comm_bytes_decode_mean"] = float(decodes.mean())
    return out


def server_spec_summary(counts: dict[str, Any] | None) -> dict[str, Any]:
    """The same metrics from a server's own counters over the run (engine=openai: vLLM's
    `spec_decode` series, engines/openai/server_metrics.py). A position's rate is over the
    drafts proposed there where the server counts them (inferlab serve), else over every
    verifying row (vLLM, whose draft models always propose k)."""
    if not counts or not counts.get("num_draft_tokens"):
        return {}
    drafts, kept = counts["num_drafts"], counts["num_accepted_tokens"]
    out = {"spec_acceptance_rate": kept / counts["num_draft_tokens"]}
    if drafts:
        out["spec_mean_accepted_length"] = 1 + kept / drafts
    proposed = counts.get("num_draft_tokens_per_pos") or []
    for i, kept_here in enumerate(counts.get("num_accepted_tokens_per_pos", [])[:SPEC_POSITIONS]):
        denominator = proposed[i] if i < len(proposed) else drafts
        if denominator:
            out[f"spec_acceptance_rate_pos{i + 1}"] = kept_here / denominator
    return out


def _sum_lists(column: pd.Series) -> np.ndarray:
    """Element-wise sum of a column of count lists of varying lengths (None where absent)."""
    rows = [np.asarray(v, dtype=float) for v in column if isinstance(v, list | np.ndarray)]
    total = np.zeros(max((len(r) for r in rows), default=0))
    for row in rows:
        total[: len(row)] += row
    return total


def slo_met(requests: pd.DataFrame, slo: dict[str, float | None]) -> pd.Series:
    """Per completed request: does it meet every SLO that is set (ttft_s, tpot_s, e2e_s)?"""
    lat = per_request_latencies(requests).set_index("request_id")
    ok = pd.Series(True, index=lat.index)
    for name in ("ttft_s", "tpot_s", "e2e_s"):
        bound = slo.get(name)
        if bound is not None:
            # A single-token request has no TPOT; it cannot miss a TPOT bound.
            ok &= lat[name].le(bound) | (lat[name].isna() if name == "tpot_s" else False)
    return ok


def compute_summary(
    requests: pd.DataFrame,
    tokens: pd.DataFrame,
    steps: pd.DataFrame,
    run_info: dict[str, Any] | None = None,
    slo: dict[str, float | None] | None = None,
    span: tuple[float, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The registered metrics of one run. Failed and cancelled requests count (each apart),
    but stay out of latencies, completions and the SLO figures. Every latency family holds its
    mean, std, its always-present statistics and each of `percentiles` (run.percentiles).

    With `span` (a measurement window [start, end]): latencies and counts cover the requests
    sent inside it, and rates count what happened inside it (requests and tokens completed,
    prompts prefilled) over its length; steps are those inside it. Without: everything, and
    rates over D = first arrival -> last completion.
    """
    run_info = run_info or {}
    members, window_steps = _in_span(requests, steps, span)
    ok = members[members["status"] == "ok"]
    # an ITL gap near the window's edge may end at a step outside it: all the steps
    summary = _latency_metrics(members, ok, tokens, steps, percentiles)
    completed = _completed(requests, tokens, ok, span)
    summary.update(_count_metrics(members, ok, window_steps, completed))
    summary.update(_load_metrics(members, run_info))
    summary["padding_fraction"] = _padding_fraction(window_steps)
    summary.update(_engine_metrics(window_steps, members, run_info))
    summary.update(_structured_metrics(members, ok, window_steps))
    summary.update(_tool_call_metrics(members, ok))
    summary.update(run_info.get("quality") or {})
    summary.update((run_info.get("accuracy") or {}).get("metrics") or {})
    if run_info.get("samples") is not None:  # the monitor's samples (harness/measuring/monitors.py)
        from harness.measuring.monitors import monitor_metrics, whole_run_span

        summary.update(
            monitor_metrics(run_info, summary, span or whole_run_span(requests), completed.output)
        )
    summary.update(_ttft_outside_server(summary, ok))
    summary.update(_slo_metrics(ok, completed, slo))
    summary.update({key: run_info[key] for key in _HARNESS_METRICS if key in run_info})
    unknown = [name for name in summary if name not in REGISTRY]
    if unknown:
        raise AssertionError(f"unregistered summary metrics: {sorted(unknown)}")
    return summary


_HARNESS_METRICS = ("cold_start_s", "load_s", "harness_overhead_fraction")
_PER_RANK_ENGINE_FACTS = ("kv_bytes_per_token", "weight_bytes", "linear_weight_bytes")


@dataclass(frozen=True)
class _Completed:
    """What the run completed and over how long: the numerators and denominator of its rates."""

    duration: float
    requests: pd.DataFrame
    output: int  # tokens
    input: int  # prompt tokens prefilled

    def rate(self, x: float) -> float | None:
        return x / self.duration if self.duration > 0 else None


def _in_span(
    requests: pd.DataFrame, steps: pd.DataFrame, span: tuple[float, float] | None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The requests sent and the steps run inside `span` (all of them without one)."""
    if span is None:
        return requests, steps
    start, end = span
    sent = requests["sent_s"]
    members = requests[(sent >= start) & (sent <= end)]
    return members, steps[(steps["start_s"] >= start) & (steps["end_s"] <= end)]


def _latency_metrics(
    members: pd.DataFrame,
    ok: pd.DataFrame,
    tokens: pd.DataFrame,
    steps: pd.DataFrame,
    percentiles: Sequence[float],
) -> dict[str, Any]:
    """TTFT, TPOT, end-to-end, queueing and inter-token latencies (ITL also by cause)."""
    lat = per_request_latencies(members)

    # A request that finished without a token (aborted, or stopped at once) has no TTFT.
    def column(name: str) -> np.ndarray:
        return lat[name].dropna().to_numpy(float)

    out: dict[str, Any] = {}
    for name in ("ttft", "tpot", "e2e", "queue"):
        out.update(_stats(LATENCY_FAMILIES[name], column(f"{name}_s"), percentiles))
    itl = inter_token_latencies(tokens, ok["request_id"])
    out.update(_stats(LATENCY_FAMILIES["itl"], itl, percentiles))
    out.update(itl_by_cause(tokens, steps, ok["request_id"]))
    return out


def _structured_metrics(
    members: pd.DataFrame, ok: pd.DataFrame, steps: pd.DataFrame
) -> dict[str, Any]:
    """Structured traffic: how many requests carried a constraint, the share of the completed
    ones whose output satisfied it, TTFT / TPOT of the two classes apart, the mask's share of
    the steps' time. Nothing for a run without structured requests (or a folder written
    before the columns existed)."""
    if "structured" not in members or not members["structured"].notna().any():
        return {}
    guided = ok[ok["structured"].notna()]
    judged = guided["structured_valid"].dropna()
    out: dict[str, Any] = {
        "structured_requests": int(members["structured"].notna().sum()),
        "structured_validity": float(judged.astype(bool).mean()) if len(judged) else None,
    }
    lat = per_request_latencies(ok)
    # the masked ones: constrained and enforced (structured_enforce=false runs them free)
    if "structured_enforced" in ok:
        is_guided = ok["structured_enforced"].fillna(False).astype(bool).to_numpy()
    else:
        is_guided = ok["structured"].notna().to_numpy()
    for label, rows in (("structured", is_guided), ("free", ~is_guided)):
        for name in ("ttft", "tpot"):
            values = lat[f"{name}_s"].to_numpy(float)[rows]
            values = values[~np.isnan(values)]
            out[f"{name}_p50_s_{label}"] = float(np.median(values)) if len(values) else None
    if "structured_mask_s" in steps and len(steps):
        step_time = float((steps["end_s"] - steps["start_s"]).sum())
        masked = float(steps["structured_mask_s"].sum())
        out["structured_mask_fraction"] = masked / step_time if step_time > 0 else None
    return out


def _tool_call_metrics(members: pd.DataFrame, ok: pd.DataFrame) -> dict[str, Any]:
    """Tool-call traffic: how many requests offered tools, and the share of the judged ones
    whose calls were valid; nothing for a run without tools."""
    if "tool_choice" not in members or not members["tool_choice"].notna().any():
        return {}
    judged = ok["tool_calls_valid"].dropna()
    return {
        "tool_call_requests": int(members["tool_choice"].notna().sum()),
        "tool_call_validity": float(judged.astype(bool).mean()) if len(judged) else None,
    }


def _completed(
    requests: pd.DataFrame,
    tokens: pd.DataFrame,
    ok: pd.DataFrame,
    span: tuple[float, float] | None,
) -> _Completed:
    """Without a span: the completed requests, over first arrival -> last completion. With
    one: what completed, and the prompts prefilled, inside it, over its length."""
    if span is None:
        duration = float(ok["last_token_s"].max() - requests["arrival_s"].min()) if len(ok) else 0.0
        return _Completed(duration, ok, int(ok["output_tokens"].sum()), _prompt_tokens(ok))
    all_ok = requests[requests["status"] == "ok"]
    done = all_ok[all_ok["last_token_s"].between(*span)]
    prefilled = all_ok[all_ok["first_token_s"].between(*span)]
    in_span = tokens["time_s"].between(*span) & tokens["request_id"].isin(set(all_ok["request_id"]))
    return _Completed(span[1] - span[0], done, int(in_span.sum()), _prompt_tokens(prefilled))


def _prompt_tokens(requests: pd.DataFrame) -> int:
    return int(requests["prompt_tokens"].sum())


def _count_metrics(
    members: pd.DataFrame, ok: pd.DataFrame, steps: pd.DataFrame, completed: _Completed
) -> dict[str, Any]:
    """The rates, the request and token counts, and the steps' totals and peaks."""
    rate = completed.rate
    return {
        "duration_s": completed.duration,
        "output_tok_per_s": rate(completed.output),
        "input_tok_per_s": rate(completed.input),
        "total_tok_per_s": rate(completed.input + completed.output),
        "req_per_s": rate(len(completed.requests)),
        "num_requests": len(members),
        "num_completed": len(ok),
        "num_failed": int((members["status"] == "failed").sum()),
        "num_cancelled": int((members["status"] == "cancelled").sum()),
        "output_tokens_total": int(members["output_tokens"].fillna(0).sum()),
        "input_tokens_total": int(members["prompt_tokens"].fillna(0).sum()),
        "num_steps": len(steps),
        "mean_batch_size": float(steps["num_seqs"].mean()) if len(steps) else None,
        "prefill_tokens_total": _step_total(steps, "prefill_tokens"),
        "padding_tokens_total": _step_total(steps, "padding_tokens"),
        "kv_bytes_reserved_peak": int(steps["kv_bytes_reserved"].max()) if len(steps) else 0,
        "kv_bytes_used_peak": int(steps["kv_bytes_used"].max()) if len(steps) else 0,
    }


def _step_total(steps: pd.DataFrame, column: str) -> int:
    return int(steps[column].sum()) if len(steps) else 0


def _load_metrics(members: pd.DataFrame, run_info: dict[str, Any]) -> dict[str, Any]:
    """The load offered (open loop only) and how late the client sent against its schedule."""
    # Offered load is what a clock scheduled: first turns of an open loop only (a closed loop's
    # and a follow-up turn's "arrival" is when the previous request finished).
    first_turns = members[members["turn"].fillna(0) == 0] if "turn" in members else members
    arrivals = first_turns["arrival_s"].dropna()
    arrival_span = float(arrivals.max() - arrivals.min()) if len(arrivals) > 1 else 0.0
    open_loop = not run_info.get("closed_loop", False)
    lateness = (members["sent_s"] - members["arrival_s"]).dropna().to_numpy(float)
    return {
        "offered_req_per_s": (
            (len(arrivals) - 1) / arrival_span if arrival_span > 0 and open_loop else None
        ),
        "send_lateness_p99_s": _pct(lateness, 99),
    }


def _padding_fraction(steps: pd.DataFrame) -> float | None:
    """Padding over every token computed (prefill, padding, decode)."""
    padding = _step_total(steps, "padding_tokens")
    computed = _step_total(steps, "prefill_tokens") + padding + _step_total(steps, "decode_tokens")
    return padding / computed if computed else None


def _engine_metrics(
    steps: pd.DataFrame, members: pd.DataFrame, run_info: dict[str, Any]
) -> dict[str, Any]:
    """KV cache, speculative decoding, roofline and communication, and the engine's sizes."""
    engine = run_info.get("engine", {})
    out = kv_summary(steps, members)
    out.update(spec_summary(steps) or server_spec_summary(engine.get("server_spec_decode")))
    out.update(roofline_summary(steps))
    out.update(comm_summary(steps))
    out.update(moe_summary(steps))
    # per rank under tensor parallelism (each holds its shard)
    out.update({key: engine[key] for key in _PER_RANK_ENGINE_FACTS if engine.get(key) is not None})
    return out


def _ttft_outside_server(summary: dict[str, Any], ok: pd.DataFrame) -> dict[str, Any]:
    """The client's TTFT less the server's, where the server reported its own."""
    if "server_ttft_mean_s" not in summary or not len(ok):
        return {}
    # the server's TTFT starts when its HTTP handler saw the request; the client's (from
    # the send) also holds connecting, the request's trip, and the first chunk's trip
    from_send = (ok["first_token_s"] - ok["sent_s"]).dropna()
    if not len(from_send):
        return {}
    return {"ttft_outside_server_mean_s": float(from_send.mean()) - summary["server_ttft_mean_s"]}


def _slo_metrics(
    ok: pd.DataFrame, completed: _Completed, slo: dict[str, float | None] | None
) -> dict[str, Any]:
    """SLO attainment and goodput, where any SLO is set and a request completed."""
    if not (slo and any(v is not None for v in slo.values()) and len(ok)):
        return {}
    done = completed.requests
    return {
        "slo_attainment": float(slo_met(ok, slo).mean()),
        "goodput_req_per_s": completed.rate(int(slo_met(done, slo).sum()) if len(done) else 0),
    }


def markdown_table() -> str:
    """The registry as docs/metrics.md's markdown table (`python -m harness.measuring.metrics`):
    the declared metrics (those of the default `run.percentiles`), then one row per latency
    family for the percentiles another list asks for."""
    lines = ["| name | unit | better | kind | definition |", "|---|---|---|---|---|"]
    lines += [
        f"| `{m.name}` | {m.unit} | {m.better} | {m.kind} | {m.description} |"
        for m in REGISTRY.values()
    ]
    lines += [
        f"| `{family.name}_p<P>_s` | s | lower | timing | {family.what}, percentile P of "
        f"`run.percentiles` over {family.over} (`{family.name}_p75_s`, "
        f"`{family.name}_p999_s` for 99.9) |"
        for family in LATENCY_FAMILIES.values()
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
