"""engine.model as every in-process backend's options take it: a name resolved once (a trained
or packaged model's location), and any other kind of value refused by the one checker, naming
the field, before anything tries to resolve it."""

from __future__ import annotations

import pytest

from engines.builtin.config import EngineConfig
from engines.hf.config import HFConfig
from engines.llamacpp.config import LlamaCppConfig


@pytest.mark.parametrize("options", [EngineConfig, HFConfig, LlamaCppConfig])
@pytest.mark.parametrize("model", [["tiny"], {"name": "tiny"}, 7])
def test_a_model_that_is_not_a_name_is_refused_naming_engine_model(
    options: type, model: object
) -> None:
    with pytest.raises(ValueError, match=r"^engine\.model: .* is invalid; allowed: a string"):
        options(model=model)
