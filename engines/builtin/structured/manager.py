"""The engine's structured outputs: compiled constraints cached by their text, a matcher per
sequence, the step's mask over the rows that have one, and what it all cost."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq

import torch

from engines.builtin.sequence import Sequence
from engines.builtin.structured.backend import GrammarBackend, Matcher
from engines.structured_outputs import StructuredOutputsParams

#: Compiled constraints kept (3000 distinct schemas held 750 MB when nothing was evicted)
COMPILE_CACHE_SIZE = 256


class StructuredOutputs:
    """`compile` may run on any thread (a server compiles while it checks a request, off the
    step loop); `matcher`, `mask` and `accept` run on the engine's."""

    def __init__(self, backend: GrammarBackend) -> None:
        self.backend = backend
        # least recently used first; bounded, since every distinct schema adds one
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        # cumulative: compilations, their time, lookups the cache answered; per step: the
        # rows masked and the time the mask took (filling the bitmask and applying it)
        self.num_compiles = 0
        self.compile_ns = 0
        self.cache_hits = 0
        self.last_mask_rows = 0
        self.last_mask_ns = 0
        # compile time of constraints compiled but not yet claimed by the request they were
        # compiled for (the first request to claim one paid for it; later ones hit the cache)
        self._unclaimed: dict[tuple[str, str], int] = {}

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled constraint, compiled once per distinct text. ValueError naming the
        field when the backend cannot compile it."""
        key = (params.kind, params.spec)
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
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
            took = time.perf_counter_ns() - start
            self.num_compiles += 1
            self.compile_ns += took
            self._unclaimed[key] = took
            self._compiled[key] = compiled
            while len(self._compiled) > COMPILE_CACHE_SIZE:
                evicted, _ = self._compiled.popitem(last=False)
                self._unclaimed.pop(evicted, None)
        return compiled

    def matcher(self, params: StructuredOutputsParams) -> tuple[Matcher, int, bool]:
        """A new matcher of the constraint, the compile time the request paid (its first
        user), and whether the cache answered instead."""
        matcher = self.backend.matcher(self.compile(params))
        with self._lock:
            took = self._unclaimed.pop((params.kind, params.spec), None)
        return matcher, took or 0, took is None

    def mask(
        self, logits: torch.Tensor, seqs: Seq[Sequence], drafts: Seq[Seq[int]]
    ) -> torch.Tensor:
        """The logits (one row per sequence, and one more per draft of its speculative
        proposal, `drafts`) with every row of a sequence that has a grammar masked to the
        tokens it allows there: a draft's row as if the drafts before it were accepted (the
        matcher advanced through them, then rolled back). A copy; the raw logits stay for
        logprobs. The logits themselves when no sequence has a grammar."""
        guided: list[int] = []
        first = 0
        starts = []
        for seq, own in zip(seqs, drafts, strict=True):
            starts.append(first)
            if seq.grammar is not None:
                guided += range(first, first + len(own) + 1)
            first += len(own) + 1
        self.last_mask_rows = len(guided)
        if not guided:
            return logits
        start = time.perf_counter_ns()
        bitmask = self.backend.allocate_bitmask(first)
        for seq, own, row in zip(seqs, drafts, starts, strict=True):
            if seq.grammar is not None:
                _fill_through_drafts(seq.grammar, own, bitmask, row)
        masked = logits.float().clone()
        self.backend.apply_bitmask(masked, bitmask, guided)
        self.last_mask_ns = time.perf_counter_ns() - start
        return masked


def _fill_through_drafts(
    grammar: Matcher, drafts: Seq[int], bitmask: torch.Tensor, row: int
) -> None:
    """Rows row..row+len(drafts): the mask at the sequence's next position, then at each
    draft's next, the matcher advanced through the drafts and rolled back after. Past a draft
    the grammar refuses, the rows keep the last mask: that draft's own row rejects it (its
    probability is 0 there), so verification never reads them."""
    accepted = 0
    for j in range(len(drafts) + 1):
        grammar.fill_mask(bitmask, row + j)
        if j == len(drafts) or not grammar.accept(drafts[j]):
            for rest in range(j + 1, len(drafts) + 1):
                bitmask[row + rest] = bitmask[row + j]
            break
        accepted += 1
    if accepted:
        grammar.rollback(accepted)
