"""Options of `engine=hf`, validated once at the edge like the built-in engine's."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from engines.base import ConfigError
from models.dtypes import DTYPE_ALIASES
from models.location import model_location

MODES = ("generate", "generate_batch")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class HFConfig:
    # a built-in preset (its dummy weights), a packaged model, a checkpoint folder or .gguf file
    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    seed: int = 0  # the dummy weights' seed: the same as the built-in engine's
    device: str = "auto"
    num_threads: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256  # the batch size cap, equal to the engine it is compared with
    # generate: static batches padded on the left, run to completion (HF `generate`).
    # generate_batch: transformers' own continuous batching (`init_continuous_batching`).
    mode: str = "generate"
    attn_implementation: str = "sdpa"
    block_size: int = 32  # generate_batch: tokens per KV page

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> HFConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"engine (backend=hf): unknown option(s) {unknown}; known options: {sorted(known)}"
            )
        return cls(**values).validate()

    def validate(self) -> HFConfig:
        def bad(name: str, allowed: str) -> ConfigError:
            return ConfigError(
                f"engine.{name}: {getattr(self, name)!r} is invalid; allowed: {allowed}"
            )

        self.model = model_location(self.model)  # a trained or packaged model's location
        if self.mode not in MODES:
            raise bad("mode", "|".join(MODES))
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise bad("attn_implementation", "|".join(ATTN_IMPLEMENTATIONS))
        if self.dtype not in DTYPE_ALIASES:
            raise bad("dtype", "|".join(DTYPE_ALIASES))
        self.dtype = DTYPE_ALIASES[self.dtype]
        if not (self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:")):
            raise bad("device", "auto|cpu|cuda|cuda:N")
        for name, low in (
            ("max_num_seqs", 1),
            ("block_size", 1),
            ("max_model_len", 2),
            ("num_threads", 1),
            ("seed", None),
        ):
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "num_threads"):
                continue
            # bool is an int to Python; "abc" < 2 would be a TypeError naming nothing
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or (low is not None and value < low)
            ):
                optional = "null or " if name in ("max_model_len", "num_threads") else ""
                raise bad(name, f"{optional}an integer" + (f" >= {low}" if low else ""))
        return self
