"""Where a batch-1 decode step's time goes in the built-in engine, per torch operator.

    python scripts/profile_decode_ops.py --model smollm2-135m --threads 2 \\
        --variants float32:none,bfloat16:int4,float32:int4 --group-size 32

For each dtype:quantization variant: one warm-up request, then `--new-tokens` decode steps of
one request under torch.profiler; prints the operators with the most self CPU time per decode
step (ms) and their share, and the step's wall time. On CPU the INT8/INT4 matmuls are the
engine's C kernels (`inferlab::q4_linear_f32`, `inferlab::q8_linear_f32`; torch's
`aten::_weight_int4pack_mm_for_cpu` without them); dense fp32 linears are
`aten::addmm`/`aten::mm`, the engine's `inferlab::linear_f32` or oneDNN's packed `mkldnn` linear
(engine.prepack_weights). In float32 with the C kernels a decode step's layers run as one call,
`inferlab::decode_layers_f32` (the decode program); `--layer-by-layer` turns it off to see each
kernel.
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

from engines.builtin import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="float32:none,bfloat16:int4,float32:int4")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument(
        "--layer-by-layer",
        action="store_true",
        help="engine.native_decode_program=false: each kernel a call of its own",
    )
    args = parser.parse_args()
    prompt = list(range(1000, 1064))
    for variant in args.variants.split(","):
        dtype, quantization = variant.split(":")
        llm = LLM(
            model=args.model,
            dtype=dtype,
            quantization=quantization,
            quantization_group_size=args.group_size,
            num_threads=args.threads,
            max_model_len=512,
            max_num_seqs=1,
            native_decode_program=not args.layer_by_layer,
        )
        params = SamplingParams(max_tokens=args.new_tokens + 1, temperature=0.0, ignore_eos=True)
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([prompt], params)  # warm-up
        start = time.perf_counter()
        llm.generate([prompt], one)
        prefill = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            llm.generate([prompt], params)
            total = time.perf_counter() - start
        step_ms = (total - prefill) / args.new_tokens * 1e3
        events = prof.key_averages()
        whole = sum(e.self_cpu_time_total for e in events)
        print(
            f"\n{variant} (group {args.group_size}): decode step {step_ms:.2f} ms "
            f"(profiled, prefill subtracted); self CPU by operator, per step of "
            f"{args.new_tokens + 1} steps incl. prefill:"
        )
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
            per_step = e.self_cpu_time_total / 1e3 / (args.new_tokens + 1)
            share = e.self_cpu_time_total / whole
            print(f"  {e.key:48s} {per_step:7.3f} ms  {share:6.1%}  calls {e.count}")
        del llm


if __name__ == "__main__":
    main()
