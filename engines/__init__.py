"""Inference engines: the built-in one (engines.builtin), Hugging Face transformers in
process (engines.hf) and any OpenAI-compatible server (engines.openai)."""

from engines.openmp import choose_wait_policy

# first, before any engine imports torch: its OpenMP runtime reads the policy once, at load
choose_wait_policy()
