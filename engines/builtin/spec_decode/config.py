"""`engine.speculative_config`, with vLLM's names, checked once at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from engines.base import ConfigError
from engines.options import Options, option


@dataclass(frozen=True)
class SpeculativeConfig(Options):
    prefix = "engine.speculative_config."
    error = ConfigError

    method: str = option(
        registry="engines.builtin.spec_decode.methods:PROPOSERS",
        help="a registered proposer: ngram | draft_model",
    )
    num_speculative_tokens: int = option(
        ge=1, help="k: tokens proposed, and verified by one target pass"
    )
    prompt_lookup_max: int = option(
        4, ge=1, help="ngram: the longest suffix of the sequence looked up earlier in it"
    )
    prompt_lookup_min: int = option(2, ge=1, help="ngram: the shortest such suffix")
    model: str | None = option(
        None,
        help="draft_model: a preset, packaged model or checkpoint sharing the target's tokenizer",
    )
    dtype: str | None = option(None, help="draft_model: its dtype (None: the target's)")
    quantization: str | None = option(
        None, help="draft_model: its quantization (None: the target's)"
    )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"engine.speculative_config: {values!r} is invalid; allowed: null or a mapping "
                "with method and num_speculative_tokens"
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"engine.speculative_config: unknown key(s) {unknown}; allowed: {known}"
            )
        for key in ("method", "num_speculative_tokens"):
            if key not in values:
                raise ConfigError(f"engine.speculative_config.{key}: missing (required)")
        return cls(**dict(values))

    def _check_together(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"engine.speculative_config.prompt_lookup_min: {self.prompt_lookup_min} is "
                f"larger than prompt_lookup_max={self.prompt_lookup_max}; allowed: "
                f"1..{self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ConfigError(
                "engine.speculative_config.model: missing; method=draft_model needs a draft "
                "model (a preset, a packaged model or a checkpoint sharing the target's "
                "tokenizer)"
            )
        if self.method == "ngram":
            for key in ("model", "dtype", "quantization"):
                if getattr(self, key) is not None:
                    raise self.invalid(key, "null with method=ngram (it has no draft model)")
