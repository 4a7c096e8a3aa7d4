"""Batch-1 decode tokens/s: the built-in engine vs Hugging Face transformers `generate`, on the
same model shape and the very same dummy weights, measured interleaved in one process.

    python scripts/bench_decode_vs_hf.py --model small --rounds 5

Decode time is measured the same way for both: time(prompt -> 1 + N tokens) minus
time(prompt -> 1 token), so prefill and fixed per-call overheads cancel. Prints medians and
the ratio; needs `transformers` (the dev extra).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from engines.builtin import LLM, SamplingParams
    from models.weights import dummy_state_dict

    dtype = getattr(torch, args.dtype)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.new_tokens + 8,
        max_num_seqs=1,
    )
    cfg = llm.engine.model_config
    hf_config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    hf = LlamaForCausalLM(hf_config).to(dtype).eval()
    hf.load_state_dict(dummy_state_dict(cfg, llm.engine.config.seed, dtype), strict=True)

    prompt = list(range(10, 10 + args.prompt_len))
    ids = torch.tensor([prompt])

    def ours(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - start

    @torch.inference_mode()
    def theirs(n: int) -> float:
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    # Same weights, same logits: check the engine's greedy tokens against HF's argmax over
    # the ids the engine may sample (a dummy model's vocabulary exceeds the tokenizer's).
    got = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[
        0
    ].token_ids
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]
    expected = logits[:, : llm.tokenizer.vocab_size].argmax(-1).tolist()
    print(f"greedy tokens identical to HF's argmax over 16 steps: {expected == got}")

    n = args.new_tokens
    ours(4), theirs(4)  # warm-up
    rates: dict[str, list[float]] = {"builtin": [], "hf_generate": []}
    for _ in range(args.rounds):
        for name, fn in (("builtin", ours), ("hf_generate", theirs)):
            decode = fn(n + 1) - fn(1)
            rates[name].append(n / decode)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"prompt={args.prompt_len} new_tokens={n} rounds={args.rounds}"
    )
    for name, values in rates.items():
        print(
            f"  {name:12s} median {med[name]:7.2f} tok/s   runs: "
            + ", ".join(f"{v:.1f}" for v in values)
        )
    print(f"  ratio builtin / hf_generate (median): {med['builtin'] / med['hf_generate']:.2f}x")


if __name__ == "__main__":
    main()
