"""The model runner executes a step plan: it packs the scheduled tokens (and static batching's
padding), fills the attention metadata into preallocated buffers (one host-to-device copy per
step), runs the model (or replays a CUDA graph for a decode step), and samples the sequences
that reached the end of their known tokens.

Under tensor parallelism rank 0's runner packs the step (`PackedStep`) and sends it to the
other ranks' runners (`peers`), which run the same forward on their shards from it
(`execute_packed`); only rank 0 gets the logits and samples."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from engines.base import TokenLogprob
from engines.builtin import native
from engines.builtin.attention import AttentionMetadata, make_attention, resolve_attention
from engines.builtin.beam_search import beam_candidates
from engines.builtin.config import EngineConfig
from engines.builtin.cuda_graphs import (
    DecodeGraphs,
    compile_model,
    default_batch_sizes,
    graphs_unavailable_reason,
    pad_decode_rows,
)
from engines.builtin.decode_program import DecodeProgram, unavailable_reason
from engines.builtin.distributed.group import ControlChannel, TPGroup
from engines.builtin.kv_cache import KVCacheManager, KVLayout, LayerKVCache
from engines.builtin.kv_cache.groups import KVGroups
from engines.builtin.kv_cache.storage import read_blocks, write_blocks
from engines.builtin.kv_cache.tiers import BlockTransfer, KVTierStore
from engines.builtin.layers import make_linear_method
from engines.builtin.layers.linear import PrepackedDenseMethod
from engines.builtin.limits import EngineLimits
from engines.builtin.logprobs import token_logprobs
from engines.builtin.lora.attach import attach_lora_slots
from engines.builtin.lora.batch import LoRABatch
from engines.builtin.lora.dummy import dummy_adapter_folders
from engines.builtin.lora.manager import LoRAError, LoRAManager
from engines.builtin.model import DecoderLayer, Transformer
from engines.builtin.platform import Platform
from engines.builtin.sampler import Sampler, SamplingBatch, non_finite_logits
from engines.builtin.scheduler import StepPlan
from engines.builtin.sequence import Sequence
from engines.builtin.spec_decode.proposer import Proposal
from engines.builtin.spec_decode.rejection_sampler import verify
from engines.builtin.step_inputs import StepInputs, group_input
from engines.builtin.structured import StructuredOutputs
from engines.builtin.weights import load_weights
from models.config import ModelConfig, ceil_div
from models.gguf import is_gguf
from models.quantized_weight import Weight
from models.weights import dummy_state_dict, iter_checkpoint

#: Called on every step with the float32 logits of every real token the step computed
#: ([tokens, vocab], packed in plan order: `plan.scheduled[i]` owns `num_new_tokens` rows;
#: padding left out). For parity tests and the quality probe: while one is registered
#: (`LLMEngine.add_logits_observer`) the LM head runs over every token and decode steps do not
#: replay CUDA graphs, so it costs speed.
LogitsObserver = Callable[[StepPlan, torch.Tensor], None]


#: The token id of static batching's padding (its compute is real, its output is dropped).
PAD_TOKEN_ID = 0


@dataclass
class PackedStep:
    """A step as prepare() packed it into the host buffers: what the forward needs besides
    them. Rank 0 sends it, with the buffers' used parts (`arrays`), to the other ranks."""

    num_tokens: int
    num_logits: int
    num_decodes: int  # rows the attention treats as decodes (static batching's padding too)
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]
    use_cache: bool
    write_index: np.ndarray | None = None  # packed rows whose K/V are stored (None: all)
    real_token_index: np.ndarray | None = None  # packed rows that are not padding (None: all)
    graph_size: int | None = None  # the CUDA graph bucket that serves the step
    copied_blocks: list[tuple[int, int]] = field(default_factory=list)
    observe: bool = False  # every real token's logits too (logits observers)
    # packed tokens whose logits give prompt logprobs (SamplingParams.prompt_logprobs)
    prompt_logits_index: np.ndarray | None = None
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    # LoRA: each row's adapter (None: the base model); None when no row has one
    lora_names: list[str | None] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        platform: Platform,
        dtype: torch.dtype,
        max_model_len: int,
        sample_vocab_size: int,
        eos_ids: list[int],
        tp: TPGroup | None = None,
    ) -> None:
        """`max_model_len` sizes the model's rotary table now; the other limits are known once
        the KV pool is sized (from the weights loaded here) and come with `allocate_kv_cache`.
        `tp`: this rank's tensor-parallel group (None: one rank)."""
        self.model_config = model_config
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.sample_vocab_size = sample_vocab_size
        self.eos_ids = eos_ids
        self._choose_kernels()
        self.model = self._build_model(tp)
        self.tp = self.model.tp
        # rank 0 of several: where each packed step goes before it runs (set by the engine)
        self.peers: ControlChannel | None = None
        self.model.eval()
        self._load_weights()
        self.model.use_native_kernels(self.native_kernels)
        self.lora = self._lora_manager()  # None: engine.enable_lora=false
        self.sampler = Sampler(config.seed, self.device)
        self.forward_timer = platform.timer()
        self.last_forward_ns = 0  # model forward + sampling of the last step, device time
        self.last_gather_ns = 0  # of which gathering K/V out of the cache (dense attention)
        self.last_transfer_ns = 0  # KV tier saves and loads before the last step's forward
        # tensor parallelism: the last step's (ns, bytes) in collectives and in its broadcast
        self.last_comm = (0, 0)
        self.last_broadcast = (0, 0)
        # the last step's log-probabilities, aligned with execute()'s tokens (per sampling
        # sequence: one per new token, or None where its request asks for none); None: none asked
        self.last_logprobs: list[list[TokenLogprob] | None] | None = None
        # structured outputs: the engine's manager (None: none), which masks guided rows
        self.structured: StructuredOutputs | None = None
        # beam search: each beam row's best tokens and log-probabilities (beam_search.py)
        self.last_beam_candidates: list[tuple[Sequence, tuple[list[int], list[float]]]] = []
        # the last step's prompt logprobs: per prompt chunk that asked, its sequence, the
        # chunk's first position p and the logprobs of prompt tokens p+1, p+2, ...
        self.last_prompt_logprobs: list[PromptChunkLogprobs] = []
        self._prompt_targets: list[PromptTargets] = []  # this step's, in packed order
        self.kv_caches: list[LayerKVCache] = []
        # See the logits of every token of every step (LLMEngine.add_logits_observer). Empty
        # in normal runs, where only sampled rows are computed.
        self.logits_observers: list[LogitsObserver] = []

        # Preallocated step inputs at the largest step (each step uses a prefix), allocated
        # with the KV cache, which sets the block tables' width; so are the limits below.
        self.max_num_batched_tokens = 0
        self.max_num_seqs = 0
        self.max_rows = 0  # rows a step may pack (allocate_kv_cache)
        self.inputs: StepInputs  # allocate_kv_cache
        self.max_blocks_per_seq = 1
        self.ring = False
        self.kv_groups: KVGroups | None = None  # allocate_kv_cache
        self.decode_graphs: DecodeGraphs | None = None  # set up with the KV cache
        self.cuda_graphs_note: str | None = None  # why graphs were asked for but not used

    def _lora_manager(self) -> LoRAManager | None:
        """The LoRA slots on the model's layers and the manager that fills them, every
        adapter of engine.lora_modules read and checked now (LoRAError naming one that
        cannot run on this model)."""
        config = self.config
        if not config.enable_lora:
            return None
        layers = attach_lora_slots(
            self.model,
            config.max_loras,
            config.max_lora_rank,
            self.dtype,
            self.device,
            native=self.native_kernels,
        )
        modules = dict(config.lora_modules)
        if config.lora_dummy_adapters:
            dummies = dummy_adapter_folders(
                self.model_config, config.lora_dummy_adapters, config.lora_dummy_rank, config.seed
            )
            taken = sorted(set(dummies) & set(modules))
            if taken:
                raise LoRAError(
                    f"lora_modules.{taken[0]}: the name of a dummy adapter "
                    f"(engine.lora_dummy_adapters={config.lora_dummy_adapters}); allowed: "
                    "another name"
                )
            modules = {**dummies, **modules}
        manager = LoRAManager(
            modules,
            self.model_config,
            layers,
            config.max_loras,
            config.max_lora_rank,
            config.max_cpu_loras or config.max_loras,
        )
        manager.read_all()
        return manager

    def _choose_kernels(self) -> None:
        """Which kernels the options ask for and this device and dtype allow: the C kernels,
        the prepacked weight layout, the attention backend."""
        config, dtype = self.config, self.dtype
        # the C kernels: CPU float32, not under torch.compile (a ctypes call would split its
        # graph; inductor fuses the elementwise ops itself)
        self.native_kernels_reason = native.off_reason(
            config.native_kernels, config.compile, self.device, dtype
        )
        self.native_kernels = self.native_kernels_reason is None
        # the INT8/INT4 kernels take any float dtype (they compute in float32)
        self.native_quant_reason = native.off_reason(
            config.native_kernels, config.compile, self.device, None
        )
        # torch.compile cannot lower the prepacked ops (inductor packs weights its own way)
        self.prepacked: str | None = None  # the packed layout of dense CPU weights
        if config.prepack_weights and not config.compile:
            if self.native_kernels:  # CPU float32 with the C kernels built: their GEMM
                self.prepacked = "panels"
            elif PrepackedDenseMethod.supported(self.device, dtype):
                self.prepacked = "onednn"
        # `auto` resolved for this device: what describe() reports
        self.attention_backend = resolve_attention(
            config.attention_backend,
            self.device,
            dtype,
            config.kv_cache_dtype,
            config.native_kernels,
        )
        self.attention = make_attention(self.attention_backend)
        if config.kv_cache_dtype.startswith("fp8") and not self.attention.reads_fp8_kv:
            raise ValueError(
                f"engine.kv_cache_dtype={config.kv_cache_dtype!r} is read by the CPU kernels "
                f"and the dense attention paths, not attention_backend="
                f"{self.attention_backend!r}; allowed: auto|torch|sdpa|cpu (or "
                "kv_cache_dtype=auto|int8)"
            )
        cap = self.model_config.attn_logit_softcapping
        if cap is not None and not self.attention.caps_scores:
            raise ValueError(
                f"engine.attention_backend: {self.attention_backend!r} does not soft-cap "
                f"attention scores, which this {self.model_config.architecture} does "
                f"(attn_logit_softcapping={cap}); allowed here: auto|torch|sdpa|cpu"
            )

    def _build_model(self, tp: TPGroup | None) -> Transformer:
        """The model, its linear layers' methods and its attention, on the meta device
        (`_load_weights` gives it its weights)."""
        config = self.config
        with torch.device("meta"):
            linear = make_linear_method(
                config.quantization,
                config.quantization_group_size,
                self.prepacked,
                config.quantization_zero_point,
                config.quantization_activations,
                self.native_quant_reason,
            )
            # A tied head, quantized, is a quantized copy of the embedding table.
            head_method = config.lm_head_method()
            lm_head = (
                linear
                if head_method == config.quantization
                else make_linear_method(
                    head_method, prepack=self.prepacked, native_reason=self.native_quant_reason
                )
            )
            return Transformer(
                self.model_config,
                linear,
                self.attention,
                self.max_model_len,
                self.device,
                lm_head_method=lm_head,
                tp=tp,
                expert_parallel=config.enable_expert_parallel,
            )

    def _load_weights(self) -> None:
        cfg, config = self.model_config, self.config
        use_dummy = config.load_format == "dummy" or (
            config.load_format == "auto" and not _is_checkpoint(config.model)
        )
        tensors: Iterable[tuple[str, Weight]]
        if use_dummy:
            tensors = dummy_state_dict(cfg, config.seed, self.dtype, self.device).items()
        else:
            keep = config.plugged("quantization").takes_quantized
            tensors = iter_checkpoint(config.model, keep_quantized=keep)
        load_weights(self.model, tensors, self.dtype, self.device)
        self.weights_source = "dummy" if use_dummy else "checkpoint"

    def allocate_kv_cache(
        self,
        layout: KVLayout,
        ring: bool,
        limits: EngineLimits,
        groups: KVGroups | None = None,
    ) -> None:
        """The pool the KV manager's `layout` describes (its blocks of this rank's K/V heads);
        `ring`: a sliding window's contiguous ring; `groups`: the hybrid manager's KV groups,
        whose layers share `group_size` tensor pairs and each read their group's tables."""
        if limits.max_model_len != self.max_model_len:
            raise ValueError(
                f"limits.max_model_len={limits.max_model_len} differs from the model's "
                f"max_model_len={self.max_model_len} this runner was built for"
            )
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.max_num_seqs = limits.max_num_seqs
        self.ring = ring
        self.block_size = layout.block_size
        self.max_blocks_per_seq = max(1, ceil_div(self.max_model_len, layout.block_size))
        # rows a step packs: one per sequence, or with speculative decoding one per token of
        # a verifying sequence (prepare's `as_decodes`)
        spec = self.config.speculative()
        self.max_rows = self.max_num_seqs
        if spec is not None:
            self.max_rows = min(
                self.max_num_seqs * (1 + spec.num_speculative_tokens),
                max(self.max_num_batched_tokens, self.max_num_seqs),
            )
        self.kv_groups = groups
        self.inputs = StepInputs(
            self.max_num_batched_tokens,
            self.max_rows,
            self.max_blocks_per_seq,
            self.device,
            1 if groups is None else groups.num_groups,
        )
        self.kv_caches = []
        cache_class = self.attention.kv_cache_class
        for index, module in enumerate(self.model.layers):
            layer = cast(DecoderLayer, module)  # ModuleList iterates as Module
            cache = None
            slot = index if groups is None else groups.layer_slot[index]
            if slot < len(self.kv_caches):  # a tensor pair another group's layer shares
                cache = self.kv_caches[slot]
            elif layout.num_blocks:
                cache = cache_class(
                    layout.num_blocks,
                    layout.block_size,
                    layer.attn.num_kv_heads,
                    self.model_config.head_dim,
                    self.dtype,
                    self.device,
                    kv_cache_dtype=self.config.kv_cache_dtype,
                    prefault=self.config.kv_cache_prefault,
                )
                self.kv_caches.append(cache)
            layer.attn.cache = cache
        self._setup_layer_program()
        self._setup_speed()

    def _setup_layer_program(self) -> None:
        """The decode program (decode_program.py) where the engine's options and layers allow."""
        if not self.config.native_decode_program:
            self.layer_program_reason: str | None = "engine.native_decode_program=false"
        elif self.tp.size > 1:
            self.layer_program_reason = (
                "engine.tensor_parallel_size > 1: the layers all-reduce between the kernels "
                "that the program runs in one call"
            )
        elif not self.native_kernels or self.config.compile:
            self.layer_program_reason = (
                "engine.compile=true" if self.config.compile else self.native_kernels_reason
            )
        else:
            self.layer_program_reason = unavailable_reason(self.model)
        self.decode_program = (
            DecodeProgram(self.model, self.block_size, self.config.cpu_wait_policy)
            if self.layer_program_reason is None
            else None
        )
        self.model.layer_program = self.decode_program

    def _setup_speed(self) -> None:
        """torch.compile, then CUDA graphs (which then record the compiled forward)."""
        config = self.config
        if config.compile:
            _check_compile_works(self.device)
            compile_model(self)
        if config.enforce_eager:
            return
        reason = graphs_unavailable_reason(self)
        if reason is None:
            sizes = config.cuda_graph_batch_sizes or default_batch_sizes(self.max_num_seqs)
            with torch.inference_mode():
                self.decode_graphs = DecodeGraphs(self, sizes, capture=True)
        elif self.device.type == "cuda":
            raise ValueError(
                f"engine.enforce_eager=false asks for CUDA graphs, but {reason}; "
                "or set engine.enforce_eager=true"
            )
        else:  # accepted and ignored, so one config runs on CPU and GPU machines alike
            self.cuda_graphs_note = f"not used: {reason}"

    def speed_facts(self) -> dict[str, object]:
        """For describe(): what the speed options actually do on this engine."""
        graphs = self.decode_graphs
        facts: dict[str, object] = {
            "enforce_eager": self.config.enforce_eager,
            "compile": self.config.compile,
            "prepacked_weights": self.prepacked is not None,
            "prepacked_layout": self.prepacked,
            # decode steps' layers in one call into the C kernels, or why not
            "native_decode_program": self.model.layer_program is not None,
            "native_decode_program_reason": self.layer_program_reason,
            "cpu_wait_policy": self.config.cpu_wait_policy,
            # auto: the decode program's team, as measured so far (engines/builtin/team_size.py)
            "decode_team": (
                self.decode_program.sizer.describe()
                if self.decode_program is not None and self.decode_program.sizer is not None
                else None
            ),
            "cuda_graphs": graphs is not None,
            "cuda_graph_batch_sizes": graphs.sizes if graphs is not None else [],
        }
        if self.cuda_graphs_note is not None:
            facts["cuda_graphs_note"] = self.cuda_graphs_note
        return facts

    # ---- one step ---------------------------------------------------------------------------

    def prepare(
        self, plan: StepPlan, kv: KVCacheManager
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's device inputs: the packed token ids, their attention metadata and the
        rows whose logits are sampled."""
        return self._device_inputs(self._pack(plan, kv))

    def _pack(self, plan: StepPlan, kv: KVCacheManager) -> PackedStep:
        """Pack the plan into rows in the host buffers: real decodes, static batching's padding
        decodes, real prefills (each followed by its padding tokens, if any), then padding-only
        rows; or, when speculative rows verify as decodes, one row per token. Padding tokens
        are pad id 0 at the positions after their row's real tokens; they are computed (the
        cost static batching pays) but their K/V are never stored and they are never
        sampled."""
        as_decodes = self._verifies_as_decodes(plan, kv)
        if as_decodes:
            rows = _verify_rows(plan)
            num_decode_rows = len(rows)
        else:
            num_decodes = plan.num_decodes  # the decodes come first in the plan
            rows = _decode_rows(plan, num_decodes)
            num_decode_rows = len(rows)
            rows += _prefill_rows(plan, num_decodes)
        layout = _RowLayout.of(rows)
        host = self.inputs.host_arrays()  # waits until the previous step's upload has left them
        layout.fill(host, rows)
        write_index = self._fill_slots(host, rows, layout, kv) if kv.retains_kv else None
        if as_decodes:  # every row samples: its own token's logits
            indices: list[int] | np.ndarray = np.arange(layout.num_tokens)
            num_sampled = len(rows)
        else:
            indices, num_sampled = _sampled_logits(plan, layout, num_decodes, num_decode_rows)
        num_logits = len(indices)
        host["logits_indices"][:num_logits] = indices
        prompt_index, self._prompt_targets = (
            ([], []) if as_decodes else _prompt_logits(plan, layout, num_decodes, num_decode_rows)
        )
        packed = PackedStep(
            num_tokens=layout.num_tokens,
            num_logits=num_logits,
            num_decodes=num_decode_rows,
            query_start_loc=layout.qsl.tolist(),
            seq_lens=layout.seq_lens.tolist(),
            use_cache=kv.retains_kv,
            write_index=write_index,
            copied_blocks=plan.copied_blocks,
            observe=bool(self.logits_observers),
            prompt_logits_index=np.asarray(prompt_index, np.int64) if prompt_index else None,
        )
        if plan.padding_tokens:
            packed.real_token_index = np.flatnonzero(layout.real_tokens())
        adapters = {s.seq.seq_id: s.seq.lora_name for s in plan.scheduled if s.seq.lora_name}
        if adapters:
            packed.lora_names = [adapters.get(row[0]) for row in rows]
        if num_decode_rows == len(rows) == num_sampled and not plan.padding_rows:
            self._use_graph(packed, host)
        return packed

    def _verifies_as_decodes(self, plan: StepPlan, kv: KVCacheManager) -> bool:
        """Speculative rows among decodes only: each token becomes a one-token decode row over
        its sequence's blocks (the step writes every token's K/V before attending, so the row
        at position p sees the keys up to p: causal, as a prefill chunk would). The step then
        runs as a decode step: the decode kernels, the decode program, graphs."""
        return (
            bool(plan.num_draft_tokens)
            and kv.retains_kv
            and not plan.padding_rows
            and plan.num_tokens <= self.max_rows
            and all(s.is_decode or s.proposal is not None for s in plan.scheduled)
        )

    def _fill_slots(
        self, host: dict[str, np.ndarray], rows: list[Row], layout: _RowLayout, kv: KVCacheManager
    ) -> np.ndarray | None:
        """The rows' block tables and the KV slot of every packed token; the packed rows whose
        K/V are stored (None: all). Padding (static batching) is computed but its K/V never
        stored: nothing reads it, and a padded row may reach past the blocks its sequence
        owns."""
        bs, seq_index, positions = self.block_size, layout.seq_index, layout.positions
        keep = layout.real_tokens()
        for group in range(self.inputs.num_kv_groups):
            tables = host[group_input("block_tables", group)][: len(rows)]
            tables[:] = 0
            for row, entry in enumerate(rows):
                table = kv.group_block_table(group, entry[0])
                tables[row, : len(table)] = table
            if self.ring:
                # One window-sized region per sequence, written round-robin; of a prompt longer
                # than the window only the last `window` tokens are kept.
                slots = tables[seq_index, 0].astype(np.int64) * bs + positions % bs
                keep &= positions >= (layout.starts + layout.real_lens)[seq_index] - bs
            else:
                blocks = np.minimum(positions // bs, self.max_blocks_per_seq - 1)
                slots = tables[seq_index, blocks].astype(np.int64) * bs + positions % bs
            host[group_input("slots", group)][: layout.num_tokens] = slots
        return None if keep.all() else np.flatnonzero(keep)

    def _use_graph(self, packed: PackedStep, host: dict[str, np.ndarray]) -> None:
        """A decode-only step that samples every row replays a CUDA graph, when one of its
        buckets holds the rows (rows num_seqs.. of the bucket are padding)."""
        graphs = self.decode_graphs
        if graphs is None or self.logits_observers or packed.write_index is not None:
            return
        packed.graph_size = graphs.bucket_for(packed.num_seqs)
        if packed.graph_size is not None:
            pad_decode_rows(host, packed.num_seqs, packed.graph_size)

    def _device_inputs(
        self, packed: PackedStep
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        n, num_seqs = packed.num_tokens, packed.num_seqs
        self.inputs.upload(packed.use_cache, num_seqs)  # the step's one host-to-device copy
        dev = self.inputs.device
        write_index = packed.write_index
        meta = AttentionMetadata(
            positions=dev["positions"][:n],
            slot_mapping=dev["slots"][:n],
            query_start_loc=dev["qsl"][: num_seqs + 1],
            seq_lens=dev["seq_lens"][:num_seqs],
            block_tables=dev["block_tables"][:num_seqs],
            query_start_loc_host=packed.query_start_loc,
            seq_lens_host=packed.seq_lens,
            num_decodes=packed.num_decodes,
            max_seq_len=max(packed.seq_lens),
            block_size=self.block_size,
            sliding_window=self.model_config.kv_sliding_window,
            use_cache=packed.use_cache,
            ring=self.ring,
            write_index=None
            if write_index is None
            else torch.as_tensor(write_index, device=self.device),
            lora=self._lora_batch(packed),
            group_kv=[
                (dev[group_input("slots", g)][:n], dev[group_input("block_tables", g)][:num_seqs])
                for g in range(1, self.inputs.num_kv_groups)
            ]
            if packed.use_cache
            else [],
        )
        return dev["input_ids"][:n], meta, dev["logits_indices"][: packed.num_logits]

    def _lora_batch(self, packed: PackedStep) -> LoRABatch | None:
        """The step's rows by adapter slot, the adapters it runs written into slots first
        (on every tensor-parallel rank alike: each keeps its own slots, in the same order)."""
        names = packed.lora_names
        if names is None or self.lora is None:
            return None
        slots = self.lora.slots_for(name for name in names if name is not None)
        return LoRABatch.of(
            [None if name is None else slots[name] for name in names],
            np.diff(packed.query_start_loc).tolist(),
            self.device,
        )

    # ---- tensor parallelism: the step's message to the other ranks --------------------------

    def _message(self, packed: PackedStep) -> PackedStep:
        """`packed` with the used parts of the host buffers, for the other ranks."""
        host, n, rows = self.inputs.host_arrays(), packed.num_tokens, packed.num_seqs
        used = {
            "logits_indices": packed.num_logits,
            "input_ids": n,
            "positions": n,
        }
        if packed.use_cache:
            for group in range(self.inputs.num_kv_groups):
                used[group_input("slots", group)] = n
                used[group_input("block_tables", group)] = rows
        packed.arrays = {name: host[name][:count].copy() for name, count in used.items()}
        return packed

    @torch.inference_mode()
    def execute_packed(self, packed: PackedStep) -> None:
        """Another rank's share of a step rank 0 packed: the same forward on this rank's
        shards, and the same collectives; rank 0 alone samples."""
        host = self.inputs.host_arrays()
        for name, values in packed.arrays.items():
            host[name][: len(values)] = values
        host["qsl"][: packed.num_seqs + 1] = packed.query_start_loc
        host["seq_lens"][: packed.num_seqs] = packed.seq_lens
        input_ids, meta, logits_indices = self._device_inputs(packed)
        if packed.copied_blocks:
            self.copy_blocks(packed.copied_blocks)
        self._logits(None, packed, input_ids, meta, logits_indices)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, kv: KVCacheManager) -> list[list[int]]:
        """Run the plan; return the new tokens of each sequence that samples, in plan order
        (one each, or a speculative row's kept drafts and one more)."""
        packed = self._pack(plan, kv)
        if self.peers is not None:
            self.peers.send(("step", self._message(packed)))
            self.last_broadcast = (self.peers.last_ns, self.peers.last_bytes)
        input_ids, meta, logits_indices = self._device_inputs(packed)
        if plan.copied_blocks:
            self.copy_blocks(plan.copied_blocks)
        for cache in self.kv_caches:
            cache.gather_ns = 0
        self.forward_timer.start()
        self.last_logprobs, self.last_prompt_logprobs = None, []
        self.last_beam_candidates = []
        if self.structured is not None:
            self.structured.last_mask_rows = self.structured.last_mask_ns = 0
        logits = self._logits(plan, packed, input_ids, meta, logits_indices)
        result = self._sample(plan, logits) if logits is not None else []
        self.forward_timer.stop()
        self.last_forward_ns = self.forward_timer.elapsed_ns()
        self.last_gather_ns = sum(cache.gather_ns for cache in self.kv_caches)
        self.last_comm = self.tp.take_counters()
        return result

    @torch.inference_mode()
    def execute_logits(self, plan: StepPlan, kv: KVCacheManager) -> torch.Tensor:
        """Run the plan (no drafts, no forks); return the logits of each sequence that samples,
        in plan order, over the tokenizer's vocabulary: a draft model's proposer samples from
        them with the requests' own parameters. One rank only (a draft model's engine)."""
        assert self.peers is None, "execute_logits runs on one rank"
        packed = self._pack(plan, kv)
        input_ids, meta, logits_indices = self._device_inputs(packed)
        logits = self._logits(plan, packed, input_ids, meta, logits_indices)
        return logits if logits is not None else torch.empty(0, self.sample_vocab_size)

    def transfer_blocks(self, transfers: list[BlockTransfer], kv: KVCacheManager) -> None:
        """KV tiers: save evicted blocks' bytes to the store and load tier hits (or a prefill
        instance's K/V, carried by the transfer) into their blocks, in the order the scheduler
        decided them; before the step's copies and forward (a copy's destination may be a
        block loaded, given back and reused in this plan: the copy, later, wins), and for
        every plan, an empty one too (its admissions may have been
        given back after their loads were planned). A save that fails is dropped (nothing
        loads it); a load that fails uncaches its blocks and fails the step
        (`abandon_transfers`)."""
        store = kv.tiers
        start = self.platform.now_ns()
        pending = _runs_of_one_kind(transfers)
        try:
            while pending:
                run = pending[0]
                blocks, keys = [t.block for t in run], [t.key for t in run]
                if run[0].kind == "load":
                    write_blocks(self.kv_caches, blocks, [_load_payload(t, store) for t in run])
                    for transfer in run:
                        if transfer.payload is None:
                            assert store is not None
                            store.release(transfer.key)
                else:
                    assert store is not None  # saves go to a tier only
                    try:
                        payloads = read_blocks(self.kv_caches, blocks)
                    except Exception:
                        payloads = []
                        kv.abandon_transfers(run)
                    for key, payload in zip(keys, payloads, strict=False):
                        store.fill(key, payload)
                pending.pop(0)
        except BaseException:
            kv.abandon_transfers([t for run in pending for t in run])
            raise
        finally:
            self.platform.synchronize()
            self.last_transfer_ns = self.platform.now_ns() - start

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a sequence its own copy of a shared, partially filled block."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.kv_caches:
            cache.copy_blocks(src, dst)

    def _logits(
        self,
        plan: StepPlan | None,
        packed: PackedStep,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor | None:
        """The forward pass; the logits at `logits_indices` (None when the step samples
        nothing, and on every tensor-parallel rank but 0), over the tokenizer's vocabulary.
        Every rank makes the same calls in the same order (each holds a collective)."""
        if packed.graph_size is not None:  # _pack() chose a bucket and padded the rows
            assert self.decode_graphs is not None
            logits: torch.Tensor | None = self.decode_graphs.run(packed.graph_size, meta.num_seqs)
        else:
            hidden = self.model(input_ids, meta)
            if packed.observe:
                index = packed.real_token_index  # padding rows left out
                real = hidden if index is None else hidden[torch.from_numpy(index).to(self.device)]
                every = self.model.compute_logits(real)
                if every is not None and plan is not None:
                    for observer in self.logits_observers:
                        observer(plan, every.float())
            if packed.prompt_logits_index is not None:  # every rank: a collective under TP
                rows = torch.from_numpy(packed.prompt_logits_index).to(self.device)
                prompt = self.model.compute_logits(hidden[rows])
                if prompt is not None and plan is not None:
                    self._report_prompt_logprobs(prompt[:, : self.sample_vocab_size])
            if packed.num_logits == 0:
                return None
            logits = self.model.compute_logits(hidden[logits_indices])
        # Ids past the tokenizer's vocabulary (a dummy model's padding rows) are never sampled.
        return None if logits is None else logits[:, : self.sample_vocab_size]

    def _report_prompt_logprobs(self, logits: torch.Tensor) -> None:
        """The prompt logprobs of this step's chunks that asked, from their positions' logits
        (rows in the order of `_prompt_targets`)."""
        targets = [t for _, _, chunk in self._prompt_targets for t in chunk]
        tops = [
            seq.sampling.prompt_logprobs or 0
            for seq, _, chunk in self._prompt_targets
            for _ in chunk
        ]
        found = iter(token_logprobs(logits, torch.tensor(targets, device=logits.device), tops))
        self.last_prompt_logprobs = [
            (seq, first, [next(found) for _ in chunk]) for seq, first, chunk in self._prompt_targets
        ]

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> list[list[int]]:
        """The new tokens of each sampling sequence; NonFiniteLogitsError if the logits hold
        NaN or infinity (one reduction, read back with the tokens)."""
        finite = _all_finite(logits)
        items = [s for s in plan.scheduled if s.samples]
        copies = [1 + s.seq.pending_forks for s in items]
        if any(n > 1 for n in copies):
            # Parallel sampling: the first token of each of a request's n samples is drawn
            # from the same prompt logits; the engine forks a sequence for each extra one.
            rows, start = [], 0
            for item, n in zip(items, copies, strict=True):
                count = 1 + item.num_draft_tokens
                rows += list(range(start, start + count)) * n
                start += count
            logits = logits[rows]
        seqs = [s.seq for s, n in zip(items, copies, strict=True) for _ in range(n)]
        proposals = [
            s.proposal or Proposal([]) for s, n in zip(items, copies, strict=True) for _ in range(n)
        ]
        raw = logits  # logprobs report the raw logits, whatever masks the sampling
        if self.structured is not None:
            logits = self.structured.mask(logits, seqs, [p.token_ids for p in proposals])
        if plan.num_draft_tokens:
            if not bool(finite):  # verification reads its tokens back more than once anyway
                raise non_finite_logits(logits, plan.step)
            kept = verify(logits, seqs, proposals, self.sampler, self.eos_ids)
            rows_per_seq = [
                1 + s.num_draft_tokens for s, n in zip(items, copies, strict=True) for _ in range(n)
            ]
            self.last_logprobs = _logprobs(raw, seqs, kept, rows_per_seq)
            return kept
        if all(
            s.sampling.temperature == 0.0
            and not s.sampling.min_tokens
            and not s.sampling.adjusts_logits
            for s in seqs
        ):
            tokens = logits.argmax(dim=-1)
        else:
            batch = SamplingBatch.from_sequences(seqs, self.eos_ids, self.device)
            tokens = self.sampler(logits, batch)
        # the step's one device-to-host sync: the tokens, and whether the logits were finite
        *ids, all_finite = torch.cat([tokens, finite.view(1).to(tokens.dtype)]).tolist()
        if not all_finite:
            raise non_finite_logits(logits, plan.step)
        result = [[token] for token in ids]
        self.last_logprobs = _logprobs(raw, seqs, result, [1] * len(seqs))
        beams = [row for row, seq in enumerate(seqs) if seq.sampling.use_beam_search]
        if beams:  # their rows' tokens above are unused: beams yield candidates
            beam_seqs = [seqs[row] for row in beams]
            found = beam_candidates(raw[beams], beam_seqs, self.sampler, self.eos_ids)
            self.last_beam_candidates = list(zip(beam_seqs, found, strict=True))
        return result


def _tops(seq: Sequence) -> int | None:
    """How many top log-probabilities a sequence's tokens need: its request's `logprobs`; 0
    for a best_of > n sample (its rank sums its tokens'); None: none."""
    if seq.sampling.logprobs is not None:
        return seq.sampling.logprobs
    return 0 if seq.sampling.ranks_samples else None


def _logprobs(
    logits: torch.Tensor,
    seqs: list[Sequence],
    tokens: list[list[int]],
    rows_per_seq: list[int],
) -> list[list[TokenLogprob] | None] | None:
    """Per sampling sequence, the log-probabilities of its new tokens where its request asks
    (SamplingParams.logprobs), else None; None when none asks. Token j of sequence i was
    sampled from row (the sequence's first row) + j of `logits`."""
    if all(_tops(seq) is None for seq in seqs):
        return None
    rows: list[int] = []
    chosen: list[int] = []
    tops: list[int] = []
    first = 0
    for seq, new, count in zip(seqs, tokens, rows_per_seq, strict=True):
        top = _tops(seq)
        if top is not None:
            rows += range(first, first + len(new))
            chosen += new
            tops += [top] * len(new)
        first += count
    found = iter(
        token_logprobs(
            logits[torch.tensor(rows, device=logits.device)],
            torch.tensor(chosen, device=logits.device),
            tops,
        )
    )
    return [
        None if _tops(seq) is None else [next(found) for _ in new]
        for seq, new in zip(seqs, tokens, strict=True)
    ]


#: A prompt chunk that asks for prompt logprobs: its sequence, its first position p, and the
#: prompt tokens p+1, p+2, ... its positions' logits score.
PromptTargets = tuple[Sequence, int, list[int]]
#: The same chunk's logprobs of those tokens.
PromptChunkLogprobs = tuple[Sequence, int, list[TokenLogprob]]

#: One packed row: (seq_id, first position, real tokens, padding tokens after them).
Row = tuple[int, int, list[int], int]


def _decode_rows(plan: StepPlan, num_decodes: int) -> list[Row]:
    """The plan's `num_decodes` decodes, then static batching's padding decodes."""
    rows: list[Row] = [
        (s.seq.seq_id, s.num_computed_before, s.new_token_ids, 0)
        for s in plan.scheduled[:num_decodes]
    ]
    rows += [(r.seq.seq_id, r.start, [], 1) for r in plan.padding_rows if r.is_decode]
    return rows


def _prefill_rows(plan: StepPlan, num_decodes: int) -> list[Row]:
    """The plan's rows after its decodes: prompt chunks (and speculative rows that verify as
    chunks), each with its static batching padding; then padding-only rows."""
    rows: list[Row] = [
        (s.seq.seq_id, s.num_computed_before, s.new_token_ids, s.num_padding_tokens)
        for s in plan.scheduled[num_decodes:]
    ]
    rows += [
        (r.seq.seq_id, r.start, [], r.num_tokens) for r in plan.padding_rows if not r.is_decode
    ]
    return rows


def _verify_rows(plan: StepPlan) -> list[Row]:
    """Every token of every sequence as a one-token decode row (`_verifies_as_decodes`)."""
    return [
        (s.seq.seq_id, s.num_computed_before + i, [token], 0)
        for s in plan.scheduled
        for i, token in enumerate(s.new_token_ids)
    ]


@dataclass
class _RowLayout:
    """Where each packed token sits: the shared assembly of every kind of row."""

    starts: np.ndarray  # per row: its first position
    real_lens: np.ndarray  # per row: real tokens
    qsl: np.ndarray  # query start locations [rows + 1]
    seq_lens: np.ndarray  # per row: tokens it attends to after the step
    seq_index: np.ndarray  # per token: its row
    offsets: np.ndarray  # per token: its offset in its row
    positions: np.ndarray  # per token: its position in its sequence

    @staticmethod
    def of(rows: list[Row]) -> _RowLayout:
        num_rows = len(rows)
        real_lens = np.fromiter((len(r[2]) for r in rows), np.int64, num_rows)
        query_lens = real_lens + np.fromiter((r[3] for r in rows), np.int64, num_rows)
        starts = np.fromiter((r[1] for r in rows), np.int64, num_rows)
        qsl = np.zeros(num_rows + 1, np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        # positions = start of the chunk + offset within it, for every packed token
        seq_index = np.repeat(np.arange(num_rows), query_lens)
        offsets = np.arange(int(qsl[-1])) - qsl[:-1][seq_index]
        positions = starts[seq_index] + offsets
        return _RowLayout(
            starts, real_lens, qsl, starts + query_lens, seq_index, offsets, positions
        )

    @property
    def num_tokens(self) -> int:
        return int(self.qsl[-1])

    def real_tokens(self) -> np.ndarray:
        """Per packed token: not padding."""
        return self.offsets < self.real_lens[self.seq_index]

    def fill(self, host: dict[str, np.ndarray], rows: list[Row]) -> None:
        """The token ids, positions and row boundaries into the host buffers."""
        token_ids: list[int] = []
        for _, _, ids, num_pad in rows:
            token_ids.extend(ids)
            token_ids.extend([PAD_TOKEN_ID] * num_pad)
        n, num_rows = self.num_tokens, len(rows)
        host["input_ids"][:n] = token_ids
        host["positions"][:n] = self.positions
        host["qsl"][: num_rows + 1] = self.qsl
        host["seq_lens"][:num_rows] = self.seq_lens


def _sampled_logits(
    plan: StepPlan, layout: _RowLayout, num_decodes: int, num_decode_rows: int
) -> tuple[list[int] | np.ndarray, int]:
    """The packed tokens whose logits are sampled, and how many rows sample. Real rows in plan
    order: decodes are rows 0..num_decodes-1, prefills follow the padding decodes. A sampling
    row's logits are at its last real token; a speculative row's at its last own token and at
    each of its drafts."""
    items = plan.scheduled
    real_rows = [
        *range(num_decodes),
        *range(num_decode_rows, num_decode_rows + len(items) - num_decodes),
    ]
    sampling = [
        (row, s.num_draft_tokens) for row, s in zip(real_rows, items, strict=True) if s.samples
    ]
    sample_rows = [row for row, _ in sampling]
    ends = layout.qsl[:-1][sample_rows] + layout.real_lens[sample_rows]
    if not plan.num_draft_tokens:
        return ends - 1, len(sample_rows)
    indices = [
        end - 1 - back
        for end, (_, drafts) in zip(ends.tolist(), sampling, strict=True)
        for back in range(drafts, -1, -1)
    ]
    return indices, len(sample_rows)


def _prompt_logits(
    plan: StepPlan, layout: _RowLayout, num_decodes: int, num_decode_rows: int
) -> tuple[list[int], list[PromptTargets]]:
    """For each prompt chunk whose request asks for prompt logprobs (and has not reported them):
    the packed tokens whose logits score the next prompt token (every position of the chunk but
    the prompt's last, whose logits sample the first output token), and those next tokens."""
    index: list[int] = []
    targets: list[PromptTargets] = []
    for i, item in enumerate(plan.scheduled[num_decodes:]):
        seq = item.seq
        if seq.prompt_logprobs is None or not item.is_prefill:
            continue
        first = item.num_computed_before
        last = min(first + len(item.new_token_ids), seq.num_prompt_tokens - 1)
        if last <= first:
            continue
        start = int(layout.qsl[num_decode_rows + i])
        index += range(start, start + last - first)
        targets.append((seq, first, seq.prompt_token_ids[first + 1 : last + 1]))
    return index, targets


def _check_compile_works(device: torch.device) -> None:
    """Compile a one-line function first, so a machine where inductor cannot build kernels
    (no C++ compiler on CPU, no Triton on CUDA) fails at construction, with the reason."""
    try:
        probe = torch.compile(lambda x: x * 2.0 + 1.0, dynamic=False)
        probe(torch.ones(4, device=device))
    except Exception as e:
        raise ValueError(
            f"engine.compile=true: torch.compile does not work on {device.type} "
            f"here ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "use engine.compile=false"
        ) from e


def _is_checkpoint(model: str) -> bool:
    from pathlib import Path

    return Path(model).is_dir() or is_gguf(model)


def _all_finite(logits: torch.Tensor) -> torch.Tensor:
    """Whether every logit is finite, as a 0-d bool tensor (no sync): NaN propagates to the
    minimum and maximum, and an infinity is one of them. One pass and no mask: 14 us against
    isfinite().all()'s 70 us over SmolLM2's 49,152 logits, 1% of a batch-1 decode step."""
    if logits.numel() == 0:
        return torch.tensor(True, device=logits.device)
    low, high = torch.aminmax(logits)
    return torch.isfinite(low) & torch.isfinite(high)


def _runs_of_one_kind(transfers: list[BlockTransfer]) -> list[list[BlockTransfer]]:
    """Consecutive transfers of the same kind, in order, none naming a block twice (a block
    loaded, given back and loaded again with other content in one step starts a new run)."""
    runs: list[list[BlockTransfer]] = []
    blocks: set[int] = set()
    for transfer in transfers:
        if runs and runs[-1][0].kind == transfer.kind and transfer.block not in blocks:
            runs[-1].append(transfer)
        else:
            runs.append([transfer])
            blocks = set()
        blocks.add(transfer.block)
    return runs


def _load_payload(transfer: BlockTransfer, store: KVTierStore | None) -> torch.Tensor:
    """A load's bytes: carried by the transfer (a prefill instance's), or the tier's copy."""
    if transfer.payload is not None:
        return transfer.payload
    assert store is not None
    return store.payload(transfer.key)
