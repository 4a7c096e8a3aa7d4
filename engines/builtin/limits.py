"""EngineLimits: the engine's size limits, resolved once from the config, the model and the KV
pool, and handed to the scheduler and the model runner (which size their plans and buffers by
them)."""

from __future__ import annotations

from dataclasses import dataclass

from engines.builtin.config import EngineConfig
from models.config import ModelConfig

#: max_num_batched_tokens when chunked prefill is on and none is given: vLLM v1's default for
#: online serving, which bounds how long a step (and so a running decode) can stall.
DEFAULT_CHUNKED_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    max_num_seqs: int  # after KV sizing: contiguous KV has at most one sequence per slot
    max_num_batched_tokens: int
    kv_budget_bytes: int


def token_limits(config: EngineConfig, model_config: ModelConfig) -> tuple[int, int]:
    """(max_model_len, max_num_batched_tokens): the options or their defaults, checked against
    the model and each other. Known before the KV pool is sized (which needs the model)."""
    max_model_len = config.max_model_len or model_config.max_positions
    if max_model_len > model_config.max_positions:
        raise ValueError(
            f"engine.max_model_len={max_model_len} exceeds the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}"
            + (
                f" (x the dynamic rope scaling's factor: {model_config.max_positions})"
                if model_config.max_positions != model_config.max_position_embeddings
                else ""
            )
        )
    if config.enable_chunked_prefill:  # prompts longer than the budget are split
        batched = config.max_num_batched_tokens or DEFAULT_CHUNKED_BATCHED_TOKENS
    else:
        batched = config.max_num_batched_tokens or max(max_model_len, 2048)
    if batched < max_model_len and not config.enable_chunked_prefill:
        raise ValueError(
            f"engine.max_num_batched_tokens={batched} is smaller than "
            f"engine.max_model_len={max_model_len}; without chunked prefill a whole "
            "prompt must fit in one step"
        )
    return max_model_len, batched
