"""What structured output costs the built-in engine (issue 40): per constraint kind, the TPOT
of guided requests against the same requests free (each free one decodes exactly as many
tokens as its guided twin, ignore_eos), at batch 1 and 16; the mask's time per step, absolute
and as a share of the step's forward; the compile time of each constraint, cold and cached.
Alternating rounds in one process; medians. And validity: SmolLM2 asked for JSON following
each shipped schema, with the grammar and without it, greedy and sampled.

    .venv/bin/python scripts/bench_structured_output.py [--model smollm2-135m]
        [--batches 1 16] [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from engines.base import Finished, StepRecord, Tokens
from engines.builtin import LLM, SamplingParams
from engines.structured_outputs import StructuredOutputsParams
from workloads.structured import shipped_constraints

PEOPLE = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}
CONSTRAINTS = {
    "json_schema": StructuredOutputsParams(json=PEOPLE),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"([A-Z][a-z]{2,8} ){6}[A-Z][a-z]{2,8}\."),
    "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
}
TOPICS = ["a team", "a family", "a village", "a class", "a band", "a crew", "a club", "a lab"]
MAX_TOKENS = 96


def prompts(llm: LLM, batch: int) -> list[list[int]]:
    texts = [
        f"List four members of {TOPICS[i % len(TOPICS)]} as JSON: name, age and city."
        for i in range(batch)
    ]
    return [llm.engine.tokenize([{"role": "user", "content": t}]) for t in texts]


def run(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    """Per request: output tokens, TPOT; per step: mask time, forward time."""
    engine = llm.engine
    records: list[StepRecord] = []
    engine.step_observers.append(records.append)
    first: dict[str, int] = {}
    done: dict[str, tuple[int, int, str]] = {}
    try:
        for i, (prompt, p) in enumerate(zip(batch, params, strict=True)):
            engine.add_request(f"r{time.perf_counter_ns()}-{i}", prompt, p)
        while engine.has_unfinished_requests():
            for event in engine.step():
                if isinstance(event, Tokens):
                    first.setdefault(event.request_id, event.time_ns)
                elif isinstance(event, Finished):
                    done[event.request_id] = (event.time_ns, event.num_output_tokens, event.text)
    finally:
        engine.step_observers.remove(records.append)
    ids = sorted(done, key=lambda r: int(r.rsplit("-", 1)[1]))
    tpots = [(done[r][0] - first[r]) / 1e9 / (done[r][1] - 1) for r in ids if done[r][1] > 1]
    masked = [r for r in records if r.structured_rows]
    return {
        "lengths": [done[r][1] for r in ids],
        "texts": [done[r][2] for r in ids],
        "tpot_s": statistics.median(tpots) if tpots else float("nan"),
        "mask_s": statistics.median(r.structured_mask_ns / 1e9 for r in masked) if masked else 0,
        "mask_share": (
            statistics.median(r.structured_mask_ns / r.forward_ns for r in masked) if masked else 0
        ),
    }


def validity(llm: LLM, seeds: int = 4) -> dict[str, dict[str, float]]:
    """SmolLM2 asked, in its chat template, for JSON following each shipped schema: the share of
    outputs that validate (jsonschema, the text as it is), with the grammar and without it,
    greedy and sampled (temperature 0.8, `seeds` seeds)."""
    schemas = [params for _, params in shipped_constraints()["json"]]
    prompts = [
        llm.engine.tokenize(
            [{"role": "user", "content": f"Reply with JSON for this schema: {p.spec}"}]
        )
        for p in schemas
    ]
    out = {}
    for masked in (True, False):
        for label, temperature, draws in (("greedy", 0.0, 1), ("sampled", 0.8, seeds)):
            valid = total = 0
            for seed in range(draws):
                params = [
                    SamplingParams(
                        max_tokens=256,
                        temperature=temperature,
                        seed=seed,
                        structured_outputs=p if masked else None,
                    )
                    for p in schemas
                ]
                for constraint, result in zip(schemas, llm.generate(prompts, params), strict=True):
                    valid += bool(constraint.matches(result.text))
                    total += 1
            out[f"{'grammar' if masked else 'free'}_{label}"] = {"valid": valid, "total": total}
    return out


def compile_times(llm: LLM) -> dict[str, dict[str, float]]:
    """Each constraint compiled cold (the backend itself, no cache) and looked up cached."""
    manager = llm.engine.structured
    assert manager is not None
    out = {}
    for name, constraint in CONSTRAINTS.items():
        start = time.perf_counter()
        manager.backend.compile(constraint)
        cold = time.perf_counter() - start
        manager.compile(constraint)
        start = time.perf_counter()
        manager.compile(constraint)
        out[name] = {"cold_ms": cold * 1e3, "cached_ms": (time.perf_counter() - start) * 1e3}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.rounds < 1 or min(args.batches) < 1:
        parser.error("--rounds and --batches: each must be >= 1")
    cells: dict[str, list[dict[str, Any]]] = {}
    with LLM(args.model, dtype="float32", kv_cache="paged", max_model_len=512) as llm:
        compiled = compile_times(llm)
        valid = validity(llm)
        run(llm, prompts(llm, 2), [SamplingParams(max_tokens=4)] * 2)  # warm-up
        for _ in range(args.rounds):  # alternating, so a noisy moment hits every variant
            for batch in args.batches:
                batch_prompts = prompts(llm, batch)
                for name, constraint in CONSTRAINTS.items():
                    guided = SamplingParams(
                        max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=constraint
                    )
                    g = run(llm, batch_prompts, [guided] * batch)
                    free = [  # each free twin decodes as many tokens as its guided one
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                        for n in g["lengths"]
                    ]
                    f = run(llm, batch_prompts, free)
                    g["free_tpot_s"] = f["tpot_s"]
                    cells.setdefault(f"{batch}|{name}", []).append(g)
    cpu = platform.processor() or platform.machine()
    print(f"{args.model}, float32, CPU {cpu}, {args.rounds} alternating rounds (medians)")
    print("compile (xgrammar), ms: " + ", ".join(
        f"{k} {v['cold_ms']:.2f} cold / {v['cached_ms']:.3f} cached" for k, v in compiled.items()
    ))  # fmt: skip
    print("validity on the shipped schemas: " + ", ".join(
        f"{k} {v['valid']}/{v['total']}" for k, v in valid.items()
    ))  # fmt: skip
    print("batch constraint    tokens  TPOT guided  TPOT free  ratio  mask/step  mask share")
    medians = {}
    for key, runs in cells.items():
        batch, name = key.split("|")
        m = {
            k: statistics.median(r[k] for r in runs)
            for k in ("tpot_s", "free_tpot_s", "mask_s", "mask_share")
        }
        m["tokens"] = statistics.median(statistics.mean(r["lengths"]) for r in runs)
        medians[key] = m
        print(
            f"{batch:>5} {name:12s} {m['tokens']:7.1f} {m['tpot_s'] * 1e3:9.2f} ms "
            f"{m['free_tpot_s'] * 1e3:8.2f} ms  x{m['tpot_s'] / m['free_tpot_s']:.3f} "
            f"{m['mask_s'] * 1e3:7.3f} ms  {m['mask_share'] * 100:8.2f}%"
        )
    if args.json:
        out = {
            "cpu": cpu,
            "args": vars(args),
            "compile": compiled,
            "validity": valid,
            "medians": medians,
        }
        out["texts"] = {k: runs[0]["texts"] for k, runs in cells.items()}
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
