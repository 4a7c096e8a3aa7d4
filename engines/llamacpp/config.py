"""Options of `engine=llamacpp`, checked once at the edge like the other backends'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.base import ConfigError
from engines.options import Options, option
from models.gguf_quantize import DERIVED_TYPES
from models.location import model_location

FLASH_ATTN = ("auto", "on", "off")


@dataclass(frozen=True)
class LlamaCppConfig(Options):
    error = ConfigError
    section = "engine (backend=llamacpp)"

    # the model group fills these three: a GGUF file (model=smollm2-135m, or model=hf
    # model.path=FILE.gguf); llama.cpp reads its own config and weights from the file
    model: str = option("smollm2-135m", help="a GGUF file or a packaged GGUF model")
    model_overrides: dict[str, Any] = option(
        default_factory=dict, help="none allowed: llama.cpp reads the GGUF file's config"
    )
    tokenizer: str | None = option(None, help="null: the GGUF file's own tokenizer")
    gguf_type: str | None = option(
        None,
        choices=DERIVED_TYPES,
        help="null: run the file as it is; else its tensors re-encoded to that type "
        "(dequantized from the file, so the same weights; the K-quant mixes by llama.cpp's "
        "quantizer from its F16 re-encoding), converted once into the cache",
    )
    num_threads: int | None = option(
        None,
        ge=1,
        help="None: torch's thread count, the one the built-in engine runs with by default, so "
        "the two compute with the same number of cores",
    )
    num_threads_batch: int | None = option(None, ge=1, help="prompt processing; None: num_threads")
    max_num_seqs: int = option(
        8,
        ge=1,
        help="sequences decoded together (continuous batching over llama.cpp's per-sequence "
        "KV); each holds max_model_len KV cells of its own",
    )
    max_model_len: int | None = option(
        None, ge=2, help="None: min(the model's training context, 2048)"
    )
    max_num_batched_tokens: int = option(
        512,
        ge=1,
        help="tokens per llama_decode call (prompts longer than what is left go in chunks), "
        "and llama.cpp's n_batch = n_ubatch; at least max_num_seqs",
    )
    flash_attn: str = option(
        "auto", choices=FLASH_ATTN, help="llama.cpp's own default (auto: on for the CPU)"
    )
    seed: int = option(0, help="sampling seed of requests that set none (SamplingParams.seed)")

    def _normalise(self) -> None:
        self._set("model", model_location(self.model))  # a packaged model's file

    def _check_together(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise self.invalid(
                "max_num_batched_tokens",
                f"an integer >= max_num_seqs={self.max_num_seqs} (one decode token per sequence)",
            )
        if self.model_overrides:
            raise ConfigError(
                f"model.overrides: {self.model_overrides!r} is invalid with engine=llamacpp; "
                "allowed: {} (llama.cpp reads the model's config from the GGUF file)"
            )
        if self.tokenizer is not None:
            raise ConfigError(
                f"model.tokenizer: {self.tokenizer!r} is invalid with engine=llamacpp; allowed: "
                "null (the GGUF file's own tokenizer)"
            )
