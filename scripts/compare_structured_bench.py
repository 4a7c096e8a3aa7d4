"""The lab's structured-output figures against vLLM's structured-output benchmark's logic
(issue 40), on the same server and schemas.

vLLM's `benchmarks/benchmark_serving_structured_output.py` needs the `vllm` package (its
tokenizer helpers) and cannot run here, so this reproduces the logic it applies to a server:
streamed completions, each carrying a JSON schema (`structured_outputs`), one at a time;
TTFT = the first content delta after sending; TPOT = (last - first token time) / (tokens - 1)
with the server's token count; correctness as its `evaluate` judges JSON (the output parses)
and, with `--validate-schema`, against its schema. The same requests then run through
`inferlab run engine=openai` (workload.structured_fraction=1, the shipped schemas) against the
same `inferlab serve`, and the medians and rates are compared.

    .venv/bin/python scripts/compare_structured_bench.py [--model smollm2-135m] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
import pandas as pd

import workloads
from serving.testing import serve_process

REPO = Path(__file__).resolve().parents[1]


def workload_options(requests: int, output_len: int) -> dict[str, Any]:
    """What both sides send: the lab's synthetic workload, every request with a shipped JSON
    schema, one at a time."""
    return {
        "type": "synthetic",
        "num_requests": requests,
        "input_len": 16,
        "output_len": output_len,
        "ignore_eos": False,
        "structured_fraction": 1,
        "structured_kinds": ["json"],
        "arrival": {"process": "closed", "concurrency": 1},
    }


def vllm_style(base_url: str, model: str, options: dict[str, Any]) -> dict[str, Any]:
    """The workload's requests (its token-id prompts, its schemas), sequential, streamed on
    /v1/completions, timed and judged as the benchmark does."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    ttfts, tpots, parsed, valid = [], [], 0, 0
    items = workloads.from_config(options).build()
    for index, item in enumerate([items[0], *items]):  # first: its initial test prompt
        sampling = item.request.sampling
        constraint = sampling.structured_outputs
        assert constraint is not None
        sent = time.perf_counter()
        first = last = None
        text, tokens = "", 0
        stream = client.completions.create(
            model=model,
            prompt=item.request.prompt,  # type: ignore[arg-type]
            max_tokens=sampling.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"structured_outputs": {"json": json.loads(constraint.spec)}},
        )
        for chunk in stream:
            for choice in chunk.choices:
                if choice.text:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    text += choice.text
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        assert first is not None and last is not None
        if index == 0:
            continue
        ttfts.append(first - sent)
        if tokens > 1:
            tpots.append((last - first) / (tokens - 1))
        try:
            json.loads(text)
            parsed += 1
        except ValueError:
            pass
        valid += bool(constraint.matches(text))
    n = len(items)
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "tpot_p50_s": statistics.median(tpots),
        "correct_rate": parsed / n,  # its evaluate(): the output parses as JSON
        "schema_valid_rate": valid / n,  # with --validate-schema
    }


def lab(base_url: str, model: str, options: dict[str, Any]) -> dict[str, Any]:
    """The same workload through `inferlab run engine=openai` (completions, vLLM's dialect)."""
    overrides = [
        f"workload.{key}={json.dumps(value) if isinstance(value, list | dict) else value}"
        for key, value in options.items()
        if key not in ("type", "arrival")
    ]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "harness.cli",
                "run",
                "engine=openai",
                f"model={model}",
                f"engine.base_url={base_url}/v1",
                "engine.server=vllm",
                "workload.arrival.process=closed",
                "workload.arrival.concurrency=1",
                *overrides,
                f"hydra.run.dir={out}",
            ],
            check=True,
            cwd=REPO,
            capture_output=True,
        )
        metrics = json.loads((out / "summary.json").read_text())["metrics"]
        rows = pd.read_parquet(out / "requests.parquet")
    return {
        "ttft_p50_s": metrics["ttft_p50_s"],
        "tpot_p50_s": metrics["tpot_p50_s"],
        "schema_valid_rate": metrics["structured_validity"],
        "requests": len(rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    options = workload_options(args.requests, args.output_len)
    serve_args = [f"model={args.model}", "engine.dtype=float32", "engine.max_model_len=1024"]
    with (
        tempfile.TemporaryDirectory() as folder,
        serve_process(serve_args, Path(folder) / "serve.log") as server,
    ):
        theirs = vllm_style(server.base_url, args.model, options)
        ours = lab(server.base_url, args.model, options)
    print(f"{args.model}, {args.requests} requests one at a time, the shipped JSON schemas")
    print(f"{'':22s} {'vLLM logic':>12s} {'inferlab run':>12s}  ratio")
    for key in ("ttft_p50_s", "tpot_p50_s", "schema_valid_rate"):
        a, b = theirs[key], ours[key]
        print(f"{key:22s} {a:12.4f} {b:12.4f}  x{b / a:.3f}" if a else f"{key}: {a} {b}")
    print(f"vLLM's correct rate (the output parses as JSON): {theirs['correct_rate']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
