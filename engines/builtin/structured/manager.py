"""The engine's structured outputs: compiled constraints cached by their text, a matcher per
sequence, the step's mask over the rows that have one, and what it all cost."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence as Seq

import torch

from engines.builtin.sequence import Sequence
from engines.builtin.structured.backend import GrammarBackend, Matcher
from engines.structured_outputs import StructuredOutputsParams


class StructuredOutputs:
    """`compile` may run on any thread (a server compiles while it checks a request, off the
    step loop); `matcher`, `mask` and `accept` run on the engine's."""

    def __init__(self, backend: GrammarBackend) -> None:
        self.backend = backend
        self._compiled: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        # cumulative: compilations, their time, lookups the cache answered; per step: the
        # rows masked and the time the mask took (filling the bitmask and applying it)
        self.num_compiles = 0
        self.compile_ns = 0
        self.cache_hits = 0
        self.last_mask_rows = 0
        self.last_mask_ns = 0

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled constraint, compiled once per distinct text. ValueError naming the
        field when the backend cannot compile it."""
        key = (params.kind, params.spec)
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self.cache_hits += 1
                return found
        start = time.perf_counter_ns()
        try:
            compiled = self.backend.compile(params)
        except ValueError as exc:
            raise ValueError(
                f"SamplingParams.structured_outputs.{params.kind}: {self.backend.name} cannot "
                f"compile it: {exc}"
            ) from None
        with self._lock:
            self.num_compiles += 1
            self.compile_ns += time.perf_counter_ns() - start
            self._compiled[key] = compiled
        return compiled

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        return self.backend.matcher(self.compile(params))

    def mask(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """The logits with every row that has a grammar masked to the tokens it allows next
        (a copy; the raw logits stay for logprobs); the logits themselves when none has."""
        rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        self.last_mask_rows = len(rows)
        if not rows:
            self.last_mask_ns = 0
            return logits
        start = time.perf_counter_ns()
        bitmask = self.backend.allocate_bitmask(len(seqs))
        for row in rows:
            grammar = seqs[row].grammar
            assert grammar is not None
            grammar.fill_mask(bitmask, row)
        masked = logits.float().clone()
        self.backend.apply_bitmask(masked, bitmask, rows)
        self.last_mask_ns = time.perf_counter_ns() - start
        return masked
