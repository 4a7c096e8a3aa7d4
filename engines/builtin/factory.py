"""The engine factory: every place that builds an engine from a config (LLM, BuiltinBackend)
goes through `build_engine`, so an option that picks the engine's class works wherever it can
be set."""

from __future__ import annotations

from typing import Any

from engines.builtin.config import EngineConfig
from engines.builtin.disaggregation.router import DisaggregatedEngine
from engines.builtin.engine import LLMEngine
from engines.builtin.planted_slowdown import SlowedEngine


def build_engine(config: EngineConfig) -> Any:
    """The engine `config` asks for: the plain LLMEngine, the disaggregated one (prefill and
    decode instances behind the same methods, engine.disaggregation=pd), or the planted
    slowdown's (a test instrument, engine.debug_step_delay_fraction > 0)."""
    if config.disaggregation == "pd":
        return DisaggregatedEngine(config)
    if config.debug_step_delay_fraction > 0:
        return SlowedEngine(config)
    return LLMEngine(config)
