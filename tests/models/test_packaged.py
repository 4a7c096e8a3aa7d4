"""Packaged models: model=<name> finds the file a pip package ships, or says how to install it."""

from __future__ import annotations

from pathlib import Path

import pytest

import models.packaged as packaged
from engines.backends import build_backend
from models.location import resolve_model
from models.packaged import PackagedModel, PackagedModelMissingError, packaged_model_path


def test_smollm2_resolves_to_the_installed_gguf(smollm2_gguf: Path) -> None:
    path = packaged_model_path("smollm2-135m")  # smollm2_gguf: the file's parse, shared
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    cfg = resolve_model("smollm2-135m")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (576, 30, 9, 3)


def test_a_missing_package_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    absent = PackagedModel("inferlab-no-such-dist", ".gguf", "make setup-real", "absent")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "absent-model", absent)
    with pytest.raises(PackagedModelMissingError) as info:
        build_backend({"backend": "builtin"}, {"name": "absent-model"})
    message = str(info.value)
    assert "\n" not in message
    assert "model=absent-model" in message and "inferlab-no-such-dist" in message
    assert "make setup-real" in message


def test_a_package_without_the_file_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    no_file = PackagedModel("pytest", ".gguf", "make setup-real", "pytest ships no gguf")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "no-file", no_file)
    with pytest.raises(PackagedModelMissingError, match=r"model=no-file: .* no \*\.gguf file"):
        resolve_model("no-file")


@pytest.mark.parametrize("backend", ["builtin", "hf", "llamacpp"])
def test_every_backend_loads_the_packaged_file_not_dummy_weights(backend: str) -> None:
    from engines.builtin.config import EngineConfig
    from engines.hf.config import HFConfig
    from engines.llamacpp.config import LlamaCppConfig

    configs = {"builtin": EngineConfig, "hf": HFConfig, "llamacpp": LlamaCppConfig}
    config = configs[backend].from_dict({"model": "smollm2-135m"})
    assert config.model == str(packaged_model_path("smollm2-135m"))
