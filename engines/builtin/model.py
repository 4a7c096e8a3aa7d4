"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3; with mixture-of-experts MLPs
Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE: moe.py; with Gemma 2/3's sandwich norms, GeGLU, scaled
embeddings, soft caps and sliding-window layers between global ones) as a plain nn.Module over
a packed batch.

Shapes: the step's new tokens are packed into one dimension T (no batch padding). Q, K and V
come from one fused projection, gate and up from another; the loader fills them from the
checkpoint's separate tensors. Attention writes this step's K/V into the layer's cache, then
reads the context back through the attention backend.

Under tensor parallelism (distributed/shard.py) each rank builds the same modules at its
shard's sizes (its heads, its slice of the MLP and of the vocabulary); the model's only other
concession is one `tp.all_reduce` after o_proj, down_proj and the embedding, and a gather of
the LM head's slices. With one rank both do nothing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin import native
from engines.builtin.attention import AttentionBackend, AttentionMetadata
from engines.builtin.distributed.group import TPGroup
from engines.builtin.distributed.shard import RankShard, shard_for
from engines.builtin.kv_cache import LayerKVCache
from engines.builtin.kv_cache.groups import kv_groups
from engines.builtin.layers.linear import Linear, LinearMethod
from engines.builtin.layers.norm import RMSNorm
from engines.builtin.layers.rotary import RotaryEmbedding, Rotation, apply_rotary
from engines.builtin.mlp import MLP
from engines.builtin.moe import MoE
from models.config import ModelConfig


class LayerProgram(Protocol):
    """Runs the decoder layers of the steps it `takes` some other way than module by module
    (decode_program.DecodeProgram: one call into the C kernels); same results."""

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool: ...

    def run(
        self, x: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        linear: LinearMethod,
        backend: AttentionBackend,
        shard: RankShard,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = shard.num_heads * cfg.head_dim
        self.kv_size = shard.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, linear, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, linear)  # row-parallel
        # Qwen3's q/k norms (per head, over head_dim), OLMoE's (over every head at once)
        self.qk_norm = cfg.qk_norm
        norm_sizes = {"head": (cfg.head_dim, cfg.head_dim), "full": (self.q_size, self.kv_size)}
        sizes = norm_sizes.get(cfg.qk_norm)
        self.q_norm = None if sizes is None else RMSNorm(sizes[0], cfg.rms_norm_eps)
        self.k_norm = None if sizes is None else RMSNorm(sizes[1], cfg.rms_norm_eps)
        self.tp = tp
        self.backend = backend
        self.cache: LayerKVCache | None = None  # set by the model runner
        self.native = False  # rotary + K/V store through the C kernel (use_native_kernels)

    def forward(self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x, meta.lora)
        if self.q_norm is not None:
            qkv = self._norm_q_and_k(qkv)
        cache = self.cache if meta.use_cache else None
        if self.native and self._native_can_store(qkv, cache, meta):
            q, k, v = self._rotate_and_store_native(qkv, rotation, cache, meta)
        else:
            q, k, v = self._rotate_and_store(qkv, rotation, cache, meta)
        out = self.backend(q, k, v, cache, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size), meta.lora))

    def _norm_q_and_k(self, qkv: torch.Tensor) -> torch.Tensor:
        assert self.q_norm is not None and self.k_norm is not None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "head":
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        return torch.cat([q, k, v], dim=-1)

    def _rotate_and_store(
        self,
        qkv: torch.Tensor,
        rotation: Rotation,
        cache: LayerKVCache | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rotary(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), rotation)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if cache is not None:
            if meta.write_index is None:
                cache.write(k, v, meta.slot_mapping)
            else:
                index = meta.write_index
                cache.write(k[index], v[index], meta.slot_mapping[index])
        return q, k, v

    @staticmethod
    def _native_can_store(
        qkv: torch.Tensor, cache: LayerKVCache | None, meta: AttentionMetadata
    ) -> bool:
        """The C kernel rotates fp32 rows in place and stores every row's K/V as write()
        would, float32 or FP8 (no INT8, no static batching's unstored padding rows, no cache
        class with its own write)."""
        if not native.takes(qkv):
            return False
        # the cache's values are contiguous by construction
        return cache is None or (
            meta.write_index is None
            and not cache.scaled
            and cache.stores_by_slot
            and cache.dtype == torch.float32
        )

    def _rotate_and_store_native(
        self,
        qkv: torch.Tensor,
        rotation: Rotation,
        cache: LayerKVCache | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        native.rope_and_cache(
            qkv,
            rotation.positions,
            rotation.table,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            None if cache is None else cache.k,
            None if cache is None else cache.v,
            meta.slot_mapping,
            max_position=meta.max_seq_len - 1,
            kv_format=native.kv_format(None if cache is None else cache.fp8),
        )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
        )


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows [vocab_start, vocab_start + rows) of the padded vocabulary;
    a token outside them looks up zeros, and the all-reduce adds the one rank's row that has
    it. The loader fills `weight`; `_weight` skips nn.Embedding's random init, which on "meta"
    goes through torch's Python reference ops and imports torch._dynamo (seconds, per process)."""

    def __init__(self, shard: RankShard, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.start, self.rows = shard.vocab_start, shard.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.group is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0.0))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        linear: LinearMethod,
        backend: AttentionBackend,
        shard: RankShard,
        tp: TPGroup,
        index: int,
    ) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, linear, backend, shard, tp)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # before the MLP
        self.mlp: MLP | MoE = (
            MoE(cfg, linear, tp, shard)
            if cfg.is_moe_layer(index)
            else MLP(cfg.hidden_size, shard.intermediate_size, linear, tp, cfg.hidden_act)
        )
        # Gemma's sandwich: the attention's and the MLP's outputs are normed before their add
        sandwich = cfg.sandwich_norms
        self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotation: Rotation,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, still to be added to the residual stream
        (None before the first layer, where x is the embeddings); returns this layer's MLP
        output and the stream. Each residual add is done by the norm after it, so with the C
        kernels the add and the norm are one pass. `rotation`: this step's RoPE positions,
        shared by every layer."""
        if residual is None:
            h, residual = self.input_norm(x), x
        else:
            h, residual = self.input_norm(x, residual)
        h = self.attn(h, rotation, meta)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        h, residual = self.post_attn_norm(h, residual)
        h = self.mlp(h, meta.lora)
        if self.mlp_out_norm is not None:
            h = self.mlp_out_norm(h)
        return h, residual


class Transformer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        linear: LinearMethod,
        backend: AttentionBackend,
        max_positions: int,
        device: torch.device,
        lm_head_method: LinearMethod | None = None,
        tp: TPGroup | None = None,
        expert_parallel: bool = False,
    ) -> None:
        """`tp`: this rank's tensor-parallel group (None: one rank, the whole model);
        `expert_parallel`: its mixture-of-experts layers split by expert."""
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup()
        self.shard = shard_for(cfg, self.tp.rank, self.tp.size, expert_parallel)
        shard = self.shard
        self.embed = VocabParallelEmbedding(shard, cfg.hidden_size, self.tp)
        # Built on `device` even when the rest is created on "meta" and filled by the loader.
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device
        )
        # Gemma 3's windowed layers rotate by a RoPE of their own base, unscaled
        self.local_rope = (
            None
            if cfg.local_rope_theta is None
            else RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope_theta, None, device)
        )
        #: each layer's (sliding window, attention soft cap): what its metadata says
        self.layer_kinds = [
            (cfg.layer_window(i), cfg.attn_logit_softcapping) for i in range(cfg.num_layers)
        ]
        #: each layer's KV group, where a hybrid cache gives the step one (kv_cache/groups.py)
        groups = kv_groups(cfg)
        self.kv_layer_group = (0,) * cfg.num_layers if groups is None else groups.layer_group
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, linear, backend, shard, self.tp, i) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # `lm_head_method`: how the LM head is kept (None: like the other linear layers). A tied
        # model's head is loaded from the embedding table (the same tensor where the method
        # keeps the weight as it is), so that it multiplies through its method's kernel too.
        self.lm_head = Linear(
            cfg.hidden_size,
            shard.vocab_per_rank,
            linear if lm_head_method is None else lm_head_method,
        )
        for name, module in self.linear_layers().items():
            module.name = name
        self.layer_program: LayerProgram | None = None  # set by the model runner

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]."""
        x = self.embed(input_ids)
        if self.config.embedding_multiplier != 1.0:  # rounded to the dtype first, as HF does
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)
        program = self.layer_program
        if program is not None and program.takes(x, meta):
            x, stream = program.run(x, meta)
            return self.norm(x, stream)[0]
        rotation = self.rope.rotation(meta.positions)
        local = None if self.local_rope is None else self.local_rope.rotation(meta.positions)
        residual = None
        for layer, layer_meta in zip(self.layers, self.layer_metadata(meta), strict=True):
            windowed = local is not None and layer_meta.sliding_window is not None
            x, residual = layer(x, residual, local if windowed else rotation, layer_meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]

    def layer_metadata(self, meta: AttentionMetadata) -> list[AttentionMetadata]:
        """The step's metadata as each layer sees it: a layer whose window or soft cap differs
        from the step's (a global layer between windowed ones, Gemma 2's capped scores), or
        that reads another KV group's block tables (a hybrid cache), gets a copy with its own,
        one per kind, with a fresh `per_step` (masks depend on the window)."""
        Kind = tuple[int | None, float | None, int]
        variants: dict[Kind, AttentionMetadata] = {
            (meta.sliding_window, meta.logit_softcap, 0): meta
        }
        groups = self.kv_layer_group if meta.group_kv else (0,) * len(self.layer_kinds)
        out = []
        for (window, cap), group in zip(self.layer_kinds, groups, strict=True):
            kind = (window, cap, group)
            if kind not in variants:
                slots, tables = (
                    (meta.slot_mapping, meta.block_tables)
                    if group == 0
                    else meta.group_kv[group - 1]
                )
                variants[kind] = replace(
                    meta,
                    sliding_window=window,
                    logit_softcap=cap,
                    slot_mapping=slots,
                    block_tables=tables,
                    per_step={},
                )
            out.append(variants[kind])
        return out

    def expert_tokens(self) -> tuple[tuple[int, ...], int, int]:
        """The last forward's tokens per expert, summed over the MoE layers (() if none), its
        (layer, expert) pairs with any token, and the time its experts' MLPs took (ns)."""
        total: list[int] = []
        touched = expert_ns = 0
        for layer in self.layers:
            if not isinstance(layer.mlp, MoE):
                continue
            routing = layer.mlp.last_routing
            total = [a + b for a, b in zip(total, routing, strict=True)] if total else routing
            touched += sum(1 for count in routing if count)
            expert_ns += layer.mlp.last_expert_ns
        return tuple(total), touched, expert_ns

    def use_native_kernels(self, enabled: bool) -> None:
        """Route norms, SiLU-and-multiply and rotary + K/V store through the engine's C
        kernels where they apply (CPU float32; each layer falls back to torch ops per call)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP | MoE):
                module.native = enabled

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the (padded) vocabulary; under tensor parallelism on rank 0 only (the
        other ranks' slices are gathered there; they get None)."""
        logits = self.tp.gather_last_dim(self.lm_head(hidden))
        if logits is None:
            return None
        logits = logits[..., : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def linear_layers(self) -> dict[str, Linear]:
        return {name: m for name, m in self.named_modules() if isinstance(m, Linear)}

    def linear_methods(self) -> dict[str, str]:
        """How each linear layer is kept, for describe(): layer name -> its method's own words
        (e.g. "int4 g64 zero_point=float"); layers that every block keeps alike are one entry,
        `layers.*.<name>`, so a per-layer group size or fallback shows without 30 copies."""
        kept: dict[str, dict[int, str]] = {}
        for name, m in self.linear_layers().items():
            head, _, rest = name.partition(".")
            index, _, tail = rest.partition(".")
            key, at = (f"layers.*.{tail}", int(index)) if head == "layers" else (name, -1)
            kept.setdefault(key, {})[at] = m.method.describe(m)
        out: dict[str, str] = {}
        for key, per_layer in kept.items():
            if len(set(per_layer.values())) == 1:
                out[key] = next(iter(per_layer.values()))
            else:  # blocks differ: one entry per block
                for at, desc in sorted(per_layer.items()):
                    out[key.replace("*", str(at))] = desc
        return out

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights a forward reads: all of them, the blocks' linear layers, embedding,
        LM head; and the packed copies kept beside them for the CPU kernels (resident memory,
        not read on top: `prepack_weights`)."""
        linear = sum(
            m.weight_bytes()
            for name, m in self.linear_layers().items()
            if name.startswith("layers.")
        )
        embed = self.embed.weight.numel() * self.embed.weight.element_size()
        head = self.lm_head.weight_bytes()
        norms = sum(p.numel() * p.element_size() for n, p in self.named_parameters() if "norm" in n)
        tied = (
            self.lm_head.weight is not None  # one table, counted once
            and self.lm_head.weight.data_ptr() == self.embed.weight.data_ptr()
        )
        total = linear + embed + norms + (0 if tied else head)
        packed = sum(m.packed_bytes() for m in self.linear_layers().values())
        return {
            "weight_bytes": total,
            "linear_weight_bytes": linear,
            "embedding_bytes": embed,
            "lm_head_bytes": head,
            "packed_weight_bytes": packed,
        }
