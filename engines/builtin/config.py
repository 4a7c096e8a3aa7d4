"""The one engine configuration behind the Python API, the Hydra config and the CLI.

Names and values follow vLLM where vLLM has them. Each option is one field (its type, default,
allowed values and help: engines/options.py); building an `EngineConfig` normalises and checks
it, once, and every message names the field and the allowed values. The config is frozen:
`dataclasses.replace` makes a changed one (checked again, as a new config). Values that a later
issue implements are refused with the issue that brings them, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from engines.base import ConfigError
from engines.builtin.kv_cache.storage import KV_CACHE_DTYPES
from engines.builtin.spec_decode.config import SpeculativeConfig
from engines.options import Options, is_device, option
from models.dtypes import DTYPE_ALIASES
from models.location import model_location

#: The longest engine.tensor_parallel_timeout_s: a year (the ranks' idle wait, too).
MAX_TIMEOUT_S = 365 * 24 * 3600
#: The shortest: the compute group's rendezvous and every step's collectives wait on a rank
#: that is still busy (loading, or finishing its share of a step); under a second they fail a
#: healthy engine (under a microsecond the timedelta is 0 and the group cannot even form).
MIN_TIMEOUT_S = 1


@dataclass(frozen=True)
class EngineConfig(Options):
    error = ConfigError
    # `speculative_config` checked and typed, set once while the config is built (not a field)
    _speculative: ClassVar[SpeculativeConfig | None] = None

    # what to run
    model: str = option(
        "tiny",
        help="a preset, a packaged model, a Hugging Face checkpoint folder or a .gguf file",
    )
    model_overrides: dict[str, Any] = option(
        default_factory=dict, help="any ModelConfig field, e.g. {num_kv_heads: 1}"
    )
    tokenizer: str | None = option(
        None, help="None: the checkpoint's tokenizer, else the built-in BPE"
    )
    load_format: str = option(
        "auto",
        choices=("auto", "dummy", "safetensors"),
        help="auto: checkpoint weights for a folder, dummy for a preset",
    )
    # numerics and placement
    dtype: str = option(
        "auto",
        aliases=DTYPE_ALIASES,
        allowed="auto|float32|bfloat16|float16 (aliases fp32|bf16|fp16)",
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )
    seed: int = option(0, help="dummy weights and unseeded sampling")
    device: str = option(
        "auto",
        valid=is_device,
        allowed="auto|cpu|cuda|cuda:N",
        help="auto | cpu | cuda | cuda:N",
    )
    num_threads: int | None = option(
        None, ge=1, help="CPU intra-op threads; None keeps torch's default"
    )
    tensor_parallel_size: int = option(
        1,
        ge=1,
        help="tensor parallelism (vLLM's name): the model split over this many ranks, each a "
        "process with its own device (CPU: threads of its own, num_threads each); rank 0 "
        "spawns the others, or joins those torchrun started (docs/parallelism.md)",
    )
    # bounded: every rank turns it into a timedelta (inf overflows it) for its groups
    tensor_parallel_timeout_s: float = option(
        60.0,
        ge=MIN_TIMEOUT_S,
        le=MAX_TIMEOUT_S,
        allowed=f"a number of seconds >= {MIN_TIMEOUT_S} and <= {MAX_TIMEOUT_S}",
        help="a collective that takes longer than this fails the engine (a rank died or hung)",
    )
    disaggregation: str = option(
        "none",
        choices=("none", "pd"),
        help="pd: prefill and decode instances, processes of their own, a prompt's K/V handed "
        "from one to the other (vLLM's disaggregated prefill, SGLang's PD disaggregation; "
        "docs/disaggregation.md); none: one engine does both",
    )
    num_prefill_instances: int = option(
        1, ge=1, le=64, help="disaggregation=pd: prefill instances (num_threads threads each)"
    )
    num_decode_instances: int = option(
        1, ge=1, le=64, help="disaggregation=pd: decode instances (num_threads threads each)"
    )
    kv_connector: str = option(
        "shm",
        registry="engines.builtin.disaggregation.connectors:KV_CONNECTORS",
        help="disaggregation=pd: how K/V go from prefill to decode instances: shm (shared "
        "memory, one host) | gloo (torch.distributed over TCP)",
    )
    kv_transfer_timeout_s: float = option(
        30.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        allowed=f"a number of seconds > 0 and <= {MAX_TIMEOUT_S}",
        help="disaggregation=pd: how long a decode instance waits for a prompt's K/V before "
        "kv_load_failure_policy applies (a prefill instance hung or died)",
    )
    kv_load_failure_policy: str = option(
        "recompute",
        choices=("recompute", "fail"),
        help="disaggregation=pd, K/V that did not come: recompute (the decode instance "
        "prefills the prompt itself, counted) | fail (the request fails, with the reason); "
        "vLLM's name",
    )
    enable_expert_parallel: bool = option(
        False,
        help="a mixture-of-experts model's experts placed per rank, num_experts / "
        "tensor_parallel_size whole experts each (vLLM's name; attention stays tensor-parallel); "
        "an MoE model needs it to run on more than one rank (docs/model_families.md)",
    )
    # limits
    max_model_len: int | None = option(None, ge=1, help="None: the model's max_position_embeddings")
    max_num_seqs: int = option(256, ge=1, help="sequences per step")
    max_num_batched_tokens: int | None = option(
        None,
        ge=1,
        help="tokens per step; None: 2048 with chunked prefill (vLLM v1's serving default), "
        "else max(max_model_len, 2048)",
    )
    # KV cache
    kv_cache: str = option(
        "contiguous",
        registry="engines.builtin.kv_cache.sizing:KV_MANAGERS",
        help="the KV cache's manager: none | contiguous | paged (docs/kv_cache.md)",
    )
    kv_cache_dtype: str = option(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="K/V as stored: auto (the compute dtype) | int8 (a float16 scale per token and "
        "head) | fp8 (= fp8_e4m3) | fp8_e5m2 (scale 1, vLLM's default: values past the "
        "format's largest clamped; the C kernels and dense paths read it, not Triton's); read "
        "back widened to the compute dtype",
    )
    kv_cache_memory_bytes: int | None = option(
        None, ge=1, help="None: derived from the device, see kv_budget"
    )
    kv_cache_prefault: bool = option(
        True,
        help="CPU: map every KV page at load, so no measured step pays the OS's first-touch cost",
    )
    gpu_memory_utilization: float = option(
        0.9, gt=0, le=1, help="the share of the device's memory the engine may use"
    )
    block_size: int = option(16, ge=1, help="tokens per KV block")
    enable_prefix_caching: bool = option(
        False, help="paged KV: share the blocks of a common prompt prefix"
    )
    kv_host_tier_bytes: int = option(
        0,
        ge=0,
        help="prefix caching: host memory that keeps full blocks evicted from the KV pool "
        "(least recently used first out), so a later prompt with the same prefix loads them "
        "back instead of recomputing them (vLLM's CPU offloading, LMCache's CPU backend); 0: "
        "none (docs/kv_cache.md, Tiers)",
    )
    kv_disk_tier_bytes: int = option(
        0,
        ge=0,
        help="prefix caching: disk space for blocks evicted from the host tier (or straight from "
        "the pool without one), checksummed files written off the step loop; 0: none",
    )
    kv_disk_tier_prefetch: bool = option(
        True,
        help="the disk tier reads a request's blocks ahead on a thread of its own when the "
        "request arrives, so that its admission finds them in memory; false: read when the "
        "prefix is matched, on the step loop",
    )
    kv_disk_tier_path: str | None = option(
        None,
        help="where the disk tier makes its own folder, removed when the engine closes; None: "
        "the system's temporary folder",
    )
    hybrid_kv_cache: bool = option(
        True,
        help="paged KV on a model whose layers keep different windows (Gemma 2/3): one block "
        "table per layer kind, so windowed layers give back blocks out of their window "
        "(vLLM's hybrid KV cache manager); false: one table for every layer",
    )
    # scheduling
    batching: str = option("continuous", choices=("static", "continuous"), help="the scheduler")
    enable_chunked_prefill: bool = option(
        False, help="split a long prompt over steps of max_num_batched_tokens"
    )
    long_prefill_token_threshold: int = option(
        0,
        ge=0,
        help="chunked prefill (vLLM's name): a prompt takes at most this many tokens of a "
        "step, so one long prompt leaves budget for the others queued beside it; 0: no limit",
    )
    # kernels and weights
    attention_backend: str = option(
        "auto",
        registry="engines.builtin.attention:ATTENTION_BACKENDS",
        help="the attention kernel; auto: the device's best",
    )
    structured_output_backend: str = option(
        "auto",
        registry="engines.builtin.structured:STRUCTURED_OUTPUT_BACKENDS",
        help="the grammar backend of structured outputs (docs/structured_output.md); auto: "
        "xgrammar where installed, else none",
    )
    structured_output_jump_forward: bool = option(
        False,
        help="structured outputs: append the tokens a grammar forces without sampling them "
        "(computed in the next step together; their tokenization may differ from the model's)",
    )
    quantization: str = option(
        "auto",
        registry="engines.builtin.layers:LINEAR_METHODS",
        help="the linear layers' weights: auto (as the checkpoint keeps them: a GGUF file's "
        "quantized types run as stored by the engine's kernels, float weights unquantized) | "
        "none (every weight in the compute dtype, quantized files dequantized) | int8 | int4 "
        "| fp8 (quantized at load from the float weights); null: auto. AWQ, GPTQ and "
        "compressed-tensors folders (int4/int8/FP8) run as stored under auto",
    )
    quantization_group_size: int = option(
        128,
        choices=(32, 64, 128),
        help="int4: input columns per scale/zero; a layer it does not divide gets the largest "
        "smaller one that does (docs/engine_options.md)",
    )
    quantization_zero_point: str = option(
        "float",
        choices=("float", "int", "symmetric"),
        help="int4: float (a float minimum per group, as llama.cpp's Q4_1), int (an integer "
        "zero point with the range widened to include 0) or symmetric (no zero point, "
        "llama.cpp's Q4_0); engines/builtin/layers/quant.py",
    )
    quantization_activations: str = option(
        "float",
        choices=("float", "int8"),
        help="int4, and auto's quantized-file layers, on CPU with the engine's C kernels: "
        "float (weight-only: activations stay in the compute dtype) or int8 (decode rows "
        "quantized per block of 32 and integer dot products, llama.cpp's Q4_1 x Q8_1: ~2.5x "
        "faster per matmul on one core; FP8 layers, and layers whose inputs are not a "
        "multiple of 32, keep float rows, as describe() says)",
    )
    quantize_lm_head: bool | None = option(
        None,
        help="quantize the LM head too (a tied one: a quantized copy of the embedding table, "
        "which the lookup keeps reading); null: when the layers are quantized, as llama.cpp's "
        "GGUFs keep theirs (the fastest at equal quality, docs/engine_options.md); false: dense",
    )
    lm_head_quantization: str = option(
        "auto",
        choices=("auto", "same", "int8"),
        help="a quantized LM head's format: auto or int8 (INT8 per output channel whatever "
        "the layers use: llama.cpp's GGUFs keep Q4 layers beside a Q8_0 head), same (the "
        "layers' method)",
    )
    prepack_weights: bool = option(
        True,
        help="CPU, unquantized fp32/bf16: keep a oneDNN-packed copy of each linear weight (2x "
        "the dense weight memory) so multi-row matmuls skip torch's per-call re-packing",
    )
    native_kernels: bool = option(
        True,
        help="CPU float32: the engine's C kernels (engines/builtin/native), built on first use "
        "with the machine's compiler, and attention_backend=auto resolving to the C decode "
        "kernel; false: torch ops (an explicit attention_backend=cpu still uses its kernel)",
    )
    native_decode_program: bool = option(
        True,
        help="CPU float32 with the C kernels: run each decode-only step's decoder layers as one "
        "call into them (engines/builtin/decode_program.py); false: module by module",
    )
    cpu_wait_policy: str = option(
        "auto",
        choices=("auto", "active", "passive"),
        help="the decode program's threads: auto (at the barriers between its ops, spin up to "
        "2 us, then sleep; the team's size measured as the steps run: fewer threads where a "
        "busy machine makes them faster), active (every thread, spinning: OpenMP's ACTIVE) or "
        "passive (every thread, sleeping at once: OpenMP's PASSIVE); torch's own regions "
        "follow OMP_WAIT_POLICY (docs/engine_options.md, Threads)",
    )
    # typed Any: Hydra cannot merge a mapping into a None dict
    speculative_config: Any = option(
        None,
        help="speculative decoding, vLLM's keys: {method: ngram | draft_model, "
        "num_speculative_tokens, prompt_lookup_min/max (ngram), model / dtype / quantization "
        "(the draft)}; null: off (engines/builtin/spec_decode, docs/engine_options.md)",
    )
    debug_step_delay_fraction: float = option(
        0.0,
        ge=0,
        allowed="a finite number >= 0",  # inf: spin forever
        help="test instrument: busy-wait this fraction of each step's duration inside the step "
        "(a planted slowdown for validating the regression gate; docs/gate.md)",
    )
    # LoRA adapters (docs/lora.md); vLLM's names
    enable_lora: bool = option(
        False, help="serve LoRA adapters of the base model beside it, several in one batch"
    )
    max_loras: int = option(
        1,
        ge=1,
        le=256,
        help="enable_lora: adapters resident at once (their slots), the most "
        "distinct adapters one step runs",
    )
    max_lora_rank: int = option(
        16, ge=1, le=512, help="enable_lora: the highest adapter rank the slots hold"
    )
    max_cpu_loras: int | None = option(
        None,
        ge=1,
        help="enable_lora: adapters kept read in host memory (least recently used "
        "out first); null: max_loras",
    )
    # typed Any and null by default: Hydra adds no keys to an empty mapping without `++`
    lora_modules: Any = option(
        None,
        help="enable_lora: adapter name -> a local PEFT folder (adapter_config.json and "
        "adapter_model.safetensors), read and checked at start; null: none",
    )
    lora_dummy_adapters: int = option(
        0,
        ge=0,
        le=256,
        help="enable_lora: also this many random adapters, dummy-0, dummy-1, "
        "..., on every module at lora_dummy_rank, written once to the cache (for speed "
        "measurements, as load_format=dummy)",
    )
    lora_dummy_rank: int = option(8, ge=1, le=512, help="the dummy adapters' rank")
    # speed; docs/engine_options.md
    enforce_eager: bool = option(
        True, help="false: CUDA graphs for decode steps (CUDA only, attention_backend=triton)"
    )
    cuda_graph_batch_sizes: list[int] | None = option(
        None,
        ge=1,
        allowed=lambda config: (
            f"null or a non-empty list of integers in [1, max_num_seqs={config.max_num_seqs}]"
        ),
        help="the batch sizes captured; None: 1, 2, 4, 8, 16, 24, ... max_num_seqs",
    )
    compile: bool = option(False, help="torch.compile of the model forward")

    def lm_head_method(self) -> str:
        """How the LM head is kept: "none" (dense) or the quantization method it takes."""
        quantized = self.quantize_lm_head
        if quantized is None and self.plugged("quantization").takes_quantized:
            return self.quantization  # auto: as the checkpoint keeps it
        if quantized is None:
            quantized = not self.plugged("quantization").dense
        if not quantized:
            return "none"
        return self.quantization if self.lm_head_quantization == "same" else "int8"

    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` as its typed form, or None when off."""
        return self._speculative

    def _normalise(self) -> None:
        self._set("model", model_location(self.model))  # a trained or packaged model's location
        if self.quantization is None:
            self._set("quantization", "auto")
        spec = None
        if self.speculative_config is not None:
            spec = SpeculativeConfig.from_dict(self.speculative_config)
            self._set("speculative_config", spec.to_dict())
        self._set("_speculative", spec)
        if self.lora_modules is None:
            self._set("lora_modules", {})

    def _check_together(self) -> None:
        for rule in _RULES:
            rule(self)
        if self.cuda_graph_batch_sizes is not None:
            self._set("cuda_graph_batch_sizes", sorted(set(self.cuda_graph_batch_sizes)))


def _graph_sizes_fit_max_num_seqs(config: EngineConfig) -> None:
    sizes = config.cuda_graph_batch_sizes
    if sizes is not None and max(sizes) > config.max_num_seqs:
        raise config.invalid("cuda_graph_batch_sizes")


def _int8_activations_need_int4(config: EngineConfig) -> None:
    takes_int8 = config.plugged("quantization").takes_int8_activations
    if config.quantization_activations == "int8" and not takes_int8:
        raise ConfigError(
            "engine.quantization_activations: 'int8' is for quantization=int4 (INT4 weights "
            "times INT8 activations) and auto (a quantized file's layers); with "
            f"quantization={config.quantization!r} allowed: float"
        )


def _lm_head_method_needs_a_quantized_head(config: EngineConfig) -> None:
    if config.lm_head_quantization == "int8" and config.quantize_lm_head is False:
        raise ConfigError(
            f"engine.lm_head_quantization: {config.lm_head_quantization!r} applies to a "
            "quantized LM head; set engine.quantize_lm_head=true or null, or allowed here: "
            "auto|same"
        )


def _a_quantized_head_same_as_dense_layers_is_dense(config: EngineConfig) -> None:
    same = config.lm_head_quantization == "same"
    layers = config.plugged("quantization")
    if config.quantize_lm_head is True and same and layers.dense:
        raise ConfigError(
            "engine.quantize_lm_head=true asks for a quantized LM head, but "
            "engine.lm_head_quantization='same' takes the layers' method, and "
            f"quantization={config.quantization!r} keeps a float head dense: it would stay "
            "dense; "
            "set lm_head_quantization=auto|int8, or quantize_lm_head=null|false"
        )


def _speculation_needs_continuous_batching(config: EngineConfig) -> None:
    if config.speculative_config is not None and config.batching == "static":
        raise ConfigError(
            "engine.speculative_config needs engine.batching=continuous: a static "
            "batch decodes one padded token per row and step; or speculative_config=null"
        )


def _chunked_prefill_needs_continuous_batching_and_a_cache(config: EngineConfig) -> None:
    if config.enable_chunked_prefill and config.batching == "static":
        raise ConfigError(
            "engine.enable_chunked_prefill=true cannot be combined with "
            "engine.batching=static: a static batch is prefilled whole, in one padded step; "
            "use batching=continuous for chunked prefill, or enable_chunked_prefill=false"
        )
    if config.enable_chunked_prefill and not config.plugged("kv_cache").manager.retains_kv:
        raise ConfigError(
            "engine.enable_chunked_prefill=true needs a KV cache, but engine.kv_cache=none "
            "keeps no K/V between steps to hold a prompt's earlier chunks; use "
            "kv_cache=contiguous, or enable_chunked_prefill=false"
        )
    if config.long_prefill_token_threshold and not config.enable_chunked_prefill:
        raise ConfigError(
            "engine.long_prefill_token_threshold limits a prompt's chunk, and needs "
            "engine.enable_chunked_prefill=true; or long_prefill_token_threshold=0"
        )


def _prefix_caching_needs_paged_kv_and_continuous_batching(config: EngineConfig) -> None:
    if config.enable_prefix_caching and not config.plugged("kv_cache").manager.pages_blocks:
        raise ConfigError(
            f"engine.enable_prefix_caching=true needs engine.kv_cache=paged (cached blocks "
            f"are shared between sequences), not kv_cache={config.kv_cache}"
        )
    if config.enable_prefix_caching and config.batching == "static":
        raise ConfigError(
            "engine.enable_prefix_caching=true is not combined with "
            "engine.batching=static; use batching=continuous"
        )


def _disaggregation_runs_plain_paged_instances(config: EngineConfig) -> None:
    if config.disaggregation == "none":
        return
    refusals = {
        "kv_cache": (
            not config.plugged("kv_cache").manager.pages_blocks,
            "paged (K/V are handed over in blocks)",
        ),
        "batching": (config.batching != "continuous", "continuous"),
        "device": (config.device.startswith("cuda"), "cpu (one device per instance: not yet)"),
        "tensor_parallel_size": (config.tensor_parallel_size > 1, "1"),
        "enable_lora": (config.enable_lora, "false"),
        "speculative_config": (config.speculative_config is not None, "null"),
        "kv_host_tier_bytes": (config.kv_host_tier_bytes > 0, "0"),
        "kv_disk_tier_bytes": (config.kv_disk_tier_bytes > 0, "0"),
        "debug_step_delay_fraction": (config.debug_step_delay_fraction > 0, "0"),
    }
    for key, (refused, allowed) in refusals.items():
        if refused:
            raise ConfigError(
                f"engine.{key}={getattr(config, key)!r} is not combined with "
                f"engine.disaggregation={config.disaggregation!r}; allowed with it: {allowed}"
            )


def _kv_tiers_need_prefix_caching(config: EngineConfig) -> None:
    if config.kv_disk_tier_path is not None and (
        not config.kv_disk_tier_bytes or not config.kv_disk_tier_path.strip()
    ):
        raise ConfigError(
            f"engine.kv_disk_tier_path={config.kv_disk_tier_path!r} is for a disk tier; "
            "allowed: an existing folder with engine.kv_disk_tier_bytes > 0, or null"
        )
    tiers = [
        f"{key}={getattr(config, key)}"
        for key in ("kv_host_tier_bytes", "kv_disk_tier_bytes")
        if getattr(config, key)
    ]
    if not tiers:
        return
    if not config.enable_prefix_caching:
        raise ConfigError(
            f"engine.{' and '.join(tiers)} keep prefix-cached blocks evicted from the KV pool "
            "and need engine.enable_prefix_caching=true (and kv_cache=paged); or set them to 0"
        )
    if config.tensor_parallel_size > 1:
        raise ConfigError(
            f"engine.{' and '.join(tiers)} run on one rank; allowed with them: "
            f"tensor_parallel_size=1, not {config.tensor_parallel_size}"
        )


def _lora_options_need_enable_lora(config: EngineConfig) -> None:
    modules = config.lora_modules
    if not isinstance(modules, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in modules.items()
    ):
        raise ConfigError(
            f"engine.lora_modules: {modules!r} is invalid; allowed: a mapping of adapter name "
            "-> PEFT folder path"
        )
    if (modules or config.lora_dummy_adapters) and not config.enable_lora:
        raise ConfigError(
            "engine.lora_modules and engine.lora_dummy_adapters need engine.enable_lora=true"
        )
    if config.lora_dummy_adapters and config.lora_dummy_rank > config.max_lora_rank:
        raise ConfigError(
            f"engine.lora_dummy_rank={config.lora_dummy_rank} exceeds engine.max_lora_rank="
            f"{config.max_lora_rank}; allowed: a rank <= max_lora_rank"
        )
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ConfigError(
            f"engine.max_cpu_loras={config.max_cpu_loras} is below engine.max_loras="
            f"{config.max_loras}; allowed: null or >= max_loras (every resident adapter is "
            "read in host memory first)"
        )
    if not config.enable_lora:
        return
    if not config.enforce_eager:
        raise ConfigError(
            "engine.enable_lora=true is not combined with CUDA graphs (engine.enforce_eager="
            "false): a graph replays one fixed set of adapters; allowed: enforce_eager=true"
        )
    spec = config.speculative()
    if spec is not None and spec.method != "ngram":
        raise ConfigError(
            f"engine.enable_lora=true with speculative_config.method={spec.method}: the draft "
            "model has no adapters; allowed: ngram"
        )


def _a_whole_prompt_fits_one_step(config: EngineConfig) -> None:
    if (
        not config.enable_chunked_prefill
        and config.max_model_len
        and config.max_num_batched_tokens
        and config.max_num_batched_tokens < config.max_model_len
    ):
        raise ConfigError(
            f"engine.max_num_batched_tokens={config.max_num_batched_tokens} is smaller than "
            f"engine.max_model_len={config.max_model_len}: without chunked prefill a whole "
            "prompt must fit in one step; raise max_num_batched_tokens or lower max_model_len"
        )


_RULES = (
    _graph_sizes_fit_max_num_seqs,
    _int8_activations_need_int4,
    _lm_head_method_needs_a_quantized_head,
    _a_quantized_head_same_as_dense_layers_is_dense,
    _speculation_needs_continuous_batching,
    _chunked_prefill_needs_continuous_batching_and_a_cache,
    _prefix_caching_needs_paged_kv_and_continuous_batching,
    _kv_tiers_need_prefix_caching,
    _disaggregation_runs_plain_paged_instances,
    _a_whole_prompt_fits_one_step,
    _lora_options_need_enable_lora,
)
