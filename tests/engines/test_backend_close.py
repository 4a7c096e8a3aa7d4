"""Every backend's close(): what it started is released (the engine and its thread, the
executor's thread), and a second close is harmless. engine=llamacpp's runner needs the llama.cpp
library (tests/engines/llamacpp); its close frees the context once and sets the runner to None."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engines.base import GenerationRequest
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.openai.backend import OpenAIBackend
from engines.openai.config import OpenAIConfig
from engines.sampling_params import SamplingParams

REQUEST = GenerationRequest("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))


def drive(backend) -> list:
    async def one() -> list:
        return [event async for event in backend.generate(REQUEST)]

    return asyncio.run(one())


def threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def test_the_builtin_backend_closes_its_engine_and_thread_once() -> None:
    backend = BuiltinBackend(EngineConfig(model="tiny", num_threads=1))
    backend.load()
    engine = backend.engine
    assert engine is not None
    backend.start_engine_thread()
    assert drive(backend)
    backend.close()
    backend.close()
    assert engine.closed and backend.engine is None
    assert not threads("inferlab-engine")


def test_the_hf_backend_closes_once() -> None:
    pytest.importorskip("transformers")
    from engines.hf.backend import HFBackend

    backend = HFBackend.from_config({"model": "tiny", "mode": "generate_batch"})
    backend.load()
    assert drive(backend)
    backend.close()
    backend.close()
    assert backend.model is None and backend._manager is None


def test_the_openai_backend_closes_once() -> None:
    options = {"base_url": "http://127.0.0.1:9/v1", "check_server": False}
    backend = OpenAIBackend(OpenAIConfig.from_config(options, {"name": "tiny"}), {"name": "tiny"})
    backend.close()
    backend.close()
    assert backend._client is None
