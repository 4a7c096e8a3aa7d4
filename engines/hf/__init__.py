"""Hugging Face transformers, in process, behind the harness's Backend interface."""
