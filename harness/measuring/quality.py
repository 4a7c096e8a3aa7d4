"""Quality probes: how far a candidate engine's next-token distributions drift from a reference.

Both register a logits observer (``LLMEngine.add_logits_observer``: float32 logits for every
packed token of every step), so one prefill step (``max_tokens=1``, greedy) gives the logits at
every prompt position.
Only the tokenizer's vocabulary ``logits[:, :tokenizer.vocab_size]`` counts (a checkpoint may
pad its embedding rows). See docs/quality.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import torch

from engines.base import Backend
from engines.builtin import LLM, SamplingParams
from engines.builtin.config import EngineConfig
from engines.builtin.engine import LLMEngine
from harness.measuring.trackers import Tracker
from models.files import UserFileError, check_regular_file
from models.location import model_location
from models.train_tiny import corpus_text
from workloads.common import resolve_path
from workloads.prompt_sets import load_prompt_set


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
    ``max_abs_logit_error``, ``positions``, ``counted_positions`` and ``excluded_positions``;
    and ``perplexity`` / ``reference_perplexity``: exp(mean NLL) of each prompt's next tokens
    (within the prompt) under the candidate / the reference, from the same logits.
    """
    vocab = reference.tokenizer.vocab_size
    if candidate.tokenizer.vocab_size != vocab:
        raise ValueError(
            f"quality probe: tokenizer vocabularies differ ({vocab} vs "
            f"{candidate.tokenizer.vocab_size})"
        )
    return compare_logits(
        prompt_logits(reference, prompts),
        prompt_logits(candidate, prompts),
        prompts,
        vocab,
        min_margin,
    )


def compare_logits(
    ref_rows: Sequence[torch.Tensor],
    cand_rows: Sequence[torch.Tensor],
    prompts: Sequence[Sequence[int]],
    vocab: int,
    min_margin: float = 0.1,
) -> dict[str, float | int | None]:
    """`quality_probe`'s comparison of two sources' logits [len(prompt), >= vocab] per prompt,
    also for engines that give logits another way (a backend's `prompt_logits`)."""
    ref = torch.cat(list(ref_rows))[:, :vocab].double()
    cand = torch.cat(list(cand_rows))[:, :vocab].double()
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
        "perplexity": _prompts_perplexity(cand_rows, prompts, vocab),
        "reference_perplexity": _prompts_perplexity(ref_rows, prompts, vocab),
    }


def _prompts_perplexity(
    logits: Sequence[torch.Tensor], prompts: Sequence[Sequence[int]], vocab: int
) -> float:
    total, count = 0.0, 0
    for rows, prompt in zip(logits, prompts, strict=True):
        lp = torch.log_softmax(rows[:-1, :vocab].double(), dim=-1)
        total -= float(lp.gather(1, torch.tensor(prompt[1:])[:, None]).sum())
        count += len(prompt) - 1
    return math.exp(total / count) if count else math.nan


def perplexity(llm: LLM, text: str, window: int | None = None) -> float:
    """exp(mean NLL) of each next token of ``text`` (encoded without special tokens).

    The tokens are cut into consecutive, non-overlapping windows of at most ``window`` tokens
    (default: the engine's ``max_model_len - 1``, room for the one sampled token); each window
    is one prompt, and its first token is context only (no prediction crosses a window edge).
    """
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    size = window or llm.engine.limits.max_model_len - 1
    if size < 2:
        raise ValueError("perplexity: window must be >= 2")
    chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
    chunks = [c for c in chunks if len(c) >= 2]
    if not chunks:
        raise ValueError("perplexity: the text has fewer than 2 tokens")
    vocab = llm.tokenizer.vocab_size
    total, count = 0.0, 0
    for chunk, logits in zip(chunks, prompt_logits(llm, chunks), strict=True):
        lp = torch.log_softmax(logits[:-1, :vocab].double(), dim=-1)
        targets = torch.tensor(chunk[1:])
        total -= float(lp.gather(1, targets[:, None]).sum())
        count += len(chunk) - 1
    return math.exp(total / count)


def prompt_set_format(path: str) -> str:
    """A prompt-set file's format from its name: ShareGPT (.json), MT-Bench (.jsonl), else
    one prompt per line (a .gz suffix is looked through)."""
    name = path.removesuffix(".gz")
    if name.endswith(".json"):
        return "sharegpt"
    return "mt_bench" if name.endswith(".jsonl") else "text"


def prompt_set_texts(path: str, count: int) -> list[str]:
    """`count` conversations spread evenly over a prompt set, each as one text: the user turns
    and (ShareGPT files that keep it) the reply that followed, joined by blank lines."""
    items = load_prompt_set(path, prompt_set_format(path)).items
    picked = [items[i * len(items) // count] for i in range(min(count, len(items)))]
    return [
        "\n\n".join([*item.turns, *([item.reference_output] if item.reference_output else [])])
        for item in picked
    ]


def check_inputs(settings: dict) -> None:
    """`run.quality`'s files, before the run: the probe reads them after the benchmark, so a
    path that is missing, a FIFO or /dev/zero, an empty text, a text that is not UTF-8 or a
    prompt set that does not parse failed the run only after all of it had run (exit 1).
    Each is read here as the probe will read it (within the size limits for data files); a
    ValueError naming the key and the file."""
    text = settings.get("text")
    if text is not None:
        try:
            if check_regular_file(text).st_size == 0:
                raise UserFileError(f"{text}: empty; the probe takes its prompts from it")
            corpus_text(text)
        except UserFileError as exc:
            raise ValueError(f"run.quality.text: {exc}") from None
    for index, path in enumerate(settings.get("prompt_sets") or []):
        field = f"prompt_sets[{index}]"
        try:
            resolved = resolve_path(field, path, section="run.quality")
        except FileNotFoundError as exc:  # named: a configuration error, not a missing run file
            raise ValueError(str(exc)) from None
        try:
            prompt_set_texts(str(resolved), 1)
        except ValueError as exc:  # UserFileError and the prompt set's own errors among them
            raise ValueError(f"run.quality.{field}: {exc}") from None


def probe_prompts(tokenizer: Any, max_model_len: int, settings: dict) -> list[list[int]]:
    """The probe's prompts: `num_prompts` windows of `prompt_len` tokens spread over the text,
    then `num_prompts` from each of `prompt_sets` cut to at most `prompt_len` tokens."""
    text = corpus_text(settings.get("text"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    length = min(int(settings.get("prompt_len", 64)), max_model_len - 1)
    count = int(settings.get("num_prompts", 8))
    stride = max(1, (len(ids) - length) // max(1, count))
    prompts = [ids[i * stride : i * stride + length] for i in range(count)]
    for index, path in enumerate(settings.get("prompt_sets") or []):
        resolved = resolve_path(f"prompt_sets[{index}]", path, section="run.quality")
        for chat in prompt_set_texts(str(resolved), count):
            tokens = tokenizer.encode(chat, add_special_tokens=False)[:length]
            if len(tokens) >= 2:
                prompts.append(tokens)
    return prompts


#: Prompts go in small chunks, so every chunk after the first attends to K/V read back from the
#: cache: the probe then sees what KV quantization costs, not only weights. Steps of 4 rows
#: multiply through the kernels decode uses (on CPU the quantized rows kernels run up to 4-12
#: rows, tiles above: engines/builtin/native/quant.py), so the probe sees decode's numerics
#: (INT8 activations, say), not only prefill's.
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 4, "kv_cache_prefault": False}


def _takes_chunked_prefill(engine_options: dict) -> bool:
    """Whether the engine's own rules take chunked prefill with these options (not with a KV
    cache that keeps no context to read back, nor with a static batch, prefilled whole)."""
    try:
        EngineConfig.from_dict({**engine_options, **CHUNKED})
    except ValueError:
        return False
    return True


def _reference_model(settings: dict, measured: str) -> str:
    """The reference's weights: `run.quality.reference_model`, else the measured model's."""
    chosen = settings.get("reference_model")
    return measured if chosen is None else model_location(chosen)


def run_quality(engine_options: dict, candidate: LLM, settings: dict) -> dict[str, float | None]:
    """The probe a run asks for with `run.quality.enabled`: the measured engine's options
    against the float32, unquantized engine on the same weights, over windows of a text and
    prompts of the `prompt_sets` (prefilled in chunks, so cached K/V is read back); perplexity
    over those prompts too when the weights are a real checkpoint (dummy weights make it
    meaningless)."""
    reference_options = {
        **engine_options,
        "model": _reference_model(settings, engine_options["model"]),
        "dtype": "float32",
        "quantization": "none",
        "quantization_activations": "float",  # int8 only goes with quantized weights
        "quantize_lm_head": False,
        "lm_head_quantization": "same",
        "kv_cache_dtype": "auto",
        "kv_cache_prefault": False,  # not timed: no need to map the whole pool up front
        # one rank: the truth has no all-reduce, and a second engine of several ranks cannot
        # start while the measured one's torch.distributed world is up (one per process)
        "tensor_parallel_size": 1,
    }
    # For the same reason a tensor-parallel candidate is the measured engine itself, its
    # prompts prefilled whole rather than in chunks.
    tensor_parallel = engine_options.get("tensor_parallel_size", 1) > 1
    if not tensor_parallel and _takes_chunked_prefill(engine_options):
        reference_options.update(CHUNKED)
        candidate = LLM(**{**engine_options, **CHUNKED})
    reference = LLM(**reference_options)
    prompts = probe_prompts(candidate.tokenizer, candidate.engine.limits.max_model_len, settings)
    result = quality_probe(reference, candidate, prompts, float(settings.get("min_margin", 0.1)))
    out: dict[str, float | None] = {
        "top1_agreement": result["top1_agreement"],
        "kl_mean": result["kl_mean"],
        "max_abs_logit_error": result["max_abs_logit_error"],
        "quality_positions": result["counted_positions"],
    }
    if candidate.engine.weights_source == "checkpoint":
        # over the probe's prompts, from the logits just compared (a whole-text pass in
        # 16-token chunks takes minutes on a real model): comparable between variants, and
        # it sees the KV cache read back as the probe does
        out["perplexity"] = result["perplexity"]
    return out


@runtime_checkable
class LogitsBackend(Protocol):
    """A backend the probe can read without the built-in engine's logits observer: it gives
    float32 logits at every prompt position itself (engine=llamacpp)."""

    tokenizer: Any

    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]: ...

    def describe(self) -> dict[str, Any]: ...


def run_quality_of_backend(backend: LogitsBackend, settings: dict) -> dict[str, float | None]:
    """`run.quality` for a backend with `prompt_logits`: its logits against the built-in
    engine's float32, unquantized ones on the same model file (describe()['model']), over the
    probe's prompts, the reference prefilling in 16-token chunks as in `run_quality`; perplexity
    too (a GGUF file holds real weights)."""
    facts = backend.describe()
    max_model_len = int(facts["max_model_len"])
    reference = LLM(
        model=_reference_model(settings, str(facts["model"])),
        dtype="float32",
        quantization="none",  # a quantized file's own weights, dequantized
        max_model_len=max_model_len,
        max_num_seqs=8,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        kv_cache_prefault=False,
    )
    vocab = backend.tokenizer.vocab_size
    if reference.tokenizer.vocab_size != vocab:
        raise ValueError("quality probe: the reference's tokenizer is not the backend's")
    prompts = probe_prompts(backend.tokenizer, max_model_len, settings)
    result = compare_logits(
        prompt_logits(reference, prompts),
        backend.prompt_logits(prompts),
        prompts,
        vocab,
        float(settings.get("min_margin", 0.1)),
    )
    return {
        "top1_agreement": result["top1_agreement"],
        "kl_mean": result["kl_mean"],
        "max_abs_logit_error": result["max_abs_logit_error"],
        "quality_positions": result["counted_positions"],
        "perplexity": result["perplexity"],
    }


class EngineBackend(Protocol):
    """A backend whose `capabilities.quality_probe` is "engine": the built-in engine it loaded
    and the options it was built from."""

    config: EngineConfig
    engine: LLMEngine | None


class QualityTracker(Tracker):
    """`run.quality`: once the measured requests have ended, the backend's logits against the
    float32, unquantized built-in engine's on the same weights (summary.json's `quality`), as
    the backend's `capabilities.quality_probe` says it can be read; a backend that declares no
    way is not probed."""

    name = "quality"

    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.result: dict[str, float | None] | None = None

    @classmethod
    def from_config(cls, settings: dict) -> QualityTracker | None:
        """The probe `run.quality.enabled` asks for, its files checked now (check_inputs)."""
        if not settings.get("enabled"):
            return None
        check_inputs(settings)
        return cls(settings)

    def stop(self, backend: Backend, engine: dict[str, Any]) -> None:
        probe = backend.capabilities.quality_probe
        if probe == "engine":
            held = cast(EngineBackend, backend)
            assert held.engine is not None  # loaded before the measured requests
            self.result = run_quality(
                held.config.to_dict(), LLM.from_engine(held.engine), self.settings
            )
        elif probe == "prompt_logits":
            # against the built-in engine's float32 on the same model file
            self.result = run_quality_of_backend(cast(LogitsBackend, backend), self.settings)

    def results(self, run_dir: Path, t0_ns: int | None) -> dict[str, Any]:
        return {} if self.result is None else {"quality": self.result}
