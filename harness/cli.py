"""The `inferlab` command: `inferlab run [hydra overrides...]` and friends."""

from __future__ import annotations

import sys

USAGE = """usage: inferlab <command> [args]

commands:
  run [overrides...]   run an experiment (Hydra app; -m for sweeps, --help for the config)
  kv-calc [overrides]  KV bytes per token and sequence, weights, sequences that fit; per GPU
                       with engine.tensor_parallel_size=N (N1,N2,...: a table), and the
                       predicted decode step with hardware=h100|h200|a100|l4|cpu
  pd-plan [overrides]  prefill/decode disaggregation predicted: each phase's time, the K/V
                       hand-off per link, x prefill + y decode instances vs colocated
  train-tiny [--model NAME] [--text FILE] [--out DIR [--force]] [--steps N] [--seed S]
                       train a small real Llama on CPU (cached): tiny-trained for quality
                       checks, tiny-trained-large / -draft for speculative decoding
  serve [overrides...] an OpenAI-compatible HTTP server on the built-in engine
  convert SRC.gguf DST [--dtype T | --tokenizer-only] [--force]
                       a GGUF file -> a Hugging Face folder, or a .gguf re-encoded (f16...);
                       an existing DST is replaced only with --force
  report DIR           report.md + report.html (tables, figures) for a run or sweep folder
  gate ...             compare a candidate with a baseline: exit 0 pass, 1 regression,
                       2 inconclusive (`inferlab gate --help`)
  export RUN [--format vllm] [--out FILE]
                       a run as `vllm bench serve --save-result` JSON (vLLM's keys, units
                       and definitions; a sweep: each run) (docs/interop.md)
  import FILE [--out DIR] [--format auto|vllm|guidellm|aiperf|genai-perf|llmperf]
                       another tool's result file as a run folder that report and gate
                       compare with the lab's runs (docs/interop.md)
  list                 every plug point (config key) and what is registered for it

examples:
  inferlab run                                  # default experiment: small model, CPU
  inferlab run model=tiny engine.kv_cache=none workload.num_requests=4
  inferlab run -m engine.kv_cache=none,contiguous model=tiny
  inferlab kv-calc model=llama3-8b engine.max_model_len=8192 engine.dtype=fp16 \
      device_memory_gib=80
  inferlab kv-calc model=llama3-70b hardware=h100 engine.tensor_parallel_size=1,2,4,8
  inferlab export results/runs/<run> --out vllm.json
  inferlab import profile_export_aiperf.json --out results/imported/aiperf-c2
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    try:
        return _dispatch(command, rest)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling: while torch imports
        print("inferlab: interrupted", file=sys.stderr)
        return 130


def _dispatch(command: str, rest: list[str]) -> int:
    if command in ("run", "serve"):
        from engines.base import ConfigError
        from engines.builtin.distributed.group import TensorParallelError
        from engines.builtin.distributed.worker import serve_if_worker_rank

        # torchrun started this process as a rank other than 0 of a tensor-parallel engine:
        # it serves rank 0's engines and writes nothing of its own (docs/parallelism.md)
        try:
            if serve_if_worker_rank():
                return 0
        except ConfigError as exc:  # torchrun's variables make no rank
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except TensorParallelError as exc:  # rank 0 never came, or went while starting
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C while it waits for rank 0
            print("inferlab: interrupted", file=sys.stderr)
            return 130
    if command == "run":
        from harness.running import app

        sys.argv = [f"{sys.argv[0]} run", *rest]
        app.cli()
        return 0
    if command == "kv-calc":
        from harness.measuring import kv_calc

        return kv_calc.main(rest)
    if command == "pd-plan":
        from harness.measuring import pd_plan

        return pd_plan.main(rest)
    if command == "train-tiny":
        from harness import train_tiny_cli

        return train_tiny_cli.main(rest)
    if command == "serve":
        from serving import cli as serve_cli

        return serve_cli.main(rest)
    if command == "convert":
        from models import gguf_convert

        return gguf_convert.main(rest)
    if command == "report":
        from harness.reporting import report

        return report.main(rest)
    if command == "gate" and rest[:1] == ["ab"]:  # runs A/B rounds, then gates them
        from harness.gating import ab

        return ab.main(rest[1:])
    if command == "gate":
        from harness.gating import cli as gate_cli

        return gate_cli.main(rest)
    if command == "export":
        from harness.interop import cli as interop_cli

        return interop_cli.export_main(rest)
    if command == "import":
        from harness.interop import cli as interop_cli

        return interop_cli.import_main(rest)
    if command == "list":
        from harness import listing

        if rest:  # not silently ignored: `list --json` would suggest it was heeded
            print(f"inferlab list: takes no arguments; got {rest}", file=sys.stderr)
            return 2
        print(listing.listing())
        return 0
    print(f"inferlab: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
