"""What a model is, shared by every backend, the workloads and the harness: its architecture
(config.py: ModelConfig, the presets, Hugging Face config.json), its tokenizer, its weight files
(weights.py: safetensors checkpoints, seeded dummy weights under Hugging Face names; gguf.py:
llama.cpp's GGUF files), dtype names and the on-disk cache. Nothing here runs a model;
engines/ do."""
