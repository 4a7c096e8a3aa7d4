"""The Llama-family decoder (Llama, Mistral, Qwen2) as a plain nn.Module over a packed batch.

Shapes: the step's new tokens are packed into one dimension T (no batch padding). Q, K and V
come from one fused projection, gate and up from another; the loader fills them from the
checkpoint's separate tensors. Attention writes this step's K/V into the layer's cache, then
reads the context back through the attention backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin.attention import AttentionMetadata, DenseAttention
from engines.builtin.kv_cache import LayerKVCache
from engines.builtin.layers.linear import Linear, LinearMethod
from engines.builtin.layers.norm import RMSNorm
from engines.builtin.layers.rotary import RotaryEmbedding, Rotation, apply_rotary
from engines.builtin.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearMethod, backend: DenseAttention) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, linear,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, linear)
        self.backend = backend
        self.cache: LayerKVCache | None = None  # set by the model runner

    def forward(self, x: torch.Tensor, rotation: Rotation,
                meta: AttentionMetadata) -> torch.Tensor:
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rotary(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim),
                          rotation)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        cache = self.cache if meta.use_cache else None
        if cache is not None:
            if meta.write_index is None:
                cache.write(k, v, meta.slot_mapping)
            else:
                index = meta.write_index
                cache.write(k[index], v[index], meta.slot_mapping[index])
        out = self.backend(q, k, v, cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearMethod) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, linear)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearMethod, backend: DenseAttention) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, linear, backend)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, linear)

    def forward(self, x: torch.Tensor, rotation: Rotation,
                meta: AttentionMetadata) -> torch.Tensor:
        """`rotation`: this step's RoPE factors, shared by every layer."""
        x = x + self.attn(self.input_norm(x), rotation, meta)
        return x + self.mlp(self.post_attn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearMethod, backend: DenseAttention,
                 max_positions: int, device: torch.device,
                 lm_head_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _freeze=True)
        # Built on `device` even when the rest is created on "meta" and filled by the loader.
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                    cfg.rope_scaling, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, linear, backend)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied models multiply by the embedding table instead (see compute_logits).
        # `lm_head_method`: how the LM head is kept (None: like the other linear layers).
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, linear if lm_head_method is None else lm_head_method)
        for name, module in self.linear_layers().items():
            module.name = name

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]."""
        x = self.embed(input_ids)
        rotation = self.rope.rotation(meta.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotation, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed.weight)
        return self.lm_head(hidden)

    def linear_layers(self) -> dict[str, Linear]:
        return {name: m for name, m in self.named_modules() if isinstance(m, Linear)}

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights: all of them, the blocks' linear layers, embedding, LM head."""
        linear = sum(m.weight_bytes() for name, m in self.linear_layers().items()
                     if name.startswith("layers."))
        embed = self.embed.weight.numel() * self.embed.weight.element_size()
        head = embed if self.lm_head is None else self.lm_head.weight_bytes()
        norms = sum(p.numel() * p.element_size() for n, p in self.named_parameters()
                    if "norm" in n)
        total = linear + embed + norms + (0 if self.lm_head is None else head)
        return {"weight_bytes": total, "linear_weight_bytes": linear,
                "embedding_bytes": embed, "lm_head_bytes": head}
