"""A LoRA adapter read from a local PEFT folder (`adapter_config.json` and
`adapter_model.safetensors`, as `peft`'s `save_pretrained` writes them), checked against the
base model it is to run on. Nothing is downloaded.

PEFT keeps, per targeted module, `lora_A.weight` [r, in] and `lora_B.weight` [out, r] under the
module's name (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`), and adds
`scaling * B @ A @ x` to the module's output, scaling = lora_alpha / r (lora_alpha / sqrt(r)
with `use_rslora`). Here the scaling is folded into B once, at load.

What PEFT can write but the engine does not run is refused, naming the adapter and the field:
DoRA, LoRA biases, `modules_to_save`, per-module rank or alpha patterns, layers or modules the
model does not have, a rank above `max_lora_rank`, tensors whose shapes are not the base model's
(an adapter trained on another model).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.config import ModelConfig
from models.weights import hf_parameter_shapes

#: The modules an adapter may target: Hugging Face's names in a Llama-family block
TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: each one's parent module in the block (its tensor names: layers.N.<parent>.<module>)
MODULE_PARENT = {name: "self_attn" if name[0] in "qkvo" else "mlp" for name in TARGETABLE}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.[\w-]+)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot run on this model; the message names the adapter."""


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights, keyed by (layer, module) with the Hugging Face module name:
    A [r, in] and B [out, r] with the scaling folded into B."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    #: the two files' sizes and modification times when read: whether a later read is of
    #: the same adapter
    fingerprint: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter in PEFT folder `path`, checked against `config`; LoRAError naming `name`."""
    folder = Path(path).expanduser()

    def refuse(problem: str) -> LoRAError:
        return LoRAError(f"lora_modules.{name}: {problem} ({folder})")

    if not folder.is_dir():
        problem = "not a folder" if folder.exists() else "no such folder"
        raise refuse(f"{problem} (expected a PEFT adapter folder: adapter_config.json and "
                     "adapter_model.safetensors)")  # fmt: skip
    fingerprint = _fingerprint(folder)
    settings = _read_config(folder / "adapter_config.json", refuse)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"adapter_config.json: r={rank!r} is invalid; allowed: an integer >= 1")
    if rank > max_rank:
        raise refuse(f"rank {rank} exceeds engine.max_lora_rank={max_rank}; allowed: a rank "
                     f"<= max_lora_rank (raise it to {rank} or more)")  # fmt: skip
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise refuse(
            f"adapter_config.json: lora_alpha={alpha!r} is invalid; allowed: a finite number"
        )
    _refuse_unsupported(settings, refuse)
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _read_tensors(folder, refuse)
    weights = _pair_up(tensors, config, rank, refuse)
    targets = tuple(sorted({module for _, module in weights}, key=TARGETABLE.index))
    scaled = {key: (a, b * scaling) for key, (a, b) in weights.items()}
    if not all(torch.isfinite(b).all() for _, b in scaled.values()):
        raise refuse(f"lora_alpha={alpha!r} scales lora_B past float32's range")
    return LoRAAdapter(
        name=name,
        path=str(folder),
        rank=rank,
        scaling=float(scaling),
        target_modules=targets,
        weights=scaled,
        fingerprint=fingerprint,
    )


def _fingerprint(folder: Path) -> tuple[int, ...]:
    stats = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            found = (folder / name).stat()
        except OSError:
            stats += [-1, -1]  # missing: the read below says so
            continue
        stats += [found.st_size, found.st_mtime_ns]
    return tuple(stats)


def _read_config(path: Path, refuse: Any) -> dict[str, Any]:
    if not path.is_file():
        raise refuse("no adapter_config.json")
    try:
        settings = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise refuse(f"adapter_config.json is not JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise refuse("adapter_config.json is not a JSON object")
    kind = settings.get("peft_type", "LORA")
    if kind != "LORA":
        raise refuse(f"adapter_config.json: peft_type={kind!r}; allowed: LORA")
    return settings


def _refuse_unsupported(settings: dict[str, Any], refuse: Any) -> None:
    checks: dict[str, tuple[Any, Any]] = {
        "use_dora": (False, None),
        "bias": ("none", None),
        "modules_to_save": (None, []),
        "rank_pattern": ({}, None),
        "alpha_pattern": ({}, None),
        "fan_in_fan_out": (False, None),
        "lora_bias": (False, None),
        "layer_replication": (None, []),
        "target_parameters": (None, []),
        "use_qalora": (False, None),
    }
    for key, neutral in checks.items():
        value = settings.get(key)
        if value is not None and value not in neutral:
            raise refuse(f"adapter_config.json: {key}={value!r} is not supported; allowed: "
                         f"{neutral[0]!r}")  # fmt: skip
    targets = settings.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    unknown = [t for t in names if isinstance(t, str) and t.isidentifier() and t not in TARGETABLE]
    if unknown:
        raise refuse(f"target_modules: {unknown} are not modules of this model; allowed: "
                     f"{', '.join(TARGETABLE)}")  # fmt: skip


def _read_tensors(folder: Path, refuse: Any) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        also = " (a .bin adapter: save it with safe_serialization)" if (
            folder / "adapter_model.bin").is_file() else ""  # fmt: skip
        raise refuse(f"no adapter_model.safetensors{also}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise refuse(f"adapter_model.safetensors cannot be read ({exc})") from None


def _pair_up(
    tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int, refuse: Any
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B), every shape checked against the base model's module."""
    shapes = hf_parameter_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _KEY.match(key)
        if found is None:
            raise refuse(f"tensor {key!r} is not a LoRA A/B weight of a decoder layer's "
                         f"{'/'.join(TARGETABLE)}")  # fmt: skip
        layer, module, half = int(found[1]), found[2], found[3]
        if not tensor.is_floating_point():
            raise refuse(f"tensor {key!r} is {tensor.dtype}; allowed: a floating-point dtype")
        if not torch.isfinite(tensor).all():
            raise refuse(f"tensor {key!r} holds NaN or infinity; allowed: finite values")
        if module not in TARGETABLE:
            raise refuse(f"tensor {key!r}: module {module!r} is not one of this model's; "
                         f"allowed: {', '.join(TARGETABLE)}")  # fmt: skip
        if layer >= config.num_layers:
            raise refuse(f"tensor {key!r}: layer {layer} does not exist (the base model has "
                         f"{config.num_layers})")  # fmt: skip
        pair = halves.setdefault((layer, module), {})
        if half in pair:
            raise refuse(f"tensor {key!r}: layer {layer} {module} lora_{half} appears twice")
        pair[half] = tensor.to(torch.float32)
    if not halves:
        raise refuse("adapter_model.safetensors holds no LoRA weights")
    pairs = {}
    for (layer, module), half in sorted(halves.items()):
        if set(half) != {"A", "B"}:
            raise refuse(f"layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = half["A"], half["B"]
        out, fan_in = shapes[f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}.weight"]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (out, rank):
            raise refuse(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not fit the base model's [{out}, {fan_in}] weight at rank {rank} (an "
                "adapter for another model?)"
            )
        pairs[(layer, module)] = (a.contiguous(), b.contiguous())
    return pairs
