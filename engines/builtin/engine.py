"""LLMEngine: requests in, one step at a time, typed events out.

    add_request -> (tokenize) -> Scheduler.schedule -> ModelRunner.execute -> OutputProcessor
    (append the sampled token, detokenize incrementally, check stop conditions) -> events

With `tensor_parallel_size` N > 1 this engine is rank 0 of N (distributed/): it owns the
scheduler, the tokenizer and the events; its runner sends each packed step to the other ranks,
which run the same forward on their shards. A rank that dies or hangs ends the engine
(`failure`, EngineDeadError) within `tensor_parallel_timeout_s`.

Every event carries the step that produced it and a timestamp from the platform's one clock.
Each step's plan and counters are handed to `step_observers` as a `StepRecord` (step_stats.py).
What others may read or hook between steps is public: `limits`, `gauges()`, `weights_source`,
`step_counter`, `add_logits_observer`; the scheduler, runner and KV manager are the engine's own.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import torch

from engines.base import (
    Arrived,
    ConfigError,
    Failed,
    Prompt,
    RequestEvent,
    StepObserver,
    Tokenized,
)
from engines.builtin import native
from engines.builtin.beam_search import BeamGroup, BeamSearch
from engines.builtin.config import EngineConfig
from engines.builtin.distributed.group import TensorParallelError
from engines.builtin.distributed.launch import (
    Peers,
    processes_per_host,
    rank_device,
    start_peers,
)
from engines.builtin.distributed.rendezvous import STARTUP_TIMEOUT_S
from engines.builtin.distributed.shard import check_int4_groups, shard_for
from engines.builtin.distributed.worker import EngineMessage, serve_if_worker_rank
from engines.builtin.kv_cache import KVCacheManager, PagedKVCacheManager
from engines.builtin.kv_cache.groups import KVGroups, kv_groups
from engines.builtin.kv_cache.sizing import KV_MANAGERS, KVSizing
from engines.builtin.kv_cache.storage import gather_blocks, kv_element_bytes
from engines.builtin.kv_cache.tiers import KVTierStore, build_tier_store
from engines.builtin.limits import EngineLimits, token_limits
from engines.builtin.lora.manager import LoRAManager
from engines.builtin.model_runner import LogitsObserver, ModelRunner
from engines.builtin.output_processor import NewTokens, OutputProcessor, seeded_generator
from engines.builtin.penalties import bad_words_token_ids
from engines.builtin.platform import Platform
from engines.builtin.scheduler import Scheduler, StepPlan
from engines.builtin.sequence import Sequence
from engines.builtin.spec_decode.methods import PROPOSERS
from engines.builtin.spec_decode.proposer import Proposal, Proposer, ProposerContext
from engines.builtin.step_stats import EngineGauges, logits_rows, step_record
from engines.builtin.structured import (
    StructuredOutputs,
    build_structured_outputs,
    resolve_structured_output_backend,
)
from engines.sampling_params import SamplingParams
from engines.structured_outputs import StructuredOutputsParams
from models.config import kv_bytes_per_token
from models.dtypes import TORCH_DTYPES
from models.location import resolve_model
from models.tokenizer import tokenizer_for_model


def _profiled(plan: StepPlan) -> AbstractContextManager[Any]:
    """Names a step's model execution `step:<phase>` for harness/measuring/profiling.py while a
    torch profiler runs; otherwise a no-op costing one flag check."""
    if not torch.autograd._profiler_enabled():
        return nullcontext()
    decodes = plan.num_decodes
    phase = "decode" if decodes == len(plan.scheduled) else "prefill" if not decodes else "mixed"
    return torch.profiler.record_function(f"step:{phase}")


class EngineDeadError(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died or hung); `failure` says why."""


class EngineClosedError(EngineDeadError):
    """The engine was closed (`close()`, the end of an LLM's `with` block)."""


class EngineForkedError(RuntimeError):
    """The engine was built in another process, of which os.fork() made this one a copy."""


#: The process in which an engine was built (its OpenMP threads started): a copy of it made by
#: os.fork() has none of those threads, and its parallel regions wait for them for ever.
_threads_started_in: dict[str, int] = {}


def _forked_threads_error(
    pid: int | None, what: str, threads: int | None = None
) -> EngineForkedError | None:
    """The error for a step (or a build) on several threads (`threads`, None: torch's) in a
    copy made by os.fork() of process `pid`, where `what` happened; None where it is safe."""
    threads = threads or torch.get_num_threads()
    if pid is None or pid == os.getpid() or threads <= 1:
        return None
    # libgomp's threads are not copied by fork(): a parallel region (torch's, the C kernels')
    # waits for them for ever; on one thread it opens none
    return EngineForkedError(
        f"{what} in process {pid}, and this process ({os.getpid()}) is a copy of it made by "
        "os.fork(): the OpenMP threads an engine's steps run on are not copied, so a step on "
        f"{threads} threads would wait for them for ever; call "
        "torch.set_num_threads(1) in this process first, or use a process started with "
        "multiprocessing's 'spawn' method"
    )


#: What a closed engine lets go of: the model and its weights, the KV cache, the requests, the
#: draft model (their memory is freed once nothing else holds them).
_RELEASED_AT_CLOSE = (
    "runner",
    "kv",
    "scheduler",
    "output",
    "sequences",
    "beam_search",
    "structured",
    "proposer",
    "_pending_events",
)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.closed = False
        self.failure: str | None = None  # why the engine cannot go on (EngineDeadError)
        # an engine built in a copy, made by os.fork(), of a process whose engines ran
        forked = _forked_threads_error(
            _threads_started_in.get("pid"), "an engine ran", config.num_threads
        )
        if forked is not None:
            raise forked
        self.pid = os.getpid()  # the process that built it (a fork's copy: EngineForkedError)
        _threads_started_in["pid"] = self.pid
        self.peers: Peers | None = None  # the other tensor-parallel ranks
        if config.tensor_parallel_size > 1 and serve_if_worker_rank():
            # torchrun started this process as a rank other than 0: it has served rank 0's
            # engines until rank 0 ended them, and has nothing else to do
            raise SystemExit(0)
        self.config = config
        self._resolve_model()
        max_model_len, batched = token_limits(config, self.model_config)
        if config.tensor_parallel_size > 1:
            self.peers = self._start_peers(max_model_len)
        try:
            self._build_runner_and_kv(max_model_len, batched)
        except BaseException:
            self._end_ranks(abandon=True)
            raise
        self._build_step_parts()
        try:
            self.proposer = self._make_proposer()
        except BaseException:  # a draft the engine cannot use: end the ranks started for it
            self._end_ranks(abandon=True)
            raise
        self.last_draft_ns = 0  # the proposer's time before the last step

    # ---- construction -----------------------------------------------------------------------

    def _resolve_model(self) -> None:
        """The device, the model's shape, its tokenizer and dtype; what cannot work fails
        here, before any rank starts."""
        config = self.config
        tp_size = config.tensor_parallel_size
        self.platform = Platform.create(
            rank_device(config.device, 0, tp_size), config.num_threads, processes_per_host(tp_size)
        )
        self.model_config = resolve_model(config.model, config.model_overrides)
        # a model N does not split, or INT4 groups that would straddle its shards, fail
        # before any rank starts
        shard = shard_for(self.model_config, 0, tp_size, config.enable_expert_parallel)
        if config.plugged("quantization").groups_inputs:
            check_int4_groups(self.model_config, shard, config.quantization_group_size)
        model = self.model_config
        untested = ("Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
        if config.enable_lora and (model.num_experts or model.architecture in untested):
            raise ConfigError(
                f"engine.enable_lora: true is invalid for a {model.architecture} (LoRA on "
                "experts, on Phi-3's packed projections and on Gemma is not supported yet); "
                "allowed: false"
            )
        self.tokenizer = tokenizer_for_model(self.config.model, self.config.tokenizer)
        self.dtype = (
            self.platform.default_dtype() if config.dtype == "auto" else TORCH_DTYPES[config.dtype]
        )
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer {self.tokenizer.name} has {self.tokenizer.vocab_size} ids but the "
                f"model's vocab_size is {self.model_config.vocab_size}; use a model whose "
                "vocabulary covers the tokenizer"
            )
        self.eos_ids = sorted(
            set(self.tokenizer.special.eos_ids) | set(self.model_config.eos_token_ids)
        )

    def _start_peers(self, max_model_len: int) -> Peers:
        """The other tensor-parallel ranks, each building its shard of this engine."""
        config = self.config
        return start_peers(
            config.tensor_parallel_size,
            self.platform.device,
            config.tensor_parallel_timeout_s,
            EngineMessage(
                config.to_dict(),
                str(self.dtype).removeprefix("torch."),
                max_model_len,
                self.tokenizer.vocab_size,
            ),
            owner=self,
        )

    def _build_runner_and_kv(self, max_model_len: int, batched: int) -> None:
        """The model and its weights first (the KV pool is sized from the memory they leave),
        then the KV manager, the limits, and the pool on every rank."""
        config = self.config
        self.runner = ModelRunner(
            self.model_config,
            config,
            self.platform,
            self.dtype,
            max_model_len,
            self.tokenizer.vocab_size,
            self.eos_ids,
            tp=None if self.peers is None else self.peers.tp,
        )
        self.kv_budget_reason = ""  # where the KV budget came from, set with the budget
        cfg = self.model_config
        # window -> its layers, for each step's roofline counts
        self.layer_windows = Counter(cfg.layer_window(i) for i in range(cfg.num_layers))
        self.kv, max_num_seqs, budget = self._make_kv_manager(max_model_len, batched)
        self.limits = EngineLimits(max_model_len, max_num_seqs, batched, budget)
        ring = bool(getattr(self.kv, "ring", False))
        # one block table per group (hybrid.py)
        self.kv_groups: KVGroups | None = getattr(self.kv, "groups", None)
        groups = self.kv_groups
        if self.peers is not None:
            # the other ranks take it once their shards are loaded
            self.peers.channel.send(
                ("kv", self.kv.layout, ring, self.limits, groups),
                timeout_s=max(config.tensor_parallel_timeout_s, STARTUP_TIMEOUT_S),
            )
            self.runner.peers = self.peers.channel
        self.runner.allocate_kv_cache(self.kv.layout, ring, self.limits, groups)
        if config.kv_host_tier_bytes or config.kv_disk_tier_bytes:
            self._attach_kv_tiers()

    def _attach_kv_tiers(self) -> None:
        """The host and disk tiers behind the prefix cache (kv_cache/tiers.py)."""
        config = self.config
        if self.kv_groups is not None or not isinstance(self.kv, PagedKVCacheManager):
            raise ConfigError(
                "engine.kv_host_tier_bytes / kv_disk_tier_bytes keep one block table's blocks; "
                f"{config.model}'s layers keep different windows (a hybrid cache); "
                "allowed with it: engine.hybrid_kv_cache=false, or no tiers"
            )
        store = build_tier_store(
            self.kv_block_bytes,
            config.kv_host_tier_bytes,
            config.kv_disk_tier_bytes,
            config.kv_disk_tier_path,
            config.kv_disk_tier_prefetch,
        )
        self.kv.attach_tiers(store)

    @property
    def kv_block_bytes(self) -> int:
        """One block of every layer's planes (scales included): what a tier keeps, and a row of
        what a prefill instance hands over."""
        return sum(
            plane[0].numel() * plane.element_size()
            for cache in self.runner.kv_caches
            for plane in cache.planes
        )

    def _build_step_parts(self) -> None:
        """What a step goes through besides the runner: the scheduler, the requests'
        sequences, the output processor, the step observers."""
        self.scheduler = Scheduler(self.config, self.kv, self.limits)
        if self.runner.lora is not None:
            self.scheduler.lora_ready = self.runner.lora.ready
        self.sequences: dict[str, Sequence] = {}
        self.output = OutputProcessor(
            self.tokenizer,
            self.scheduler,
            self.sequences,
            self.eos_ids,
            self.limits.max_model_len,
            self.platform.device,
            self.config.structured_output_jump_forward,
        )
        self.beam_search = BeamSearch(
            self.scheduler, self.sequences, self.eos_ids, self.limits.max_model_len
        )
        self.structured_output_backend = resolve_structured_output_backend(
            self.config.structured_output_backend
        )
        self.structured = build_structured_outputs(
            self.structured_output_backend,
            self.tokenizer,
            self.runner.sample_vocab_size,
            self.eos_ids,
        )
        self.runner.structured = self.structured
        self.step_observers: list[StepObserver] = []
        self._pending_events: list[RequestEvent] = []
        # disaggregation: request id -> its prompt's K/V, read when its prefill completed
        self.exported_kv: dict[str, torch.Tensor] = {}

    def _make_proposer(self) -> Proposer | None:
        spec = self.config.speculative()
        if spec is None:
            return None
        if self.runner.ring:
            raise ConfigError(
                "engine.speculative_config: verifying drafts writes K/V ahead of what a "
                "sequence keeps, which a sliding-window ring (kv_cache=contiguous on a model "
                f"with sliding_window={self.model_config.sliding_window}) would wrap over; use "
                "kv_cache=paged, or speculative_config=null"
            )
        max_len = self.limits.max_model_len
        if spec.num_speculative_tokens >= max_len:  # a sequence never has room for them
            raise ConfigError(
                f"engine.speculative_config.num_speculative_tokens: {spec.num_speculative_tokens}"
                f" drafts a step do not fit a sequence of engine.max_model_len={max_len}; "
                f"allowed: 1..{max_len - 1}"
            )
        context = ProposerContext(
            self.runner.sample_vocab_size,
            self.model_config.vocab_size,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            self.config.kv_cache,
            type(self.kv),
            self.limits.max_model_len,
            lambda overrides: LLMEngine(replace(self.config, **overrides)),
        )
        return PROPOSERS.get(spec.method)(spec, context)

    def _make_kv_manager(self, max_model_len: int, batched: int) -> tuple[KVCacheManager, int, int]:
        config, shard = self.config, self.runner.model.shard
        # this rank's K/V heads: the pool, its budget and its blocks are per device
        cfg = replace(self.model_config, num_kv_heads=shard.num_kv_heads)
        element = kv_element_bytes(self.dtype, cfg.head_dim, config.kv_cache_dtype)
        weight_bytes = self.runner.model.weight_bytes()["weight_bytes"]

        def budget_for(one_sequence_bytes: int) -> tuple[int, str]:
            budget, reason = self.platform.kv_budget(
                config.kv_cache_memory_bytes,
                weight_bytes,
                config.gpu_memory_utilization,
                one_sequence_bytes,
            )
            shared_host = not self.platform.is_cuda and config.kv_cache_memory_bytes is None
            if shard.size > 1 and shared_host:
                # the ranks share this host's memory: each takes its part of the default
                budget //= shard.size
                reason += f", / {shard.size} tensor-parallel ranks sharing the host"
            return budget, reason

        self.kv_token_bytes = round(kv_bytes_per_token(cfg, element))
        sized = KV_MANAGERS.get(config.kv_cache).size(
            KVSizing(
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_model_len,
                max_num_batched_tokens=batched,
                block_size=config.block_size,
                bytes_per_token=self.kv_token_bytes,
                sliding_window=cfg.kv_sliding_window,
                enable_chunked_prefill=config.enable_chunked_prefill,
                enable_prefix_caching=config.enable_prefix_caching,
                kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                on_cuda=self.platform.is_cuda,
                budget_for=budget_for,
                groups=kv_groups(cfg) if config.hybrid_kv_cache else None,
            )
        )
        self.kv_budget_reason = sized.reason
        return sized.manager, sized.max_num_seqs, sized.budget_bytes

    def _kv_group_facts(self) -> dict[str, Any] | None:
        """A hybrid cache's groups (kv_cache/groups.py); None: one block table."""
        groups = self.kv_groups
        if groups is None:
            return None
        return {
            "windows": list(groups.windows),
            "layers_per_group": groups.group_size,
            "block_bytes": self.kv.layout.block_size * self.kv.layout.bytes_per_token,
        }

    def describe(self) -> dict[str, Any]:
        """Facts about the loaded engine, for run folders and reports."""
        self._ensure_not_closed()
        layout = self.kv.layout
        return {
            "engine": "builtin",
            "model": self.config.model,
            "architecture": self.model_config.architecture,
            "model_config": self.model_config.to_dict(),
            "num_parameters": self.model_config.num_parameters(),
            # what one token's forward reads: its experts only (all of them: a dense model)
            "active_parameters": self.model_config.num_parameters(active=True),
            "weights": self.weights_source,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.platform.device),
            "num_threads": self.platform.num_threads,
            # weights and KV figures below are per rank (each rank holds its shard)
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "tensor_parallel": self._tensor_parallel_facts(),
            "tokenizer": self.tokenizer.name,
            "tokenizer_vocab_size": self.tokenizer.vocab_size,
            "structured_output_backend": self.structured_output_backend,
            "kv_cache": self.config.kv_cache,
            # one token of every layer (a hybrid cache's block holds a group's layers)
            "kv_bytes_per_token": self.kv_token_bytes,
            "kv_groups": self._kv_group_facts(),
            "kv_pool_bytes": layout.pool_bytes,
            # the budget the pool was sized from, and where that number came from
            "kv_budget_bytes": self.limits.kv_budget_bytes,
            "kv_budget_reason": self.kv_budget_reason,
            "kv_num_blocks": layout.num_blocks,
            "kv_block_size": layout.block_size,
            "max_model_len": self.limits.max_model_len,
            "max_num_seqs": self.limits.max_num_seqs,
            "max_num_batched_tokens": self.limits.max_num_batched_tokens,
            "attention_backend": self.runner.attention_backend,
            # the C kernels' fused norm / SiLU / rotary ops in use (CPU float32)
            "native_kernels": self.runner.native_kernels,
            # why not, when not: off by option, device or dtype, or a failed build or load
            "native_kernels_reason": self.runner.native_kernels_reason,
            # the instruction set they were compiled for, which picks the GEMM's register block
            "native_kernels_isa": native.layout().isa if self.runner.native_kernels else None,
            "batching": self.config.batching,
            # aborted sequences, the KV blocks their aborts returned, and the most engine
            # steps started between an abort and its blocks' return (0: before the next step)
            "aborted_sequences": self.scheduler.num_aborted,
            "abort_kv_blocks_freed": self.scheduler.abort_blocks_freed,
            "abort_kv_free_steps_max": self.scheduler.abort_free_steps_max,
            "enable_chunked_prefill": self.config.enable_chunked_prefill,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "quantization": self.config.quantization,
            # int4's options as asked; what each layer got (a group size fitted to its input
            # size, or the INT8 fallback) is in linear_methods
            "quantization_group_size": self.config.quantization_group_size,
            "quantization_zero_point": self.config.quantization_zero_point,
            "quantization_activations": self.config.quantization_activations,
            "linear_methods": self.runner.model.linear_methods(),
            # speculative decoding: vLLM's keys, validated (null: off), and the proposer's facts
            "speculative_config": self.config.speculative_config,
            "proposer": None if self.proposer is None else self.proposer.describe(),
            # LoRA adapters: the slots, each adapter's rank and targets, loads and evictions
            "lora": None if self.runner.lora is None else self.runner.lora.describe(),
            "kv_cache_dtype": self.config.kv_cache_dtype,
            # pages mapped at load (CPU); False: first writes fault them in during the run
            "kv_cache_prefault": self.config.kv_cache_prefault and not self.platform.is_cuda,
            **self.runner.model.weight_bytes(),
            **self.runner.speed_facts(),
            "roofline_shape": self._roofline_shape(),
        }

    def _tensor_parallel_facts(self) -> dict[str, Any] | None:
        if self.peers is None:
            return None
        shard = self.runner.model.shard
        return {
            "launcher": self.peers.launcher,
            "backend": self.peers.backend,
            "heads_per_rank": shard.num_heads,
            "kv_heads_per_rank": shard.num_kv_heads,
            "kv_heads_replicated": shard.kv_replicated,
            "vocab_per_rank": shard.vocab_per_rank,
            "timeout_s": self.config.tensor_parallel_timeout_s,
        }

    def close(self) -> None:
        """Release the engine: its other tensor-parallel ranks end (spawned workers exit, and
        the torch.distributed world made for them goes), the draft model's engine closes, and
        the model, its weights and the KV cache are let go. Idempotent; afterwards every call
        that would run the engine raises EngineClosedError. An engine that is dropped
        instead ends its ranks when it is garbage-collected, or when the process exits."""
        if self.closed:
            return
        self.closed = True
        self._end_ranks()
        kv = self.__dict__.get("kv")
        if kv is not None and kv.tiers is not None:
            kv.tiers.close()
        proposer = self.__dict__.get("proposer")
        if proposer is not None:
            proposer.close()
        for name in _RELEASED_AT_CLOSE:
            self.__dict__.pop(name, None)
        self.step_observers = []

    def ensure_open(self) -> None:
        """Raise EngineClosedError after close(), EngineDeadError after a failure,
        EngineForkedError in a copy made by os.fork() that would hang."""
        self._ensure_not_closed()
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        forked = _forked_threads_error(self.pid, "this engine was built")
        if forked is not None:
            raise forked

    def _ensure_not_closed(self) -> None:
        if self.closed:
            raise EngineClosedError(
                "the engine is closed (close(), or the end of its `with` block); build a new "
                "LLM to generate again"
            )

    def _end_ranks(self, abandon: bool = False) -> None:
        """End the other tensor-parallel ranks (nothing to do with one rank). `abandon`: they
        may be busy (loading their shards while rank 0 failed or was interrupted): spawned
        workers are killed at once rather than asked to exit."""
        if self.peers is not None:
            self.peers.close(failed=abandon or self.failure is not None)

    def _roofline_shape(self) -> dict[str, float]:
        """Per-token constants of the roofline's FLOP count and of its communication
        (harness/measuring/roofline.py)."""
        cfg, model = self.model_config, self.runner.model
        experts = {  # one expert's linear layers, as an MoE layer holds each
            name: m for name, m in model.linear_layers().items() if ".mlp.experts." in name
        }
        blocks = sum(
            m.in_features * m.out_features
            for name, m in model.linear_layers().items()
            if name.startswith("layers.") and name not in experts
        )
        # the experts of every MoE layer (all alike): one expert's share of their weights
        instances = max(1, cfg.num_experts * sum(map(cfg.is_moe_layer, range(cfg.num_layers))))
        element = self.dtype.itemsize
        parallel = model.shard.size > 1
        return {
            # this rank's share: its heads, its slice of the MLP and of the vocabulary
            "block_linear_params": blocks,
            "lm_head_params": model.lm_head.in_features * model.lm_head.out_features,
            "attention_flops_per_pair": 4 * cfg.num_layers * model.shard.num_heads * cfg.head_dim,
            # tensor parallelism's collectives: o_proj's, down_proj's, the embedding's
            "allreduces_per_step": 2 * cfg.num_layers + 1 if parallel else 0,
            "hidden_bytes_per_token": cfg.hidden_size * element,
            "logits_bytes_per_row": model.shard.layout.padded_vocab * element,
            # LoRA: an adapter's A and B on this rank (the mean of those read), multiplied by
            # each of its token rows and read once per step that runs it
            "lora_params_per_adapter": (
                0.0
                if self.runner.lora is None
                else self.runner.lora.mean_adapter_params() / model.shard.size
            ),
            # mixture of experts (the experts are out of block_linear_params): one expert's
            # parameters and bytes as stored, multiplied by each (token, expert) pair and read
            # once per (layer, expert) pair a step touches
            "moe_expert_params": sum(m.in_features * m.out_features for m in experts.values())
            / instances,
            "moe_expert_bytes": sum(m.weight_bytes() for m in experts.values()) / instances,
            "moe_all_expert_bytes": sum(m.weight_bytes() for m in experts.values()),
        }

    # ---- what others may read or hook ---------------------------------------------------------

    @property
    def weights_source(self) -> str:
        """Where the loaded weights came from: "checkpoint" or "dummy"."""
        self._ensure_not_closed()
        return self.runner.weights_source

    @property
    def lora(self) -> LoRAManager | None:
        """The LoRA adapters this engine serves (None: engine.enable_lora=false)."""
        self._ensure_not_closed()
        return self.runner.lora

    @property
    def kv_tiers(self) -> KVTierStore | None:
        """The KV cache's host and disk tiers (None: none)."""
        self._ensure_not_closed()
        return self.kv.tiers

    @property
    def step_counter(self) -> int:
        """The number the next step will carry (events stamped between steps carry it)."""
        self._ensure_not_closed()
        return self.scheduler.step_counter

    def gauges(self) -> EngineGauges:
        """Engine state now, between steps: a frozen snapshot other threads may keep."""
        self._ensure_not_closed()
        layout = self.kv.layout
        return EngineGauges(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_bytes_reserved=self.kv.bytes_reserved(),
            kv_pool_bytes=layout.pool_bytes,
            kv_blocks_used=self.kv.num_blocks_in_use,
            kv_num_blocks=layout.num_blocks,
            step=self.scheduler.step_counter,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            **self._tier_gauges(),
        )

    def _tier_gauges(self) -> dict[str, tuple[int, int]]:
        tiers = self.kv.tiers
        if tiers is None:
            return {}
        hits = self.scheduler.prefix_tier_hits
        return {
            "kv_tier_hits": (hits.get("host", 0), hits.get("disk", 0)),
            "kv_tier_blocks": (tiers.host_blocks, tiers.disk_blocks),
        }

    def add_logits_observer(self, observer: LogitsObserver) -> None:
        """Call `observer(plan, logits)` on every step with the float32 logits of every token
        the step computes (model_runner.LogitsObserver). Slows steps while registered."""
        self._ensure_not_closed()
        self.runner.logits_observers.append(observer)

    def remove_logits_observer(self, observer: LogitsObserver) -> None:
        """Undo `add_logits_observer` (ValueError if `observer` is not registered)."""
        self._ensure_not_closed()
        self.runner.logits_observers.remove(observer)

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode_prompt(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        arrival_ns: int | None = None,
        priority: int = 0,
        lora_name: str | None = None,
        export_kv: bool = False,
        remote_kv: torch.Tensor | None = None,
    ) -> None:
        """Tokenize and queue a request (under LoRA adapter `lora_name`, one of
        engine.lora_modules; None: the base model); raises ValueError (naming the field) if it
        is invalid. Disaggregation (engines/builtin/disaggregation): `export_kv` keeps the
        prompt's K/V in `exported_kv` once computed (a prefill instance); `remote_kv` are
        those K/V, loaded instead of computed (a decode instance)."""
        self.ensure_open()
        arrival_ns = self.platform.now_ns() if arrival_ns is None else arrival_ns
        sampling = sampling or SamplingParams()
        if request_id in self.sequences:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.check_request(token_ids, sampling)
        self.check_adapter(lora_name)
        if remote_kv is not None:
            self._check_remote_kv(remote_kv, token_ids, sampling)
        seq = Sequence(request_id, token_ids, sampling, arrival_ns, priority, lora_name)
        seq.export_kv, seq.remote_kv = export_kv, remote_kv
        if lora_name is not None:
            assert self.runner.lora is not None  # check_adapter refused it otherwise
            seq.kv_namespace = self.runner.lora.namespace(lora_name)
        seq.pending_forks = sampling.num_sequences - 1
        seq.generator = seeded_generator(sampling.seed, self.platform.device)
        if sampling.bad_words:
            seq.bad_words_token_ids = bad_words_token_ids(
                sampling.bad_words,
                lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                self.model_config.vocab_size,
            )
        self.output.add(seq)
        self.sequences[request_id] = seq
        if sampling.use_beam_search:
            seq.pending_forks = 0  # its beams fork as the search goes (beam_search.py)
            self.beam_search.add(seq)
        if sampling.structured_outputs is not None:
            assert self.structured is not None  # check_request refused it otherwise
            seq.grammar, seq.grammar_compile_ns, seq.grammar_cache_hit = self.structured.matcher(
                sampling.structured_outputs
            )
        self.scheduler.add(seq)
        step = self.scheduler.step_counter
        self._pending_events += [
            Arrived(request_id, step, arrival_ns),
            Tokenized(request_id, step, self.platform.now_ns(), len(token_ids)),
        ]

    def _check_remote_kv(
        self, remote_kv: torch.Tensor, token_ids: list[int], sampling: SamplingParams
    ) -> None:
        """K/V handed over by a prefill instance fit this engine's blocks: one row of
        `kv_block_bytes` per block of the prompt's first len(prompt) - 1 tokens."""
        if not isinstance(self.kv, PagedKVCacheManager) or self.kv_groups is not None:
            raise ValueError(
                "remote_kv: K/V are loaded into one block table; allowed with "
                "engine.kv_cache=paged (and no hybrid cache)"
            )
        if sampling.prompt_logprobs is not None:
            raise ValueError(
                "remote_kv: a request asking for prompt_logprobs computes every prompt token; "
                "allowed with it: no remote_kv"
            )
        blocks = -(-(len(token_ids) - 1) // self.kv.block_size)
        shape = (blocks, self.kv_block_bytes)
        if remote_kv.dtype != torch.uint8 or tuple(remote_kv.shape) != shape:
            raise ValueError(
                f"remote_kv: {remote_kv.dtype} {tuple(remote_kv.shape)} is not the K/V of "
                f"{len(token_ids) - 1} prompt tokens in this engine's blocks; allowed: uint8 "
                f"{shape}"
            )

    def take_exported_kv(self, request_id: str) -> torch.Tensor | None:
        """A request's prompt K/V (add_request's export_kv), once: None if not computed."""
        return self.exported_kv.pop(request_id, None)

    def remove_lora(self, name: str) -> None:
        """Forget adapter `name` (vLLM's unload); ValueError naming it while requests use it,
        or when there is none such."""
        lora = self._adapters()
        seqs = [*self.scheduler.waiting, *self.scheduler.running]
        lora.remove(name, in_use=any(seq.lora_name == name for seq in seqs))

    def _adapters(self) -> LoRAManager:
        if self.runner.lora is None:
            raise ValueError(
                "lora_name: this engine serves no adapters; allowed: engine.enable_lora=true"
            )
        return self.runner.lora

    def check_adapter(self, lora_name: str | None) -> None:
        """That `lora_name` is None or an adapter this engine has (ValueError naming `lora`)."""
        if lora_name is None:
            return
        if self.runner.lora is None:
            raise ValueError(
                f"lora: {lora_name!r} asked of an engine without adapters; allowed: null (or "
                "engine.enable_lora=true with the adapter in engine.lora_modules)"
            )
        self.runner.lora.check_known(lora_name)

    def check_request(self, token_ids: list[int], sampling: SamplingParams) -> None:
        """Every check `add_request` makes, without queueing anything: a frontend (the
        server) calls it to refuse a request before it answers. Raises ValueError naming
        the field."""
        self._ensure_not_closed()
        sampling.validate()
        samples = max(sampling.n, sampling.best_of or 1)  # beams: _check_beam_search
        if samples > 1 and self.config.batching == "static" and not sampling.use_beam_search:
            name = "n" if sampling.n > 1 else "best_of"
            raise ValueError(
                f"SamplingParams.{name}: {getattr(sampling, name)} needs parallel sampling, which "
                "engine.batching=static does not do; allowed: 1 (or "
                "engine.batching=continuous)"
            )
        if sampling.use_beam_search:
            self._check_beam_search(sampling)
        if sampling.structured_outputs is not None:
            check_structured_outputs(self.structured, sampling.structured_outputs)
        check_prompt_length(token_ids, self.limits.max_model_len)
        self.check_fits(len(token_ids), sampling.max_tokens)
        check_token_ids(token_ids, sampling, self.model_config.vocab_size)
        check_some_token_allowed(
            sampling,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            self.model_config.vocab_size,
            self.eos_ids,
        )

    def _check_beam_search(self, sampling: SamplingParams) -> None:
        """What the engine's configuration allows a beam search: beams run side by side
        (continuous batching, all of them at once) and are chosen, not drafted."""
        if self.config.batching == "static":
            raise ValueError(
                "SamplingParams.use_beam_search: true needs beams forked as the search goes, "
                "which engine.batching=static does not do; allowed: false (or "
                "engine.batching=continuous)"
            )
        if self.proposer is not None:
            raise ValueError(
                "SamplingParams.use_beam_search: true is not done with speculative decoding "
                "(a beam's next token is chosen across its group, not verified); allowed: "
                "false (or no engine.speculative_config)"
            )
        check_beams_fit(sampling, self.limits.max_num_seqs)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """A request whose KV can never fit the pool, even alone, fails now with the reason
        (otherwise it would be preempted and readmitted forever)."""
        if not self.kv.pages_blocks:
            return  # contiguous slots always hold max_model_len tokens; none holds nothing
        layout = self.kv.layout
        longest = min(num_prompt_tokens + max_tokens, self.limits.max_model_len)
        needed = self.kv.blocks_to_hold(longest, min(longest, self.limits.max_num_batched_tokens))
        if needed > layout.num_blocks - 1:
            raise ValueError(
                f"prompt: {num_prompt_tokens} prompt tokens + max_tokens={max_tokens} need "
                f"{needed} KV blocks of {layout.block_size} tokens, but the whole pool has "
                f"{layout.num_blocks - 1} (engine.kv_cache_memory_bytes); the request can never "
                "run"
            )

    def abort_request(self, request_id: str) -> None:
        """Abort every sample of the request and free its KV memory."""
        self._ensure_not_closed()
        step, now = self.scheduler.step_counter, self.platform.now_ns()
        group = self.beam_search.drop(request_id, "abort")
        if group is not None:
            self._pending_events += self.output.final.empty(group.first, step, now)
        samples = [s for s in self.sequences.values() if s.request_id == request_id]
        for seq in samples:
            del self.sequences[seq.key]
            self._release_drafts(seq)
            if seq.is_finished:
                continue
            self.scheduler.finish(seq, "abort")
            if not seq.sampling.ranks_samples:
                self._pending_events.append(self.output.finished(seq, step, now))
        if samples and samples[0].sampling.ranks_samples:  # its outputs were still held
            self._pending_events += self.output.final.empty(samples[0], step, now)

    def has_request(self, request_id: str) -> bool:
        """Is any sample of the request still in the engine?"""
        self._ensure_not_closed()
        return any(seq.request_id == request_id for seq in self.sequences.values())

    def has_unfinished_requests(self) -> bool:
        self._ensure_not_closed()
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestEvent]:
        self.ensure_open()
        events, self._pending_events = self._pending_events, []
        start = self.platform.now_ns()
        events += self._fail_unreadable_adapters(start)
        proposals = self._propose() if self.proposer is not None else {}
        plan = self.scheduler.schedule(proposals)
        try:
            self._move_kv_blocks(plan)
        except Exception as exc:
            return events + self.output.schedule_events(plan, start) + self._fail_step(plan, exc)
        if plan.is_empty:  # its preemptions (idle beams giving way) are still news
            return (
                events
                + self.output.schedule_events(plan, start)
                + self._fail_unschedulable(plan, start)
            )
        for seq in plan.preempted:
            self._release_drafts(seq)
        events += self.output.schedule_events(plan, start)
        # rows whose logits the LM head computes (counted before their tokens are added)
        logits_tokens = logits_rows(plan) if self.step_observers else 0
        try:
            tokens = self._execute(plan)
        except EngineDeadError:
            raise
        except Exception as exc:  # a failed step fails its requests, not the engine
            return events + self._fail_step(plan, exc)
        self._export_prompt_kv(plan)
        new_tokens = self._complete_step(plan, tokens)
        searched, beams_failed = self._search(plan.step)
        end = self._end_step(start)
        prompt_logprobs = self.runner.last_prompt_logprobs
        events += self.output.prompt_logprobs_events(plan, prompt_logprobs, plan.step, end)
        events += self.output.events(new_tokens, plan.step, end)
        for group in searched:
            events += self.output.final.beam_events(group, plan.step, end)
        events += beams_failed
        if self.step_observers:
            self._report_step(plan, start, end, logits_tokens)
        return events

    def _move_kv_blocks(self, plan: StepPlan) -> None:
        """KV tiers: the plan's block saves and loads, which must run even when it schedules
        nothing (the runner's transfer_blocks)."""
        self.runner.last_transfer_ns = 0
        if plan.kv_transfers:
            self.runner.transfer_blocks(plan.kv_transfers, self.kv)

    def _export_prompt_kv(self, plan: StepPlan) -> None:
        """Disaggregation: the K/V of each export_kv prompt this step completed, copied out of
        the pool before its sequence finishes and frees them (the first len(prompt) - 1
        tokens': the decode instance computes the last one, to sample)."""
        for item in plan.scheduled:
            seq = item.seq
            done = item.num_computed_before + item.num_new_tokens >= seq.num_prompt_tokens
            if seq.export_kv and done and not seq.num_output_tokens and seq.sample_index == 0:
                start = self.platform.now_ns()
                blocks = -(-(seq.num_prompt_tokens - 1) // self.kv.block_size)
                table = self.kv.block_tables[seq.seq_id][:blocks]
                self.exported_kv[seq.request_id] = (
                    gather_blocks(self.runner.kv_caches, table)
                    if table
                    else torch.empty(0, self.kv_block_bytes, dtype=torch.uint8)  # 1-token prompt
                )
                self.runner.last_transfer_ns += self.platform.now_ns() - start

    def _search(self, step: int) -> tuple[list[BeamGroup], list[RequestEvent]]:
        """The step's beam candidates into their groups: the groups whose search ended, and
        Failed for each group a search error ended (it fails its request, not the engine)."""
        candidates = self.runner.last_beam_candidates
        try:
            return self.beam_search.report(candidates), []
        except Exception as exc:
            failed: list[RequestEvent] = []
            for request_id in dict.fromkeys(seq.request_id for seq, _ in candidates):
                if self.beam_search.drop(request_id, "error") is not None:
                    reason = f"beam search failed: {type(exc).__name__}: {exc}"
                    failed.append(Failed(request_id, step, self.platform.now_ns(), reason))
            return [], failed

    def _execute(self, plan: StepPlan) -> list[list[int]]:
        """The model runner's share of the step. Ranks that part end the engine
        (EngineDeadError); any other error is the step's alone (`step` fails its requests)."""
        try:
            with _profiled(plan):
                return self.runner.execute(plan, self.kv)
        except TensorParallelError as exc:  # the ranks have parted: the engine is over
            self.failure = f"{type(exc).__name__}: {exc}"
            self._end_ranks()
            self._fail_step(plan, exc)
            raise EngineDeadError(self.failure) from exc
        except Exception:
            raise
        except BaseException as exc:
            if self.peers is not None:
                # Ctrl-C inside the step: the other ranks are left in its collectives, where
                # they can take no message (close would wait out its timeouts on them)
                self.failure = f"{type(exc).__name__} during a step: the ranks are out of step"
                self._end_ranks()
            raise

    def _complete_step(self, plan: StepPlan, tokens: list[list[int]]) -> NewTokens:
        """The step's tokens into the scheduler (kept drafts only) and the sequences (stop
        checks, text); the proposer forgets what finished."""
        kept = _kept_drafts(plan, tokens) if plan.num_draft_tokens else {}
        self.scheduler.complete_step(plan, kept)
        new_tokens = self.output.process(plan, tokens, self.runner.last_logprobs)
        if self.proposer is not None:
            for item in plan.scheduled:
                if item.seq.is_finished:
                    self._release_drafts(item.seq)
        return new_tokens

    def _report_step(self, plan: StepPlan, start: int, end: int, logits_tokens: int) -> None:
        record = step_record(
            plan,
            start,
            end,
            logits_tokens,
            self.kv,
            len(self.scheduler.running),
            self.runner.last_forward_ns,
            self.runner.last_gather_ns,
            self.layer_windows,
            self.last_draft_ns,
            self.runner.last_comm,
            self.runner.last_broadcast,
            (0, 0)
            if self.structured is None
            else (self.structured.last_mask_rows, self.structured.last_mask_ns),
            self.runner.model.expert_tokens() if self.model_config.num_experts else ((), 0, 0),
            (
                self.runner.last_transfer_ns,
                *((0, 0) if self.kv.tiers is None else self.kv.tiers.take_step_reads()),
            ),
        )
        for observer in self.step_observers:
            observer(record)

    def _fail_unreadable_adapters(self, now: int) -> list[RequestEvent]:
        """The adapter reads done since the last step taken in; requests waiting for an
        adapter whose folder could not be read again (changed or gone since the start) fail,
        naming it; the others go on."""
        lora = self.runner.lora
        if lora is None:
            return []
        lora.poll()
        if not lora.failed:
            return []
        failed: list[RequestEvent] = []
        for seq in [s for s in self.scheduler.waiting if s.lora_name in lora.failed]:
            self.scheduler.finish(seq, "error")
            self.sequences.pop(seq.key, None)
            self.beam_search.drop(seq.request_id, "error")
            reason = lora.failed[str(seq.lora_name)]
            failed.append(Failed(seq.request_id, self.scheduler.step_counter, now, reason))
        return failed

    def _fail_unschedulable(self, plan: StepPlan, now: int) -> list[RequestEvent]:
        """Nothing runs, so nothing will free memory or budget: the request at the head of the
        queue can never start. Fail it rather than spin forever."""
        seq = self.scheduler.next_to_admit()
        if seq is None or self.scheduler.running or plan.preempted:
            return []  # (a preemption freed memory the queue may take next step)
        self.scheduler.finish(seq, "error")
        self.sequences.pop(seq.key, None)
        self._release_drafts(seq)
        self.beam_search.drop(seq.request_id, "error")
        reason = (
            f"cannot be scheduled: {seq.num_tokens} tokens do not fit the KV cache or "
            "max_num_batched_tokens even alone"
        )
        return [Failed(seq.request_id, plan.step, now, reason)]

    def _propose(self) -> dict[int, Proposal]:
        """Drafts for every running sequence past its first sampled token whose next step
        reaches its end, each capped so that the step cannot pass max_tokens or
        max_model_len; seq_id -> proposal (those with drafts only)."""
        seqs, limits = [], []
        max_len = self.limits.max_model_len
        retains = self.kv.retains_kv
        for seq in self.scheduler.running:
            if seq.num_output_tokens == 0 or (
                retains and seq.num_tokens - seq.num_computed_tokens != 1
            ):
                continue
            room = min(seq.sampling.max_tokens - seq.num_output_tokens, max_len - seq.num_tokens)
            if room > 1:
                seqs.append(seq)
                limits.append(room - 1)  # the verification adds one token of its own
        assert self.proposer is not None
        began = self.platform.now_ns()
        proposals = self.proposer.propose(seqs, limits) if seqs else []
        self.last_draft_ns = self.platform.now_ns() - began
        return {seq.seq_id: p for seq, p in zip(seqs, proposals, strict=True) if p.token_ids}

    def _release_drafts(self, seq: Sequence) -> None:
        """A sequence that finished, failed or lost its KV: the proposer forgets its state
        (a draft model's cache holds it otherwise)."""
        if self.proposer is not None:
            self.proposer.release(seq)

    def _end_step(self, start_ns: int) -> int:
        """The step's end timestamp, taken once its output is processed. A seam for test
        instruments: the planted slowdown (planted_slowdown.py) spins here, inside the step."""
        return self.platform.now_ns()

    def _fail_step(self, plan: StepPlan, exc: Exception) -> list[RequestEvent]:
        now = self.platform.now_ns()
        events: list[RequestEvent] = []
        for item in plan.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue  # a beam whose group an earlier beam's failure ended
            self.scheduler.finish(seq, "error")
            self.sequences.pop(seq.key, None)
            self.output.forget(seq)
            self._release_drafts(seq)
            self.beam_search.drop(seq.request_id, "error")
            events.append(
                Failed(
                    seq.request_id,
                    plan.step,
                    now,
                    f"engine step failed: {type(exc).__name__}: {exc}",
                )
            )
        return events


def check_structured_outputs(
    structured: StructuredOutputs | None, params: StructuredOutputsParams
) -> None:
    """A grammar backend to enforce it; compiled now (cached), so that a constraint the
    backend cannot compile is refused naming the field, and the step loop never waits
    for a compilation."""
    if structured is None:
        raise ValueError(
            "SamplingParams.structured_outputs: engine.structured_output_backend is none "
            "(auto finds no xgrammar installed); allowed: null (or "
            "engine.structured_output_backend=xgrammar, pip install xgrammar)"
        )
    structured.compile(params)


def check_prompt_length(token_ids: list[int], max_model_len: int) -> None:
    """At least one prompt token, and room for at least one more (ValueError naming it)."""
    if not token_ids:
        raise ValueError("prompt: empty (it has no tokens)")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt: {len(token_ids)} tokens do not fit max_model_len="
            f"{max_model_len} (at least one token must be generated)"
        )


def check_beams_fit(sampling: SamplingParams, max_num_seqs: int) -> None:
    """A beam search's beams all run at once (ValueError naming the field that sets them)."""
    if sampling.use_beam_search and sampling.num_beams > max_num_seqs:
        name = "n" if sampling.beam_width is None else "beam_width"
        raise ValueError(
            f"SamplingParams.{name}: {sampling.num_beams} beams cannot all run at once "
            f"under engine.max_num_seqs={max_num_seqs}; allowed: at most {max_num_seqs}"
        )


def check_token_ids(token_ids: list[int], sampling: SamplingParams, vocab: int) -> None:
    """The prompt's and the sampling's token ids are in the vocabulary (ValueError naming
    the field)."""
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    # a stop id the model cannot sample would never end anything
    bad = [t for t in sampling.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(
            f"SamplingParams.stop_token_ids: {bad[:5]} are outside the vocabulary [0, {vocab})"
        )
    for name, ids in (
        ("logit_bias", sampling.logit_bias or {}),
        ("allowed_token_ids", sampling.allowed_token_ids or ()),
    ):
        bad = sorted(t for t in ids if t >= vocab)
        if bad:
            raise ValueError(
                f"SamplingParams.{name}: token ids {bad[:5]} are outside the vocabulary "
                f"[0, {vocab})"
            )


def check_some_token_allowed(
    sampling: SamplingParams, encode: Callable[[str], list[int]], vocab: int, eos_ids: list[int]
) -> None:
    """Refuse `allowed_token_ids` that the other masks leave empty: a row whose every
    logit is -inf samples noise (argmax over -inf is token 0, outside the allowed ids).
    One-token bad words are banned at every step, and EOS and the stop ids until
    min_tokens; a longer bad word bans its last token only after the rest, which is not
    known here."""
    if sampling.allowed_token_ids is None:
        return
    left = set(sampling.allowed_token_ids)
    if sampling.bad_words:
        words = bad_words_token_ids(sampling.bad_words, encode, vocab)
        left -= {ids[0] for ids in words if len(ids) == 1}
        if not left:
            raise ValueError(
                f"SamplingParams.allowed_token_ids: {_short_ids(sampling.allowed_token_ids)} "
                "are all banned by bad_words, so no token could be sampled; allowed: ids "
                "of which at least one is not a one-token bad word"
            )
    if sampling.min_tokens and not left - {*eos_ids, *sampling.stop_token_ids}:
        raise ValueError(
            f"SamplingParams.allowed_token_ids: {_short_ids(sampling.allowed_token_ids)} "
            f"hold only EOS or stop ids (or bad words), which min_tokens="
            f"{sampling.min_tokens} masks, so no token could be sampled; allowed: at least "
            "one other id, or min_tokens=0"
        )


def _kept_drafts(plan: StepPlan, tokens: list[list[int]]) -> dict[int, list[int]]:
    """seq_id -> the drafts verification kept, for the step's speculative rows (`tokens`: the
    runner's new tokens per sampling sequence, forks included); counts them per sequence."""
    kept: dict[int, list[int]] = {}
    rows = iter(tokens)
    for item in plan.scheduled:
        if not item.samples:
            continue
        new = next(rows)
        for _ in range(item.seq.pending_forks):
            next(rows)
        if item.proposal is not None:
            seq = item.seq
            kept[seq.seq_id] = new[:-1]
            seq.spec_steps += 1
            seq.spec_draft_tokens += item.num_draft_tokens
            seq.spec_accepted_tokens += len(new) - 1
            plan.spec_rounds.append((item.num_draft_tokens, len(new) - 1))
    return kept


def _short_ids(ids: list[int]) -> str:
    """At most five ids for an error message (the list may hold a whole vocabulary)."""
    return str(ids[:5])[:-1] + ", ...]" if len(ids) > 5 else str(ids)
