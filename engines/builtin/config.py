"""The one engine configuration behind the Python API, the Hydra config and the CLI.

Names and values follow vLLM where vLLM has them. `validate()` runs once, at the edge, and
every message names the field and the allowed values. Values that a later issue implements
are refused with the issue that brings them, never silently ignored.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from engines.base import ConfigError
from engines.builtin.spec_decode.config import SpeculativeConfig
from models.dtypes import DTYPE_ALIASES
from models.location import model_location

CHOICES = {
    "kv_cache": ("none", "contiguous", "paged"),
    "batching": ("static", "continuous"),
    "quantization": ("none", "int8", "int4"),
    "quantization_zero_point": ("float", "int", "symmetric"),
    "quantization_activations": ("float", "int8"),
    "lm_head_quantization": ("same", "int8"),
    "kv_cache_dtype": ("auto", "int8"),
    "attention_backend": ("auto", "torch", "sdpa", "cpu", "triton"),
    "load_format": ("auto", "dummy", "safetensors"),
}

#: The longest engine.tensor_parallel_timeout_s: a year (the ranks' idle wait, too).
MAX_TIMEOUT_S = 365 * 24 * 3600
#: The shortest: the compute group's rendezvous and every step's collectives wait on a rank
#: that is still busy (loading, or finishing its share of a step); under a second they fail a
#: healthy engine (under a microsecond the timedelta is 0 and the group cannot even form).
MIN_TIMEOUT_S = 1


@dataclass
class EngineConfig:
    # what to run
    # a preset, a packaged model, a Hugging Face checkpoint folder or a .gguf file
    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None  # None: the checkpoint's tokenizer, else the built-in BPE
    load_format: str = "auto"  # auto: checkpoint weights for a folder, dummy for a preset
    # numerics and placement
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: int | None = None  # CPU intra-op threads; None keeps torch's default
    # tensor parallelism (vLLM's name): the model split over this many ranks, each a process
    # with its own device (CPU: threads of its own, num_threads each); rank 0 spawns the
    # others, or joins those torchrun started (docs/parallelism.md)
    tensor_parallel_size: int = 1
    # a collective that takes longer than this fails the engine (a rank died or hung)
    tensor_parallel_timeout_s: float = 60.0
    # limits
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    # None: 2048 with chunked prefill (vLLM v1's serving default), else max(max_model_len, 2048)
    max_num_batched_tokens: int | None = None
    # KV cache
    kv_cache: str = "contiguous"
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # None: derived from the device, see kv_budget
    # CPU: map every KV page at load, so no measured step pays the OS's first-touch cost
    kv_cache_prefault: bool = True
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = False
    # scheduling
    batching: str = "continuous"
    enable_chunked_prefill: bool = False
    # kernels and weights
    attention_backend: str = "auto"
    quantization: str = "none"
    # int4: input columns per scale/zero (32|64|128); a layer it does not divide gets the
    # largest smaller one that does (docs/engine_options.md)
    quantization_group_size: int = 128
    # int4: float (a float minimum per group, as llama.cpp's Q4_1), int (an integer zero
    # point with the range widened to include 0) or symmetric (no zero point, llama.cpp's
    # Q4_0); engines/builtin/layers/quant.py
    quantization_zero_point: str = "float"
    # int4 on CPU with the engine's C kernels: float (weight-only: activations stay in the
    # compute dtype) or int8 (decode rows quantized per block of 32 and integer dot products,
    # llama.cpp's Q4_1 x Q8_1: ~2.5x faster per matmul on one core, not weight-only)
    quantization_activations: str = "float"
    # quantize the LM head too (a tied one: a quantized copy of the embedding table, which the
    # lookup keeps reading); false keeps it dense
    quantize_lm_head: bool = False
    # with quantize_lm_head: same (the layers' method) or int8 (per output channel whatever the
    # layers use: llama.cpp's GGUFs keep Q4 layers beside a Q8_0 head, which costs a fraction
    # of INT4's top-1 agreement)
    lm_head_quantization: str = "same"
    # CPU, unquantized fp32/bf16: keep a oneDNN-packed copy of each linear weight (2x the
    # dense weight memory) so multi-row matmuls skip torch's per-call re-packing
    prepack_weights: bool = True
    # CPU float32: the engine's C kernels (engines/builtin/native), built on first use with
    # the machine's compiler: fused residual-add + RMSNorm, SiLU-and-multiply and rotary + K/V
    # store, and attention_backend=auto resolving to the C decode kernel; false: torch ops
    # (an explicit attention_backend=cpu still uses its kernel)
    native_kernels: bool = True
    # CPU float32 with the C kernels: run each decode-only step's decoder layers as one call
    # into them (engines/builtin/decode_program.py: the same kernels without ~0.5 ms of Python
    # a layer); false: module by module. describe()["native_decode_program"] says which
    native_decode_program: bool = True
    # speculative decoding, vLLM's keys: {method: ngram | draft_model, num_speculative_tokens,
    # prompt_lookup_min/max (ngram), model / dtype / quantization (the draft)}; null: off
    # (engines/builtin/spec_decode, docs/engine_options.md)
    speculative_config: Any = None  # typed Any: Hydra cannot merge a mapping into a None dict
    # test instrument: busy-wait this fraction of each step's duration inside the step (a planted
    # slowdown for validating the regression gate; docs/gate.md)
    debug_step_delay_fraction: float = 0.0
    # speed: CUDA graphs for decode steps (CUDA only, needs attention_backend=triton) and
    # torch.compile of the model forward; docs/engine_options.md
    enforce_eager: bool = True
    cuda_graph_batch_sizes: list[int] | None = None  # None: 1, 2, 4, 8, 16, 24, ... max_num_seqs
    compile: bool = False

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"engine: unknown option(s) {unknown}; known options: {sorted(known)}"
            )
        return cls(**values).validate()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` as its typed form (validated), or None when off."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def validate(self) -> EngineConfig:
        def fail(name: str, allowed: str) -> ConfigError:
            value = getattr(self, name)
            return ConfigError(f"engine.{name}: {value!r} is invalid; allowed: {allowed}")

        self.model = model_location(self.model)  # a trained or packaged model's location
        if self.quantization is None:
            self.quantization = "none"
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise fail(name, "|".join(allowed))
        if str(self.dtype).lower() not in DTYPE_ALIASES:
            raise fail("dtype", "auto|float32|bfloat16|float16 (aliases fp32|bf16|fp16)")
        self.dtype = DTYPE_ALIASES[str(self.dtype).lower()]
        device = str(self.device)
        if not (device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device)):
            raise fail("device", "auto|cpu|cuda|cuda:N")
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size"):
            value = getattr(self, name)
            # a bool is an int to Python: True would pass as 1
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(name, "an integer >= 1")
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "kv_cache_memory_bytes",
            "num_threads",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise fail(name, "null or an integer >= 1")
        timeout = self.tensor_parallel_timeout_s
        # bounded: every rank turns it into a timedelta (inf overflows it) for its groups
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S
        ):
            raise fail(
                "tensor_parallel_timeout_s",
                f"a number of seconds >= {MIN_TIMEOUT_S} and <= {MAX_TIMEOUT_S}",
            )
        if (
            isinstance(self.gpu_memory_utilization, bool)
            or not isinstance(self.gpu_memory_utilization, int | float)
            or not 0.0 < self.gpu_memory_utilization <= 1.0  # also refuses NaN
        ):
            raise fail("gpu_memory_utilization", "a number in (0, 1]")
        if (
            isinstance(self.debug_step_delay_fraction, bool)
            or not isinstance(self.debug_step_delay_fraction, int | float)
            or not 0.0 <= self.debug_step_delay_fraction < float("inf")  # inf: spin forever
        ):
            raise fail("debug_step_delay_fraction", "a finite number >= 0")
        if isinstance(self.quantization_group_size, bool) or self.quantization_group_size not in (
            32,
            64,
            128,
        ):
            raise fail("quantization_group_size", "32|64|128")
        if self.quantization_activations == "int8" and self.quantization != "int4":
            raise ConfigError(
                "engine.quantization_activations: 'int8' is for quantization=int4 (INT4 weights "
                f"times INT8 activations); with quantization={self.quantization!r} allowed: float"
            )
        if self.lm_head_quantization != "same" and self.quantize_lm_head is not True:
            raise ConfigError(
                f"engine.lm_head_quantization: {self.lm_head_quantization!r} applies to a "
                "quantized LM head; set engine.quantize_lm_head=true, or allowed here: same"
            )
        for name in (
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "quantize_lm_head",
            "enforce_eager",
            "compile",
            "prepack_weights",
            "kv_cache_prefault",
            "native_kernels",
            "native_decode_program",
        ):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, "true|false")
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None:
            if (
                isinstance(sizes, str | bytes)
                or not hasattr(sizes, "__iter__")
                or not list(sizes)
                or any(
                    isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_num_seqs
                    for n in sizes
                )
            ):
                raise fail(
                    "cuda_graph_batch_sizes",
                    f"null or a non-empty list of integers in [1, max_num_seqs="
                    f"{self.max_num_seqs}]",
                )
            self.cuda_graph_batch_sizes = sorted(set(sizes))
        if self.speculative_config is not None:
            spec = SpeculativeConfig.from_dict(self.speculative_config)
            if self.batching == "static":
                raise ConfigError(
                    "engine.speculative_config needs engine.batching=continuous: a static "
                    "batch decodes one padded token per row and step; or speculative_config=null"
                )
            self.speculative_config = spec.to_dict()
        if self.enable_chunked_prefill and self.batching == "static":
            raise ConfigError(
                "engine.enable_chunked_prefill=true cannot be combined with "
                "engine.batching=static: a static batch is prefilled whole, in one padded step; "
                "use batching=continuous for chunked prefill, or enable_chunked_prefill=false"
            )
        if self.enable_chunked_prefill and self.kv_cache == "none":
            raise ConfigError(
                "engine.enable_chunked_prefill=true needs a KV cache, but engine.kv_cache=none "
                "keeps no K/V between steps to hold a prompt's earlier chunks; use "
                "kv_cache=contiguous, or enable_chunked_prefill=false"
            )
        if self.enable_prefix_caching and self.kv_cache != "paged":
            raise ConfigError(
                f"engine.enable_prefix_caching=true needs engine.kv_cache=paged (cached blocks "
                f"are shared between sequences), not kv_cache={self.kv_cache}"
            )
        if self.enable_prefix_caching and self.batching == "static":
            raise ConfigError(
                "engine.enable_prefix_caching=true is not combined with "
                "engine.batching=static; use batching=continuous"
            )
        if (
            not self.enable_chunked_prefill
            and self.max_model_len
            and self.max_num_batched_tokens
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                f"engine.max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"engine.max_model_len={self.max_model_len}: without chunked prefill a whole "
                "prompt must fit in one step; raise max_num_batched_tokens or lower max_model_len"
            )
        return self
