"""The loader that maps Hugging Face tensor names (a checkpoint's, or models.weights' dummy
ones) into the engine's fused layout."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from engines.builtin.model import Transformer
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
_PLAIN = {
    "self_attn.o_proj": "attn.o_proj",
    "mlp.down_proj": "mlp.down_proj",
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attn_norm",
}


def load_weights(
    model: Transformer,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Map Hugging Face tensors into the model, fusing q/k/v and gate/up on the way."""
    cfg = model.config
    expected = hf_parameter_shapes(cfg)
    seen: set[str] = set()
    pending: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    modules = dict(model.named_modules())

    def put(module_path: str, kind: str, tensor: torch.Tensor) -> None:
        module = modules[module_path]
        tensor = tensor.to(device=device, dtype=dtype)
        if hasattr(module, "load"):  # a Linear: its method decides the storage
            if kind == "weight":
                bias = pending_bias.pop(module_path, None)
                if module.has_bias and bias is None:
                    pending_weight[module_path] = tensor
                    return
                module.load(tensor, bias)
            else:
                weight = pending_weight.pop(module_path, None)
                if weight is None:
                    pending_bias[module_path] = tensor
                else:
                    module.load(weight, tensor)
        else:
            module.weight = torch.nn.Parameter(tensor, requires_grad=False)

    pending_weight: dict[str, torch.Tensor] = {}
    pending_bias: dict[str, torch.Tensor] = {}

    for name, tensor in tensors:
        if IGNORED.match(name):
            continue
        if name not in expected:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy
            raise ValueError(
                f"checkpoint tensor {name!r} is not part of a "
                f"{cfg.architecture} with this config (an unsupported feature?)"
            )
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {expected[name]}"
            )
        seen.add(name)
        if name == "model.embed_tokens.weight":
            put("embed", "weight", tensor)
        elif name == "model.norm.weight":
            put("norm", "weight", tensor)
        elif name == "lm_head.weight":
            put("lm_head", "weight", tensor)
        else:
            match = _LAYER.fullmatch(name)
            assert match is not None
            layer, rest = match.groups()
            stem, kind = rest.rsplit(".", 1)
            prefix = f"layers.{layer}."
            if stem in _FUSED:
                target, index, parts = _FUSED[stem]
                group = pending.setdefault(prefix + target + "." + kind, {})
                group[index] = {"t": tensor}
                if len(group) == parts:
                    fused = torch.cat([group[i]["t"] for i in range(parts)], dim=0)
                    del pending[prefix + target + "." + kind]
                    put(prefix + target, kind, fused)
            else:
                put(prefix + _PLAIN[stem], kind, tensor)

    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise MissingWeightsError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    if pending_weight or pending_bias:
        raise MissingWeightsError(
            f"incomplete weight/bias pairs: {sorted(pending_weight) + sorted(pending_bias)}"
        )
    if cfg.tie_word_embeddings:
        model.lm_head.load(model.embed.weight.data)
