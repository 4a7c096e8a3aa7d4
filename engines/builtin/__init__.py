"""The built-in inference engine: a complete, transparent Llama-family engine.

from engines.builtin import LLM, SamplingParams
llm = LLM(model="tiny", kv_cache="contiguous")
out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
"""

from engines.builtin.config import EngineConfig
from engines.builtin.engine import EngineClosedError, EngineDeadError, LLMEngine
from engines.builtin.llm import LLM, CompletionOutput, RequestOutput
from engines.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
