"""An engine's configuration is checked once per engine build, whichever way the engine is
built: nothing downstream of the edge (backend, factory, engine) checks it again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.builtin import LLM
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.builtin.factory import build_engine
from engines.options import Options

SMALL = {"model": "tiny", "dtype": "float32", "device": "cpu", "max_model_len": 64}


@pytest.fixture
def engine_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[EngineConfig]]:
    """Every EngineConfig checked from now on (the checker runs as each one is built)."""
    checked: list[EngineConfig] = []
    check = Options.__post_init__

    def counting(self: Options) -> None:
        if isinstance(self, EngineConfig):
            checked.append(self)
        check(self)

    monkeypatch.setattr(Options, "__post_init__", counting)
    yield checked


def _llm() -> None:
    LLM(**SMALL)


def _build_engine() -> None:
    build_engine(EngineConfig(**SMALL)).close()


def _builtin_backend() -> None:
    backend = BuiltinBackend(EngineConfig(**SMALL))
    backend.load()
    backend.close()


def _serve() -> None:
    from serving import cli

    backend, _ = cli.build_backend(["model=tiny", "engine.max_model_len=64"])
    backend.load()
    backend.close()


@pytest.mark.parametrize(
    "build", [_llm, _build_engine, _builtin_backend, _serve], ids=lambda f: f.__name__
)
def test_an_engine_build_checks_its_config_once(
    build: Callable[[], Any], engine_checks: list[EngineConfig]
) -> None:
    build()
    assert len(engine_checks) == 1


def test_inferlab_run_checks_the_engine_config_once(
    engine_checks: list[EngineConfig], tmp_path: Path
) -> None:
    from harness import cli

    argv = ["run", "model=tiny", "workload.num_requests=2", "workload.input_len=8"]
    argv += ["workload.output_len=2", "run.warmup_requests=0", f"hydra.run.dir={tmp_path}"]
    assert cli.main(argv) == 0
    assert len(engine_checks) == 1


def test_a_config_built_in_python_is_checked_and_frozen() -> None:
    with pytest.raises(ValueError, match=r"engine.kv_cache: 'x' is invalid; allowed: none\|"):
        EngineConfig(kv_cache="x")
    config = EngineConfig(dtype="FP32", cuda_graph_batch_sizes=[4, 1, 4])
    assert (config.dtype, config.cuda_graph_batch_sizes) == ("float32", [1, 4])
    with pytest.raises(AttributeError):
        config.kv_cache = "x"  # type: ignore[misc]
