"""`engine=openai`: the harness's client for any OpenAI-compatible server (docs/backends.md)."""
