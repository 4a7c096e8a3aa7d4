"""LoRA traffic: which requests run under which adapter, as vLLM's serving benchmark assigns
`--lora-modules` (`--lora-assignment random|round-robin`) and AIPerf its
`--model-selection-strategy`, plus a Zipf skew (a few hot adapters and a long tail, the case
where slots and host memory are contended). Drawn with the workload's seed on a stream of its
own, so prompts, lengths, arrivals, cancellation and structured traffic stay as they were; every
turn of a session runs under its first turn's adapter (docs/lora.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from workloads.common import rng_streams
from workloads.request import WorkloadRequest

#: after the cancellation (3) and structured (4) streams (workloads/common.py, structured.py)
LORA_STREAM = 5


def plan_lora(
    requests: list[WorkloadRequest],
    adapters: list[str],
    assignment: str,
    fraction: float,
    zipf_exponent: float,
    seed: int,
) -> dict[str, Any]:
    """Give round(fraction * sessions) of the sessions (a request without a session is one),
    drawn with `seed`, an adapter of `adapters` (in place, every turn alike): in turn
    (round_robin), uniformly (random), or the k-th with weight 1 / k**zipf_exponent (zipf).
    The plan for the workload's `info`."""
    if not adapters:
        return {}
    roots = [r for r in requests if r.follows is None]
    count = round(fraction * len(roots))
    rng = rng_streams(seed, LORA_STREAM + 1)[LORA_STREAM]
    chosen = sorted(rng.choice(len(roots), size=count, replace=False)) if count else []
    if assignment == "round_robin":
        picks = [k % len(adapters) for k in range(count)]
    elif assignment == "random":
        picks = rng.integers(len(adapters), size=count).tolist()
    else:
        weights = 1.0 / np.arange(1, len(adapters) + 1) ** zipf_exponent
        picks = rng.choice(len(adapters), size=count, p=weights / weights.sum()).tolist()
    by_root = {roots[int(i)].request_id: adapters[p] for i, p in zip(chosen, picks, strict=True)}
    followed = {r.request_id: r.follows for r in requests}
    counts: dict[str, int] = {}
    for item in requests:
        root = item.request_id
        while followed.get(root) is not None:
            root = str(followed[root])
        name = by_root.get(root)
        if name is not None:
            item.request.lora = name
            counts[name] = counts.get(name, 0) + 1
    return {"lora_assignment": assignment, "lora_requests": dict(sorted(counts.items()))}
