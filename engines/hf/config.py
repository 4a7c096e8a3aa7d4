"""Options of `engine=hf`, checked once at the edge like the built-in engine's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.base import ConfigError
from engines.options import Options, is_device, option
from models.dtypes import DTYPE_ALIASES
from models.location import model_location

MODES = ("generate", "generate_batch")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class HFConfig(Options):
    error = ConfigError
    section = "engine (backend=hf)"

    model: str = option(
        "tiny",
        help="a built-in preset (its dummy weights), a packaged model, a checkpoint folder or "
        ".gguf file",
    )
    model_overrides: dict[str, Any] = option(
        default_factory=dict, help="any ModelConfig field, e.g. {num_kv_heads: 1}"
    )
    tokenizer: str | None = option(None, help="None: the checkpoint's tokenizer")
    dtype: str = option(
        "auto", aliases=DTYPE_ALIASES, help="auto: float32 on CPU, bfloat16 on CUDA"
    )
    seed: int = option(0, help="the dummy weights' seed: the same as the built-in engine's")
    device: str = option(
        "auto", valid=is_device, allowed="auto|cpu|cuda|cuda:N", help="auto | cpu | cuda:N"
    )
    num_threads: int | None = option(None, ge=1, help="CPU threads; None: torch's default")
    max_model_len: int | None = option(None, ge=2, help="None: the model's max_position_embeddings")
    max_num_seqs: int = option(
        256, ge=1, help="the batch size cap, equal to the engine it is compared with"
    )
    mode: str = option(
        "generate",
        choices=MODES,
        help="generate: static batches padded on the left, run to completion (HF `generate`); "
        "generate_batch: transformers' own continuous batching (`init_continuous_batching`)",
    )
    attn_implementation: str = option(
        "sdpa", choices=ATTN_IMPLEMENTATIONS, help="transformers' attention"
    )
    block_size: int = option(32, ge=1, help="generate_batch: tokens per KV page")

    def _normalise(self) -> None:
        self._set("model", model_location(self.model))  # a trained or packaged model's location
