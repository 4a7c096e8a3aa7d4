"""`engine.speculative_config`, with vLLM's names, validated once at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from engines.base import ConfigError

# The registered proposers' names (spec_decode/methods.py; a test keeps the two equal), checked
# here because the configuration is validated before any engine module is loaded.
METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # a registered proposer: ngram | draft_model
    num_speculative_tokens: int  # k: tokens proposed, and verified by one target pass
    # ngram: the longest and shortest suffix of the sequence looked up earlier in it
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model: a preset, packaged model or checkpoint sharing the target's tokenizer, with
    # its own dtype and quantization (None: the target's)
    model: str | None = None
    dtype: str | None = None
    quantization: str | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(values, SpeculativeConfig):
            return values.validate()
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
        return cls(**dict(values)).validate()

    def validate(self) -> SpeculativeConfig:
        def fail(key: str, allowed: str) -> ConfigError:
            return ConfigError(
                f"engine.speculative_config.{key}: {getattr(self, key)!r} is invalid; "
                f"allowed: {allowed}"
            )

        if self.method not in METHODS:
            raise fail("method", "|".join(METHODS))
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(key, "an integer >= 1")
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
                    raise fail(key, "null with method=ngram (it has no draft model)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
