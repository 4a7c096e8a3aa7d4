"""Quality probes: how far a candidate engine's next-token distributions drift from a reference.

Both register a logits observer (``LLMEngine.add_logits_observer``: float32 logits for every
packed token of every step), so one prefill step (``max_tokens=1``, greedy) gives the logits at
every prompt position.
Only the tokenizer's vocabulary ``logits[:, :tokenizer.vocab_size]`` counts (a checkpoint may
pad its embedding rows). See docs/quality.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from engines.builtin import LLM, SamplingParams


def prompt_logits(llm: LLM, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """float32 logits [len(prompt), vocab] at every position of every prompt (one prefill)."""
    captured: dict[str, dict[int, torch.Tensor]] = {}

    def observer(plan, logits: torch.Tensor) -> None:
        row = 0
        for item in plan.scheduled:
            rows = captured.setdefault(item.seq.request_id, {})
            for j in range(item.num_new_tokens):
                pos = item.num_computed_before + j
                if pos < item.seq.num_prompt_tokens:
                    rows[pos] = logits[row].detach().to("cpu", copy=True)
                row += 1

    llm.engine.add_logits_observer(observer)
    try:
        outputs = llm.generate(
            [list(p) for p in prompts],
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
    finally:
        llm.engine.remove_logits_observer(observer)
    result = []
    for prompt, out in zip(prompts, outputs, strict=True):
        if out.error is not None:
            raise RuntimeError(f"quality probe: request failed: {out.error}")
        rows = captured.get(out.request_id, {})
        if sorted(rows) != list(range(len(prompt))):
            raise RuntimeError("quality probe: not every prompt position was observed")
        result.append(torch.stack([rows[i] for i in range(len(prompt))]))
    return result


def quality_probe(
    reference: LLM, candidate: LLM, prompts: Sequence[Sequence[int]], min_margin: float = 0.1
) -> dict[str, float | int | None]:
    """Compare next-token distributions position by position over every prompt.

    Returns ``kl_mean`` / ``kl_max`` (KL(ref || cand) in nats, float64 log-softmax over the
    tokenizer vocabulary), ``top1_agreement`` (fraction of positions whose argmax agrees, only
    over positions where the reference's top-1 minus top-2 logit exceeds ``min_margin``: near
    ties flip on rounding noise and say nothing; None if no position qualifies),
    ``max_abs_logit_error``, ``positions``, ``counted_positions`` and ``excluded_positions``.
    """
    vocab = reference.tokenizer.vocab_size
    if candidate.tokenizer.vocab_size != vocab:
        raise ValueError(
            f"quality probe: tokenizer vocabularies differ ({vocab} vs "
            f"{candidate.tokenizer.vocab_size})"
        )
    return compare_logits(
        prompt_logits(reference, prompts), prompt_logits(candidate, prompts), vocab, min_margin
    )


def compare_logits(
    reference: Sequence[torch.Tensor],
    candidate: Sequence[torch.Tensor],
    vocab: int,
    min_margin: float = 0.1,
) -> dict[str, float | int | None]:
    """`quality_probe`'s comparison of two engines' logits [positions, >= vocab] per prompt,
    for engines that give logits another way (a backend's `prompt_logits`)."""
    ref = torch.cat(list(reference))[:, :vocab].double()
    cand = torch.cat(list(candidate))[:, :vocab].double()
    ref_lp = torch.log_softmax(ref, dim=-1)
    cand_lp = torch.log_softmax(cand, dim=-1)
    kl = (ref_lp.exp() * (ref_lp - cand_lp)).sum(dim=-1).clamp_min(0.0)
    top2 = ref.topk(2, dim=-1).values
    counted = (top2[:, 0] - top2[:, 1]) > min_margin
    agree = ref.argmax(dim=-1) == cand.argmax(dim=-1)
    n_counted = int(counted.sum())
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": float(agree[counted].double().mean()) if n_counted else None,
        "max_abs_logit_error": float((ref - cand).abs().max()),
        "positions": int(ref.shape[0]),
        "counted_positions": n_counted,
        "excluded_positions": int(ref.shape[0]) - n_counted,
        "min_margin": min_margin,
    }


def perplexity(llm: LLM, text: str, window: int | None = None) -> float:
    """exp(mean NLL) of each next token of ``text`` (encoded without special tokens).

    The tokens are cut into consecutive, non-overlapping windows of at most ``window`` tokens
    (default: the engine's ``max_model_len - 1``, room for the one sampled token); each window
    is one prompt, and its first token is context only (no prediction crosses a window edge).
    """
    return perplexity_of(
        lambda chunks: prompt_logits(llm, chunks),
        llm.tokenizer,
        text,
        window or llm.engine.limits.max_model_len - 1,
    )


def perplexity_of(
    logits_of: Callable[[list[list[int]]], Sequence[torch.Tensor]],
    tokenizer: Any,
    text: str,
    window: int,
) -> float:
    """`perplexity` for any source of prompt logits (`logits_of(prompts)`)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    size = window
    if size < 2:
        raise ValueError("perplexity: window must be >= 2")
    chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
    chunks = [c for c in chunks if len(c) >= 2]
    if not chunks:
        raise ValueError("perplexity: the text has fewer than 2 tokens")
    vocab = tokenizer.vocab_size
    total, count = 0.0, 0
    for chunk, logits in zip(chunks, logits_of(chunks), strict=True):
        lp = torch.log_softmax(logits[:-1, :vocab].double(), dim=-1)
        targets = torch.tensor(chunk[1:])
        total -= float(lp.gather(1, targets[:, None]).sum())
        count += len(chunk) - 1
    return math.exp(total / count)


def run_quality(engine_options: dict, candidate: LLM, settings: dict) -> dict[str, float | None]:
    """The probe a run asks for with `run.quality.enabled`: the measured engine's options
    against the float32, unquantized engine on the same weights, over windows of a text
    (prefilled in chunks, so cached K/V is read back); perplexity too when the weights are a
    real checkpoint (dummy weights make it meaningless)."""
    from engines.train_tiny import corpus_text

    reference_options = {
        **engine_options,
        "dtype": "float32",
        "quantization": "none",
        "kv_cache_dtype": "auto",
    }
    if engine_options.get("kv_cache") != "none" and engine_options.get("batching") != "static":
        # Prompts go in small chunks, so every chunk after the first attends to K/V read back
        # from the cache: the probe then sees what KV quantization costs, not only weights.
        chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16}
        reference_options.update(chunked)
        candidate = LLM(**{**engine_options, **chunked})
    reference = LLM(**reference_options)
    text = corpus_text(settings.get("text"))
    ids = candidate.tokenizer.encode(text, add_special_tokens=False)
    length = min(int(settings.get("prompt_len", 64)), candidate.engine.limits.max_model_len - 1)
    count = int(settings.get("num_prompts", 8))
    stride = max(1, (len(ids) - length) // max(1, count))
    prompts = [ids[i * stride : i * stride + length] for i in range(count)]
    result = quality_probe(reference, candidate, prompts, float(settings.get("min_margin", 0.1)))
    out: dict[str, float | None] = {
        "top1_agreement": result["top1_agreement"],
        "kl_mean": result["kl_mean"],
        "max_abs_logit_error": result["max_abs_logit_error"],
    }
    if candidate.engine.weights_source == "checkpoint":
        out["perplexity"] = perplexity(candidate, text)
    return out


@runtime_checkable
class LogitsBackend(Protocol):
    """A backend the probe can read without the built-in engine's logits observer: it gives
    float32 logits at every prompt position itself (engine=llamacpp)."""

    tokenizer: Any

    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]: ...

    def describe(self) -> dict[str, Any]: ...


def run_quality_of_backend(backend: LogitsBackend, settings: dict) -> dict[str, Any]:
    """`run.quality` for a backend with `prompt_logits`: its logits against the built-in
    engine's float32, unquantized ones on the same model file (describe()['model']), over the
    same windows of the probe text as `run_quality`; the reference prefills in 16-token
    chunks as there. Perplexity too: a GGUF file holds real weights."""
    from engines.train_tiny import corpus_text

    facts = backend.describe()
    max_model_len = int(facts["max_model_len"])
    reference = LLM(
        model=str(facts["model"]),
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=8,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    if reference.tokenizer.vocab_size != backend.tokenizer.vocab_size:
        raise ValueError("quality probe: the reference's tokenizer is not the backend's")
    text = corpus_text(settings.get("text"))
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    length = min(int(settings.get("prompt_len", 64)), max_model_len - 1)
    count = int(settings.get("num_prompts", 8))
    stride = max(1, (len(ids) - length) // max(1, count))
    prompts = [ids[i * stride : i * stride + length] for i in range(count)]
    vocab = backend.tokenizer.vocab_size
    result = compare_logits(
        prompt_logits(reference, prompts),
        backend.prompt_logits(prompts),
        vocab,
        float(settings.get("min_margin", 0.1)),
    )
    return {
        "top1_agreement": result["top1_agreement"],
        "kl_mean": result["kl_mean"],
        "max_abs_logit_error": result["max_abs_logit_error"],
        # the weights are a real checkpoint (a GGUF file): perplexity means something
        "perplexity": perplexity_of(
            backend.prompt_logits, backend.tokenizer, text, max_model_len - 1
        ),
    }
