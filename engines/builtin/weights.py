"""Weights: seeded dummy state dicts with Hugging Face names, safetensors checkpoints, and the
one loader that maps Hugging Face names into the engine's fused layout.

Dummy weights are built under the same names a `LlamaForCausalLM` checkpoint uses, so the very
same tensors can be handed to Hugging Face transformers for side-by-side comparisons.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engines.builtin.model import Transformer
from engines.builtin.model_config import ModelConfig

# Tensors a checkpoint may carry that the engine recomputes or does not need.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs."""


def hf_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (out, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def dummy_state_dict(
    cfg: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Seeded random weights under Hugging Face names.

    Normal(0, 0.02) like Hugging Face's initialiser; the projections that write into the
    residual stream (o_proj, down_proj) are scaled by 1/sqrt(2 x layers) so the residual stays
    O(1) however deep the model is, and norms start at one.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    state = {}
    for name, shape in hf_parameter_shapes(cfg).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            state[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        std = residual_std if ("o_proj" in name or "down_proj" in name) else 0.02
        state[name] = torch.randn(shape, generator=gen, dtype=dtype, device=device) * std
    return state


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{index}: not a valid safetensors index (a JSON object with a "
                f"'weight_map' of tensor name -> file): {exc!r}"
            ) from None
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {other}: only safetensors are supported)" if other else ""
        raise FileNotFoundError(f"model.path: no *.safetensors weights in {path}{hint}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"model.path: shards named in the index are missing: {missing}")
    return files


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        try:
            handle = safe_open(str(file), framework="pt")
        except SafetensorError as exc:
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                try:
                    tensor = f.get_tensor(name)
                except SafetensorError as exc:
                    raise ValueError(f"{file}: tensor {name!r} cannot be read ({exc})") from None
                yield name, tensor


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
