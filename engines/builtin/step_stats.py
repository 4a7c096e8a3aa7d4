"""What the engine reports about its steps and its state: the per-step `StepRecord` handed to
step observers (with the roofline's counts), and `EngineGauges`, the snapshot a server's
metrics read between steps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engines.base import StepRecord
from engines.builtin.kv_cache import KVCacheManager
from engines.builtin.scheduler import StepPlan


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """Engine state as of the end of the last step (`LLMEngine.gauges()`). Frozen, so a copy
    published by the engine thread can be read from any thread (the server's /metrics)."""

    num_running: int = 0  # sequences holding KV memory
    num_waiting: int = 0  # queued, not admitted yet (preempted ones included)
    kv_bytes_reserved: int = 0
    kv_pool_bytes: int = 0  # the pool allocated at load (0 for kv_cache=none)
    kv_blocks_used: int = 0
    kv_num_blocks: int = 0
    step: int = 0  # the engine's step counter: the number the next step will carry
    # cumulative since load (Scheduler's counters): recompute preemptions; with prefix caching,
    # tokens looked up at admission and of those found cached
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # KV tiers (host, disk): prompt tokens loaded back from each since load, blocks each holds
    kv_tier_hits: tuple[int, int] = (0, 0)
    kv_tier_blocks: tuple[int, int] = (0, 0)


def logits_rows(plan: StepPlan) -> int:
    """Rows whose logits the LM head computes: one per sampling sequence, and one per draft it
    verifies. Count before the step's tokens are appended (which moves where a sequence
    ends)."""
    return sum(1 + item.num_draft_tokens for item in plan.scheduled if item.samples)


def step_record(
    plan: StepPlan,
    start_ns: int,
    end_ns: int,
    logits_tokens: int,
    kv: KVCacheManager,
    num_running: int,
    forward_ns: int,
    kv_gather_ns: int,
    layer_windows: Mapping[int | None, int],
    draft_ns: int = 0,
    comm: tuple[int, int] = (0, 0),
    broadcast: tuple[int, int] = (0, 0),
    structured: tuple[int, int] = (0, 0),
    experts: tuple[tuple[int, ...], int, int] = ((), 0, 0),
    tiers: tuple[int, int, int] = (0, 0, 0),
) -> StepRecord:
    """The record of a step as it was executed; KV figures as of its end. `comm`, `broadcast`:
    (ns, bytes) of the step's collectives and of its broadcast to the other tensor-parallel
    ranks; `experts`: a mixture-of-experts forward's tokens per expert, experts touched and
    the experts' MLPs' time (ns); `tiers`: the KV tiers' (transfer ns, disk read bytes, disk
    read ns)."""
    num_decodes = plan.num_decodes
    block_bytes = kv.block_size * kv.layout.bytes_per_token
    rows_per_adapter: dict[str, int] = {}
    for item in plan.scheduled:
        if item.seq.lora_name is not None:
            name = item.seq.lora_name
            rows_per_adapter[name] = rows_per_adapter.get(name, 0) + item.num_new_tokens
    counts = layer_mean_counts(plan, layer_windows, kv.retains_kv)
    return StepRecord(
        step=plan.step,
        start_ns=start_ns,
        end_ns=end_ns,
        num_seqs=len(plan.scheduled),
        num_prefill_seqs=len(plan.scheduled) - num_decodes,
        num_decode_seqs=num_decodes,
        prefill_tokens=plan.num_prefill_tokens,
        decode_tokens=plan.num_decode_tokens,
        padding_tokens=plan.padding_tokens,
        num_waiting=plan.num_waiting,
        kv_bytes_reserved=kv.bytes_reserved(),
        kv_bytes_used=kv.bytes_used(),
        num_preempted=len(plan.preempted),
        num_running=num_running,
        kv_blocks_used=kv.num_blocks_in_use,
        kv_blocks_shared=kv.num_shared_blocks,
        kv_bytes_copied=len(plan.copied_blocks) * block_bytes,
        kv_bytes_saved=sum(t.kind == "save" for t in plan.kv_transfers) * block_bytes,
        kv_bytes_loaded=sum(t.kind == "load" for t in plan.kv_transfers) * block_bytes,
        kv_transfer_ns=tiers[0],
        kv_disk_read_bytes=tiers[1],
        kv_disk_read_ns=tiers[2],
        structured_rows=structured[0],
        structured_mask_ns=structured[1],
        lora_adapters=len(rows_per_adapter),
        lora_rows=sum(rows_per_adapter.values()),
        lora_rows_max=max(rows_per_adapter.values(), default=0),
        moe_expert_tokens=experts[0],
        moe_experts_touched=experts[1],
        moe_expert_ns=experts[2],
        forward_ns=forward_ns,
        kv_gather_ns=kv_gather_ns,
        logits_tokens=logits_tokens,
        spec_draft_tokens=plan.num_draft_tokens,
        spec_accepted_tokens=plan.num_accepted_tokens,
        spec_drafts_by_position=by_position([drafts for drafts, _ in plan.spec_rounds]),
        spec_accepted_by_position=by_position([kept for _, kept in plan.spec_rounds]),
        draft_ns=draft_ns,
        comm_ns=comm[0],
        comm_bytes=comm[1],
        broadcast_ns=broadcast[0],
        broadcast_bytes=broadcast[1],
        attention_pairs=counts["attention_pairs"],
        kv_tokens_read=counts["kv_tokens_read"],
        kv_tokens_written=counts["kv_tokens_written"],
    )


def by_position(lengths: list[int]) -> tuple[int, ...]:
    """Runs of drafts (proposed or kept) -> how many reached each position 1, 2, ...: a kept
    run of 3 counts at positions 1, 2 and 3."""
    return tuple(sum(1 for n in lengths if n > i) for i in range(max(lengths, default=0)))


def layer_mean_counts(
    plan: StepPlan, layer_windows: Mapping[int | None, int], retains_kv: bool
) -> dict[str, int]:
    """roofline_counts averaged over the layers, each within its own window (Gemma's windowed
    layers beside global ones), in tokens of every layer as the roofline prices them.
    `layer_windows`: window (None: global) -> its number of layers."""
    counts = {window: roofline_counts(plan, window, retains_kv) for window in layer_windows}
    layers = sum(layer_windows.values())
    return {
        key: round(sum(n * counts[window][key] for window, n in layer_windows.items()) / layers)
        for key in next(iter(counts.values()))
    }


def roofline_counts(plan: StepPlan, window: int | None, retains_kv: bool) -> dict[str, int]:
    """What the step's attention must touch: (query, key) pairs attended (causal, within the
    sliding window), cached tokens read, tokens stored. Every computed row counts, static
    batching's padding included; padding K/V are never stored."""
    rows = [
        (s.num_computed_before, s.num_new_tokens + s.num_padding_tokens, s.num_new_tokens)
        for s in plan.scheduled
    ]
    rows += [(r.start, r.num_tokens, 0) for r in plan.padding_rows]
    pairs = read = written = 0
    for start, queries, real in rows:
        # query i (0-based) of the row sees start + i + 1 keys, at most `window`
        first, last = start + 1, start + queries
        capped = 0 if window is None else max(0, last - max(window, first - 1))
        uncapped = queries - capped
        pairs += uncapped * first + uncapped * (uncapped - 1) // 2 + capped * (window or 0)
        if retains_kv:
            read += start if window is None else min(start, window - 1)
            written += real
    return {"attention_pairs": pairs, "kv_tokens_read": read, "kv_tokens_written": written}
