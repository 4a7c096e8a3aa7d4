"""Structured traffic: a share of a workload's requests carries a structured-output
constraint, as vLLM's structured-output benchmark's `--structured-output-ratio` does; each one
drawn, with the workload's seed, from the shipped constraints of the kinds asked
(data/structured/constraints.jsonl; docs/structured_output.md, Structured traffic)."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from engines.structured_outputs import StructuredOutputsParams
from workloads.common import STRUCTURED_KINDS, rng_streams
from workloads.request import WorkloadRequest

CONSTRAINTS_FILE = Path(__file__).resolve().parents[1] / "data" / "structured" / "constraints.jsonl"
#: The seed stream that picks the structured requests and their constraints: after the
#: cancellation stream, so that neither changes the other (workloads/common.py)
STRUCTURED_STREAM = 4


@functools.cache
def shipped_constraints() -> dict[str, list[tuple[str, StructuredOutputsParams]]]:
    """kind -> [(name, constraint)] from the shipped file."""
    found: dict[str, list[tuple[str, StructuredOutputsParams]]] = {k: [] for k in STRUCTURED_KINDS}
    for line in CONSTRAINTS_FILE.read_text().splitlines():
        row = json.loads(line)
        kind, spec = row["kind"], row["spec"]
        params = (
            StructuredOutputsParams(json_object=True)
            if kind == "json_object"
            else (StructuredOutputsParams(**{kind: spec}))
        )
        found[kind].append((row["name"], params))
    return found


def plan_structured(
    requests: list[WorkloadRequest],
    fraction: float,
    kinds: list[str],
    seed: int,
    enforce: bool = True,
) -> dict[str, Any]:
    """Give exactly round(fraction * n) of `requests`, drawn with `seed`, a constraint drawn
    from the shipped ones of `kinds` (in place): in their SamplingParams, or, not enforced,
    as the format their free output is judged against. The plan for the workload's `info`."""
    count = round(fraction * len(requests))
    if not count:
        return {"structured_planned": 0}
    rng = rng_streams(seed, STRUCTURED_STREAM + 1)[STRUCTURED_STREAM]
    pool = [item for kind in kinds for item in shipped_constraints()[kind]]
    chosen: dict[str, int] = {}
    for index in sorted(rng.choice(len(requests), size=count, replace=False)):
        name, constraint = pool[int(rng.integers(len(pool)))]
        item = requests[int(index)]
        if enforce:
            item.request.sampling = replace(item.request.sampling, structured_outputs=constraint)
        else:
            item.expected_format = constraint
        chosen[name] = chosen.get(name, 0) + 1
    return {
        "structured_planned": count,
        "structured_enforced": enforce,
        "structured_constraints": dict(sorted(chosen.items())),
    }
