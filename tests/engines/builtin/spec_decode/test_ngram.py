"""Prompt-lookup proposals against a plain-Python reference."""

from __future__ import annotations

import random

from engines.builtin.spec_decode.ngram import lookup


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_longest_latest_match_proposes_what_followed_it() -> None:
    tokens = [7, 8, 9, 1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 8, 1, 2, 3]
    assert lookup(tokens, 1, 3, 2) == [6, 7]  # "1 2 3" last seen before "6 7"
    assert lookup(tokens, 1, 3, 10) == [6, 7, 8, 1, 2, 3]  # up to the end, never past it
    assert lookup([4, 5, 6], 1, 3, 4) == []  # nothing recurs
    assert lookup([5, 5], 1, 1, 3) == [5]
    assert lookup([1, 2, 3, 1, 2], 3, 3, 2) == []  # too short a match for min_n
    assert lookup([1, 2, 1], 1, 4, 0) == [] and lookup([], 1, 2, 3) == []


def test_matches_the_reference_on_random_sequences() -> None:
    """Ids across byte boundaries too: a byte-level match that does not start on a token
    boundary must not count."""
    rng = random.Random(0)
    for trial in range(3000):
        vocab = rng.choice([2, 3, 5, 300, 70_000, 2**31 - 1])
        pool = [rng.randrange(vocab) for _ in range(4)] + [256, 1, 65_536, 16_777_216]
        tokens = [rng.choice(pool) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(0, 6)
        assert lookup(tokens, min_n, max_n, k) == reference(tokens, min_n, max_n, k), (
            trial,
            tokens,
        )
