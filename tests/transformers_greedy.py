"""transformers' greedy continuation step by step with its cache, past EOS as the engine's
ignore_eos continues (generate's min_new_tokens would instead forbid EOS, another continuation):
the reference of the tests that run a real checkpoint in both."""

from __future__ import annotations

import torch


def hf_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    out: list[int] = []
    past, step_input = None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            result = model(step_input, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step_input = torch.tensor([[out[-1]]])
    return out
