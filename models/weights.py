"""Weight files: safetensors checkpoints (one file, or shards with an index) and seeded dummy
weights under the names a Hugging Face `LlamaForCausalLM` checkpoint uses, so that the very same
tensors can be handed to the built-in engine and to transformers for side-by-side comparisons.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models.config import ModelConfig
from models.files import SETTINGS, check_regular_file, read_input_text
from models.gguf import is_gguf, iter_gguf_tensors
from models.hf_quantized import (
    CheckpointQuantization,
    parse_quantization_config,
    quantized_tensors,
)
from models.quantized_weight import QuantizedWeight


def hf_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    norm_sizes = {"head": (cfg.head_dim, cfg.head_dim), "full": (q, kv)}.get(cfg.qk_norm)
    phi3 = cfg.architecture == "Phi3ForCausalLM"
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.sandwich_norms:  # Gemma's norms before and after the MLP
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if phi3:  # q/k/v in one tensor, gate/up in another
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        for name, out in () if phi3 else (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (out, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if norm_sizes is not None:
            shapes[p + "self_attn.q_norm.weight"] = (norm_sizes[0],)
            shapes[p + "self_attn.k_norm.weight"] = (norm_sizes[1],)
        if cfg.is_moe_layer(i):
            shapes.update(_moe_shapes(cfg, p))
            continue
        if phi3:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


#: Mixtral's names for an expert's gate, up and down projections (the others use mlp's)
MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _moe_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """One MoE layer's tensors under its family's names: the router, the experts' projections
    and Qwen2-MoE's shared expert with its gate."""
    h, inter = cfg.hidden_size, cfg.expert_intermediate_size
    mixtral = cfg.architecture == "MixtralForCausalLM"
    block = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    shapes: dict[str, tuple[int, ...]] = {block + "gate.weight": (cfg.num_experts, h)}
    projections = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    for e in range(cfg.num_experts):
        for name, shape in projections.items():
            shapes[f"{block}experts.{e}.{MIXTRAL_EXPERT[name] if mixtral else name}.weight"] = shape
    shared = cfg.shared_expert_intermediate_size
    if shared:
        shapes[block + "shared_expert.gate_proj.weight"] = (shared, h)
        shapes[block + "shared_expert.up_proj.weight"] = (shared, h)
        shapes[block + "shared_expert.down_proj.weight"] = (h, shared)
        shapes[block + "shared_expert_gate.weight"] = (1, h)
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
    O(1) however deep the model is, and norms start at scaling by one (a weight of zero where
    the model adds one to it, as Gemma's).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    state = {}
    for name, shape in hf_parameter_shapes(cfg).items():
        if name.endswith("norm.weight"):  # the layer norms, q/k norms and the final one
            state[name] = torch.full(
                shape, 1.0 - cfg.norm_weight_offset, dtype=dtype, device=device
            )
            continue
        residual = "o_proj" in name or "down_proj" in name or name.endswith(".w2.weight")
        std = residual_std if residual else 0.02
        state[name] = torch.randn(shape, generator=gen, dtype=dtype, device=device) * std
    return state


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        text = read_input_text(index, SETTINGS)
        try:
            weight_map = json.loads(text)["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
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
    for file in files:
        if file.exists() and not file.is_file():  # a FIFO or a device: named, never mapped
            check_regular_file(file)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"model.path: shards named in the index are missing: {missing}")
    return files


def iter_checkpoint(
    path: str | Path, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, tensor) of a safetensors folder, or of a GGUF file: its quantized
    weights (a GGUF's, or an AWQ / GPTQ / compressed-tensors folder's) dequantized, or with
    `keep_quantized` as the QuantizedWeight each stores."""
    if is_gguf(path):
        yield from iter_gguf_tensors(path, keep_quantized)
        return
    files = checkpoint_files(path)
    scheme = checkpoint_quantization(path)
    if scheme is None:
        yield from _safetensors(files, quantized=False)
        return
    names = [name for file in files for name in _names(file)]
    for name, tensor in quantized_tensors(scheme, names, _safetensors(files, quantized=True)):
        if isinstance(tensor, QuantizedWeight) and not keep_quantized:
            tensor = tensor.dequantize()
        elif not isinstance(tensor, QuantizedWeight) and not _plain_float(tensor):
            raise ValueError(_not_float(name, tensor))
        yield name, tensor


def checkpoint_quantization(path: str | Path) -> CheckpointQuantization | None:
    """The folder's config.json `quantization_config` (AWQ, GPTQ, compressed-tensors), if any."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        qc = json.loads(read_input_text(config, SETTINGS)).get("quantization_config")
    except (ValueError, AttributeError):
        return None  # models/config.py names what is wrong with a config.json
    return None if not qc else parse_quantization_config(qc, str(config))


def _plain_float(tensor: torch.Tensor) -> bool:
    """A float tensor the model reads as it is (not FP8 values, which need their scale)."""
    return tensor.is_floating_point() and tensor.element_size() > 1


def _not_float(name: str, tensor: torch.Tensor) -> str:
    return (
        f"tensor {name!r} is {tensor.dtype}; allowed: a floating-point dtype (float32, "
        "float16, bfloat16), or the integer and FP8 tensors of a quantized linear (with its "
        "scales) of a checkpoint whose config.json names its quantization_config (AWQ, "
        "GPTQ, compressed-tensors)"
    )


def _names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except SafetensorError as exc:
        raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None


def _safetensors(files: list[Path], quantized: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of safetensors files; integer tensors only where `quantized`."""
    for file in files:
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
                if not quantized and not _plain_float(tensor):  # a wrong model as float
                    raise ValueError(f"{file}: {_not_float(name, tensor)}")
                yield name, tensor
