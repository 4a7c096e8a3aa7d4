"""What the server tests share: the built-in engine options of their `model=tiny` server (small
and quick to load; paged KV, float32 for exact comparisons with the engine run in process),
a prompt, and the two completion routes."""

from __future__ import annotations

from typing import Any

OPTIONS: dict[str, Any] = dict(
    dtype="float32",
    device="cpu",
    max_model_len=256,
    max_num_seqs=8,
    kv_cache="paged",
    kv_cache_memory_bytes=2 << 20,
)
PROMPT = "The quick brown fox jumps over"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
