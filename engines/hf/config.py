"""Options of `engine=hf`, validated once at the edge like the built-in engine's."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from engines.builtin.config import DTYPE_ALIASES, ConfigError

MODES = ("generate", "generate_batch")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class HFConfig:
    model: str = "tiny"  # a built-in preset (its dummy weights) or a checkpoint folder
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
            raise ConfigError(f"engine (backend=hf): unknown option(s) {unknown}; "
                              f"known options: {sorted(known)}")
        return cls(**values).validate()

    def validate(self) -> HFConfig:
        def bad(name: str, allowed: str) -> ConfigError:
            return ConfigError(f"engine.{name}: {getattr(self, name)!r} is invalid; "
                               f"allowed: {allowed}")

        if self.mode not in MODES:
            raise bad("mode", "|".join(MODES))
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise bad("attn_implementation", "|".join(ATTN_IMPLEMENTATIONS))
        if self.dtype not in DTYPE_ALIASES:
            raise bad("dtype", "|".join(DTYPE_ALIASES))
        self.dtype = DTYPE_ALIASES[self.dtype]
        for name in ("max_num_seqs", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "null or an integer >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise bad("num_threads", "null or an integer >= 1")
        return self
