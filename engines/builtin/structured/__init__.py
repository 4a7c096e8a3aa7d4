"""Structured outputs in the built-in engine: a grammar backend (the plug point,
`engine.structured_output_backend`) compiles each request's constraint; the manager keeps one
matcher per sequence, masks the logits of the rows that have one before sampling, and advances
them with every accepted token (docs/structured_output.md)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from engines.builtin.structured.backend import GrammarBackend, Matcher
from engines.builtin.structured.manager import StructuredOutputs
from engines.registry import Registry
from models.tokenizer import Tokenizer

#: name -> a factory of the backend for (tokenizer, vocabulary size, stop token ids)
BackendFactory = Callable[[Tokenizer, int, list[int]], GrammarBackend]
STRUCTURED_OUTPUT_BACKENDS = Registry[BackendFactory](
    "engine.structured_output_backend", extra_values=("auto", "none")
)


@STRUCTURED_OUTPUT_BACKENDS.register("xgrammar")
def _xgrammar(tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]) -> GrammarBackend:
    """Imported on first use: the package works where xgrammar is not installed."""
    from engines.builtin.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, stop_ids)


def resolve_structured_output_backend(name: str) -> str:
    """`auto`: xgrammar where it is installed, else none. A named backend is taken as asked
    (building it says if it is missing)."""
    if name != "auto":
        return name
    return "xgrammar" if importlib.util.find_spec("xgrammar") is not None else "none"


def build_structured_outputs(
    name: str, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]
) -> StructuredOutputs | None:
    """The manager of backend `name` (already resolved from auto); None for none."""
    if name == "none":
        return None
    return StructuredOutputs(STRUCTURED_OUTPUT_BACKENDS.get(name)(tokenizer, vocab_size, stop_ids))


__all__ = [
    "STRUCTURED_OUTPUT_BACKENDS",
    "GrammarBackend",
    "Matcher",
    "StructuredOutputs",
    "build_structured_outputs",
    "resolve_structured_output_backend",
]
