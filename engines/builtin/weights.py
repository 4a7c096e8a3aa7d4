"""The loader that maps Hugging Face tensor names (a checkpoint's, or models.weights' dummy
ones) into the engine's fused layout, keeping a tensor-parallel rank's shard of each.

Sharding happens here, at load, in host memory, one full tensor at a time, before anything
reaches the device: column-parallel tensors (q/k/v, gate/up, embedding, LM head) are cut to the
rank's rows; row-parallel ones (o_proj, down_proj) go whole to `Linear.load` with the rank's
columns, so that a quantized method computes its scales from the full rows first (an INT8 row's
scale is its maximum over all inputs, which no single shard sees).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from engines.builtin.distributed.shard import RankShard
from engines.builtin.layers.norm import RMSNorm
from engines.builtin.model import Transformer
from models.config import ModelConfig
from models.quantized_weight import QuantizedWeight, Weight
from models.weights import hf_parameter_shapes

# Tensors a checkpoint may carry that the engine recomputes or does not need.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs."""


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FUSED = {
    "self_attn.q_proj": ("attn.qkv_proj", 0, 3),
    "self_attn.k_proj": ("attn.qkv_proj", 1, 3),
    "self_attn.v_proj": ("attn.qkv_proj", 2, 3),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
}
_ROW_PARALLEL = {"self_attn.o_proj": "attn.o_proj", "mlp.down_proj": "mlp.down_proj"}
#: Phi-3's packed tensors: their parts in order, each then loaded as the checkpoints that keep
#: them apart name it
_PACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_PLAIN = {
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attn_norm",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.gate": "mlp.router",  # a mixture-of-experts layer's router
    "block_sparse_moe.gate": "mlp.router",  # Mixtral's
    "mlp.shared_expert_gate": "mlp.shared_expert_gate",
}
#: an expert's (or Qwen2-MoE's shared expert's) projection, under either family's names
_EXPERT = re.compile(
    r"(?:mlp|block_sparse_moe)\.(experts\.\d+|shared_expert)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
)
_EXPERT_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}  # the rest: down_proj, w2
#: Gemma's four norms a layer: its post_attention_layernorm norms the attention's output
_SANDWICH = {
    "post_attention_layernorm": "attn_out_norm",
    "pre_feedforward_layernorm": "post_attn_norm",
    "post_feedforward_layernorm": "mlp_out_norm",
}


def load_weights(
    model: Transformer,
    tensors: Iterable[tuple[str, Weight]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Map Hugging Face tensors into the model, fusing q/k/v and gate/up on the way."""
    cfg = model.config
    expected = hf_parameter_shapes(cfg)
    layout = _FusedLayout(model, dtype, device)
    seen: set[str] = set()
    for name, tensor in tensors:
        if not _wanted(name, tensor, expected, cfg):
            continue
        seen.add(name)
        layout.put(name, tensor)
    _refuse_missing(expected, seen)
    layout.refuse_unpaired()
    if cfg.tie_word_embeddings:  # the table as the file keeps it, where the head keeps that
        quantized = layout.quantized_embedding if model.lm_head.method.takes_quantized else None
        model.lm_head.load(quantized or model.embed.weight.data)


def _wanted(
    name: str, tensor: Weight, expected: dict[str, tuple[int, ...]], cfg: ModelConfig
) -> bool:
    """Whether the model takes checkpoint tensor `name` (False: one the engine recomputes or does
    not need); one that is not the model's, or not its shape, is refused."""
    if IGNORED.match(name):
        return False
    if name not in expected:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return False  # some tied checkpoints still store a copy
        raise ValueError(
            f"checkpoint tensor {name!r} is not part of a "
            f"{cfg.architecture} with this config (an unsupported feature?)"
        )
    if tuple(tensor.shape) != expected[name]:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}"
        )
    return True


def _refuse_missing(expected: dict[str, tuple[int, ...]], seen: set[str]) -> None:
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise MissingWeightsError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


class _FusedLayout:
    """Puts checkpoint tensors into the model's modules, the rank's shard of each, holding back
    the parts of a fused tensor until all have come, and a Linear's weight (or bias) until its
    bias (or weight) has."""

    def __init__(self, model: Transformer, dtype: torch.dtype, device: torch.device) -> None:
        self.shard = model.shard
        self.config = model.config
        self.dtype, self.device = dtype, device
        self.modules = dict(model.named_modules())
        self.plain = {**_PLAIN, **_SANDWICH} if model.config.sandwich_norms else _PLAIN
        self.pending: dict[str, dict[int, dict[str, Weight]]] = {}  # fused parts
        self.pending_weight: dict[str, Weight] = {}
        self.pending_bias: dict[str, Weight] = {}
        # the rank's rows of a quantized embedding table, for a tied LM head to keep so
        self.quantized_embedding: QuantizedWeight | None = None

    def put(self, name: str, tensor: Weight) -> None:
        if name == "model.embed_tokens.weight":
            rows = self.shard.vocab_rows(tensor)
            if isinstance(rows, QuantizedWeight):  # the lookup reads float rows
                self.quantized_embedding = rows.to(device=self.device, dtype=self.dtype)
            self._put("embed", "weight", rows)
        elif name == "model.norm.weight":
            self._put("norm", "weight", tensor)
        elif name == "lm_head.weight":
            self._put("lm_head", "weight", self.shard.vocab_rows(tensor))
        else:
            self._put_layer_tensor(name, tensor)

    def refuse_unpaired(self) -> None:
        if self.pending_weight or self.pending_bias:
            raise MissingWeightsError(
                "incomplete weight/bias pairs: "
                f"{sorted(self.pending_weight) + sorted(self.pending_bias)}"
            )

    def _put_layer_tensor(self, name: str, tensor: Weight) -> None:
        match = _LAYER.fullmatch(name)
        assert match is not None
        layer, rest = match.groups()
        stem, kind = rest.rsplit(".", 1)
        prefix = f"layers.{layer}."
        expert = _EXPERT.fullmatch(stem)
        if expert is not None:  # mixture of experts: whole experts, the rank's own
            owner, projection = expert.groups()
            rows: slice | None = None
            if owner == "shared_expert":  # split like a dense MLP under expert parallelism
                rows = self.shard.shared_expert_rows() if self.shard.size > 1 else None
            else:
                index = int(owner.removeprefix("experts."))
                if index not in self.shard.experts:
                    return  # another rank's
                owner = f"experts.{index - self.shard.experts.start}"
            if projection in _EXPERT_PART:
                target = f"mlp.{owner}.gate_up_proj"
                kept = tensor if rows is None else tensor[rows]
                self._put_fused_part(prefix, target, _EXPERT_PART[projection], 2, kind, kept)
            else:
                self._put(f"{prefix}mlp.{owner}.down_proj", kind, tensor, rows)
        elif stem in _PACKED:  # Phi-3's: cut into its parts, each sharded as its own
            for part, span in zip(_PACKED[stem], self._packed_rows(stem), strict=True):
                self._put_layer_tensor(f"model.layers.{layer}.{part}.{kind}", tensor[span])
        elif stem in _FUSED:
            target, index, parts = _FUSED[stem]
            kept = tensor[shard_rows(self.shard, stem)]
            self._put_fused_part(prefix, target, index, parts, kind, kept)
        elif stem in _ROW_PARALLEL:
            self._put(prefix + _ROW_PARALLEL[stem], kind, tensor, shard_columns(self.shard, stem))
        else:
            self._put(prefix + self.plain[stem], kind, tensor)

    def _packed_rows(self, stem: str) -> list[slice]:
        """The rows of each part of a packed tensor (the whole model's sizes)."""
        cfg = self.config
        sizes = (
            [cfg.q_size, cfg.kv_size, cfg.kv_size]
            if stem == "self_attn.qkv_proj"
            else [cfg.intermediate_size] * 2
        )
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        return [slice(end - size, end) for end, size in zip(ends, sizes, strict=True)]

    def _put_fused_part(
        self, prefix: str, target: str, index: int, parts: int, kind: str, tensor: Weight
    ) -> None:
        group = self.pending.setdefault(prefix + target + "." + kind, {})
        group[index] = {"t": tensor}
        if len(group) == parts:
            fused = _cat_rows([group[i]["t"] for i in range(parts)])
            del self.pending[prefix + target + "." + kind]
            self._put(prefix + target, kind, fused)

    def _put(
        self, module_path: str, kind: str, tensor: Weight, columns: slice | None = None
    ) -> None:
        module = self.modules[module_path]
        tensor = tensor.to(device=self.device, dtype=self.dtype)
        if hasattr(module, "load"):  # a Linear: its method decides the storage
            if kind == "weight":
                bias = self.pending_bias.pop(module_path, None)
                if module.has_bias and bias is None:
                    self.pending_weight[module_path] = tensor
                    return
                module.load(tensor, bias, columns)
            else:
                weight = self.pending_weight.pop(module_path, None)
                if weight is None:
                    self.pending_bias[module_path] = tensor
                else:
                    module.load(weight, tensor)
        else:
            if isinstance(tensor, QuantizedWeight):  # an embedding table: looked up as floats
                tensor = tensor.dequantize()
            if isinstance(module, RMSNorm):  # Gemma's norms scale by (1 + weight)
                tensor = tensor + self.config.norm_weight_offset
            module.weight = torch.nn.Parameter(tensor, requires_grad=False)


def _cat_rows(parts: list[Weight]) -> Weight:
    """A fused tensor's parts stacked: quantized parts in one quantized form, float ones as
    they are (a part of each kind, or parts no one form holds: all dequantized)."""
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(quantized) == len(parts):
        try:
            return QuantizedWeight.cat(quantized)
        except ValueError:  # act-order parts in different orders, FP8 beside integers
            pass
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])


def shard_rows(shard: RankShard, stem: str) -> slice:
    """The rows of a column-parallel tensor (a fused part) that `shard` keeps."""
    if stem == "self_attn.q_proj":
        return shard.q_rows()
    if stem in ("self_attn.k_proj", "self_attn.v_proj"):
        return shard.kv_rows()
    return shard.mlp_rows()  # gate, up


def shard_columns(shard: RankShard, stem: str) -> slice | None:
    """The input columns of a row-parallel tensor that `shard` keeps (None: all, one rank)."""
    if shard.size == 1:
        return None
    return shard.q_rows() if stem == "self_attn.o_proj" else shard.mlp_rows()
