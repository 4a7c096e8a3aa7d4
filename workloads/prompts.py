"""Prompt token sources: random non-special token ids, or windows of a text corpus's tokens.

Both hand out token ids; `render` turns them into what the request carries: the ids themselves
(random_ids: exact lengths), their decoded text (text: the engine re-tokenizes, so the length
it sees can differ by a token or two at window edges), or a chat asking to repeat that text
(repeat: the output overlaps the prompt, what speculative decoding's n-gram lookup feeds on;
the instruction and the chat template add a few dozen tokens to the window's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from models.tokenizer import CORPUS_DIR, Tokenizer, default_tokenizer
from workloads.trace_files import read_text

DEFAULT_CORPUS = CORPUS_DIR / "sonnets.txt"
PROMPT_KINDS = ("random_ids", "text", "repeat")
REPEAT_INSTRUCTION = "Repeat the following text exactly, and nothing else:\n\n"


def tokenizer_or_default(tokenizer: Tokenizer | None) -> Tokenizer:
    """Backends without a tokenizer (None) get the project's default one."""
    return tokenizer if tokenizer is not None else default_tokenizer()


class TokenSource:
    """Draws prompt token ids of exact lengths for one prompt kind."""

    def __init__(self, tokenizer: Tokenizer, kind: str, corpus: Path | None = None) -> None:
        self.tokenizer = tokenizer
        self.kind = kind
        self.corpus_path = corpus or DEFAULT_CORPUS
        # Random prompts avoid special ids, which would change what the prompt means.
        self.allowed = np.setdiff1d(
            np.arange(tokenizer.vocab_size), np.array(sorted(tokenizer.special_ids), dtype=np.int64)
        )
        self._corpus: np.ndarray | None = None
        self._corpus_len = 0
        self._starts = np.zeros(1, dtype=np.int64)

    def tokens(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n token ids: uniform over the non-special vocabulary, or a random corpus window."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        if self.kind == "random_ids":
            return rng.choice(self.allowed, size=n)
        corpus = self._corpus_ids(n)
        start = int(rng.choice(self._starts))  # any word start: the corpus is tiled
        return corpus[start : start + n]

    def render(self, ids: np.ndarray | list[int]) -> list[int] | str | list[dict[str, str]]:
        # tolist() gives Python ints in one C loop: millions of ids for long traces.
        values: list[int] = np.asarray(ids, dtype=np.int64).tolist()
        if self.kind == "random_ids":
            return values
        text = self.tokenizer.decode(values)
        if self.kind == "repeat":
            return [{"role": "user", "content": REPEAT_INSTRUCTION + text}]
        return text

    def _corpus_ids(self, n: int) -> np.ndarray:
        if self._corpus is None:
            text = read_text(self.corpus_path)  # .gz too; binary or non-UTF-8: named
            ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
            if len(ids) == 0:
                raise ValueError(f"workload.corpus: {self.corpus_path} holds no text")
            self._corpus, self._corpus_len = ids, len(ids)
            self._starts = self._word_starts(ids)
        # Tile the corpus so a window of n tokens fits from every start (long prompts wrap).
        while len(self._corpus) < self._corpus_len + n:
            self._corpus = np.concatenate([self._corpus, self._corpus[: self._corpus_len]])
        return self._corpus

    def _word_starts(self, ids: np.ndarray) -> np.ndarray:
        """Positions where a word begins, so windows do not open with a word fragment."""
        text = {int(t): self.tokenizer.decode([int(t)]) for t in np.unique(ids)}
        opens = np.array([text[int(t)][:1].isspace() for t in ids])
        closes = np.array([text[int(t)][-1:].isspace() for t in ids])
        starts = np.flatnonzero(opens | np.roll(closes, 1))  # roll: the corpus wraps around
        return starts if len(starts) else np.arange(len(ids))


class BlockTokens:
    """Token blocks keyed by an id (a Mooncake hash id): the same id always yields the same
    tokens for a given workload seed, so requests sharing leading ids share that prefix."""

    def __init__(self, source: TokenSource, seed: int, block_len: int) -> None:
        self.source = source
        self.seed = seed
        self.block_len = block_len
        self._cache: dict[int, np.ndarray] = {}

    def block(self, block_id: int) -> np.ndarray:
        if block_id not in self._cache:
            # Seeded by (workload seed, block id) alone: independent of which request or in
            # what order the block is first met.
            rng = np.random.default_rng([self.seed, block_id])
            self._cache[block_id] = self.source.tokens(self.block_len, rng)
        return self._cache[block_id]

    def prompt(
        self, block_ids: tuple[int, ...], length: int, rng: np.random.Generator
    ) -> np.ndarray:
        """The blocks in order, truncated to `length`; if rounding left them short, the tail
        is filled with tokens from `rng` (unique to the request)."""
        needed = -(-length // self.block_len)
        parts: list[Any] = [self.block(b) for b in block_ids[:needed]]
        have = sum(len(p) for p in parts)
        if have < length:
            parts.append(self.source.tokens(length - have, rng))
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return ids[:length]
