"""A decode step's decoder layers as one call into the engine's C kernels (native/decode_layers.c).

Layer by layer, the model's modules call ~9 C kernels each from Python; the Python around them
(module calls, argument checks, views) costs ~0.5 ms a layer on a 2-core Zen 3, more than the
layer's own matmuls at batch 1 on a SmolLM2-135M-sized model with INT4 weights: 30 layers, ~15
ms a step, about llama.cpp's whole step there. The program is the CPU's answer to a CUDA graph:
the layers' weights, caches and shapes go into C structs once (after the KV cache exists), and
each decode step is one call that runs the same kernels, in the same order, on the same values.
Quantized layers give bit-identical results either way; dense ones multiply through the
engine's GEMM at every row count (layer by layer, one row takes torch's GEMV), so their logits
agree to float32 rounding (tests/engines/builtin/test_decode_program.py).

It runs a step when every row is a single-token decode over a float32 cache written by slot
(not a sliding-window ring, not static batching's padded rows), rows under LoRA adapters
included (each linear adds their deltas with the kernel the modules call, lora_bgmv_f32's two
halves). Other steps, and engines it cannot take (`unavailable_reason`), go layer by layer.
`engine.native_decode_program=false` turns it off; describe()["native_decode_program"] says
whether it is used, or why not.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from engines.builtin import native
from engines.builtin.attention.cpu import CpuAttention
from engines.builtin.attention.metadata import AttentionMetadata
from engines.builtin.layers.linear import Linear
from engines.builtin.layers.native_linear import c_pointer, linear_problem, linear_weights
from engines.builtin.mlp import MLP
from engines.builtin.moe import MoE
from engines.builtin.team_size import TeamSizer

if TYPE_CHECKING:
    from engines.builtin.model import DecoderLayer, Transformer

_PTR, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
#: engine.cpu_wait_policy -> how long a thread spins at a barrier before it sleeps, in ns
#: (team.h: -1 for ever, 0 not at all; auto: the library's own budget)
_SPIN_NS = {"active": -1, "passive": 0}
log = logging.getLogger(__name__)


class ProgramLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _PTR),
        ("post_attn_norm", _PTR),
        ("qkv", native.LinearWeights),
        ("o", native.LinearWeights),
        ("gate_up", native.LinearWeights),
        ("down", native.LinearWeights),
        ("qkv_lora", native.LoraWeights),
        ("o_lora", native.LoraWeights),
        ("gate_up_lora", native.LoraWeights),
        ("down_lora", native.LoraWeights),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("kv_format", _I64),
        ("experts", _I64),
        ("top_k", _I64),
        ("normalize", _I64),
        ("expert_inter", _I64),
        ("router", native.LinearWeights),
        ("expert_gate_up", _PTR),
        ("expert_down", _PTR),
        ("routing", _PTR),
        ("expert_ns", _PTR),
        ("q_norm", _PTR),
        ("k_norm", _PTR),
    ]


class ProgramShape(ctypes.Structure):
    _fields_ = [
        ("hidden", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("intermediate", _I64),
        ("block_size", _I64),
        ("window", _I64),
        ("eps", _F32),
        ("scale", _F32),
        ("rope_table", _PTR),
    ]


def unavailable_reason(model: Transformer) -> str | None:
    """Why the program cannot run this model's layers (None: it can)."""
    if native.load() is None:
        return f"the engine's C kernels are unavailable: {native.reason()}"
    cfg = model.config
    if cfg.shared_expert_intermediate_size:
        return "a shared expert (the program runs routed experts only)"
    if cfg.qk_norm == "full":
        return "q/k norms over every head (qk_norm=full; the program norms each head)"
    gemma = {
        "sandwich norms": cfg.sandwich_norms,
        f"hidden_act={cfg.hidden_act}": cfg.hidden_act != "silu",
        "attention soft-capping": cfg.attn_logit_softcapping is not None,
        "sliding-window layers beside global ones": bool(cfg.full_attention_layers),
        "a second RoPE base": cfg.local_rope_theta is not None,
    }
    if any(gemma.values()):
        return ", ".join(k for k, on in gemma.items() if on) + " (the program runs Llama's layer)"
    for module in model.layers:
        layer: DecoderLayer = module  # type: ignore[assignment]
        attn = layer.attn
        if not isinstance(attn.backend, CpuAttention):
            return f"attention backend {attn.backend.name!r} (the program runs the C kernel's)"
        cache = attn.cache
        if cache is None:
            return "no KV cache (kv_cache=none)"
        if cache.scaled or cache.dtype != torch.float32 or not cache.stores_by_slot:
            return "the KV cache is not float32 or FP8 stored by slot (kv_cache_dtype=int8?)"
        mlp = layer.mlp
        if isinstance(mlp, MoE) and len(mlp.experts) != mlp.router.out_features:
            return "expert parallelism (the program runs every expert)"
        for linear in (attn.qkv_proj, attn.o_proj, *_mlp_linears(mlp)):
            problem = linear_problem(linear)
            if problem is not None:
                return problem
        if isinstance(mlp, MoE) and mlp.router.weight.dtype != torch.float32:
            return "the router is not float32"
        norms = [layer.input_norm.weight, layer.post_attn_norm.weight]
        norms += [n.weight for n in (attn.q_norm, attn.k_norm) if n is not None]
        if any(not native.takes(w) for w in norms):
            return "norm weights are not float32"
    if model.rope.cos_sin_table.dtype != torch.float32 or cfg.num_layers == 0:
        return "no float32 rotary table or no layers"
    return None


def _mlp_linears(mlp: MLP | MoE) -> list[Linear]:
    """The linear layers of a dense MLP or of every expert."""
    experts = [mlp] if isinstance(mlp, MLP) else [e for e in mlp.experts if isinstance(e, MLP)]
    return [layer for e in experts for layer in (e.gate_up_proj, e.down_proj)]


def _warn_if_spinning_beyond_the_cpus() -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus is not None and torch.get_num_threads() > cpus:
        log.warning(
            "engine.cpu_wait_policy=active on %d threads and %d CPUs: a spinning thread holds "
            "the core another one needs at every barrier, and a step can take 100x as long (64 "
            "threads on 2 CPUs: 45 s for 30 tokens); auto or passive do not",
            torch.get_num_threads(),
            cpus,
        )


class DecodeProgram:
    """The model's decoder layers as C structs, run by `run` for decode-only steps."""

    def __init__(self, model: Transformer, block_size: int, wait_policy: str = "auto") -> None:
        """Reads the layers' tensors as they are now: a layer loaded again afterwards needs a
        new program (the model runner builds it once the KV cache exists). `wait_policy`:
        engine.cpu_wait_policy."""
        cfg = model.config
        lib = native.load()
        assert lib is not None  # unavailable_reason said so
        self.spin_ns: int = (
            _SPIN_NS[wait_policy] if wait_policy in _SPIN_NS else lib.team_default_spin_ns()
        )
        # auto: the team's size measured as the steps run (team_size.py); else every thread
        self.sizer = TeamSizer(torch.get_num_threads()) if wait_policy == "auto" else None
        if wait_policy == "active":
            _warn_if_spinning_beyond_the_cpus()
        first: DecoderLayer = model.layers[0]  # type: ignore[assignment]
        self.keep: list[torch.Tensor] = []  # every tensor the structs point into
        self.table_positions = model.rope.cos_sin_table.shape[0]
        self.block_size = block_size
        self.shape = ProgramShape(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            block_size,
            cfg.sliding_window or 0,
            first.input_norm.eps,
            first.attn.scale,
            c_pointer(model.rope.cos_sin_table, self.keep),
        )
        layers = []
        #: whether it runs steps with LoRA rows: every LoRA-carrying layer has the C kernels'
        #: view of its slots (engines/builtin/lora/layer.py), which write in place
        self.runs_lora = True
        self.arrays: list[Any] = []  # the experts' C arrays the layers point into
        #: each MoE layer's module and the buffers the program writes its routing and time to
        self.moe: list[tuple[MoE, torch.Tensor, torch.Tensor]] = []
        for module in model.layers:
            layer: DecoderLayer = module  # type: ignore[assignment]
            attn, mlp = layer.attn, layer.mlp
            assert attn.cache is not None  # unavailable_reason said so
            dense = mlp if isinstance(mlp, MLP) else None
            linears = (
                attn.qkv_proj,
                attn.o_proj,
                *((dense.gate_up_proj, dense.down_proj) if dense else (None, None)),
            )
            loras = []
            for linear in linears:
                slots = None if linear is None else linear.lora
                weights = None if slots is None else slots.native_weights
                self.runs_lora &= slots is None or weights is not None
                if slots is not None and weights is not None:
                    self.keep += [slots.a, slots.b, slots.rank_tensor, slots.part_ends]
                loras.append(native.LoraWeights() if weights is None else weights)
            layers.append(
                ProgramLayer(
                    c_pointer(layer.input_norm.weight, self.keep),
                    c_pointer(layer.post_attn_norm.weight, self.keep),
                    *(
                        native.LinearWeights()
                        if linear is None
                        else linear_weights(linear, self.keep)
                        for linear in linears
                    ),
                    *loras,
                    c_pointer(attn.cache.k, self.keep),
                    c_pointer(attn.cache.v, self.keep),
                    native.kv_format(attn.cache.fp8),
                    *(() if isinstance(mlp, MLP) else self._moe_fields(mlp)),
                    q_norm=c_pointer(
                        None if attn.q_norm is None else attn.q_norm.weight, self.keep
                    ),
                    k_norm=c_pointer(
                        None if attn.k_norm is None else attn.k_norm.weight, self.keep
                    ),
                )
            )
        self.layers = (ProgramLayer * len(layers))(*layers)

    def _moe_fields(self, moe: MoE) -> tuple[Any, ...]:
        """A mixture-of-experts layer's ProgramLayer fields: its sizes, the router packed into
        the GEMM's panels, its experts' C arrays, and the buffers the program writes."""
        experts = [e for e in moe.experts if isinstance(e, MLP)]
        router = native.pack_linear_weight(moe.router.weight.data.contiguous())
        hidden, count = moe.router.in_features, moe.router.out_features
        gate_up, down = (
            (native.LinearWeights * count)(
                *(linear_weights(getattr(e, name), self.keep) for e in experts)
            )
            for name in ("gate_up_proj", "down_proj")
        )
        routing = torch.zeros(count, dtype=torch.int64)
        expert_ns = torch.zeros(1, dtype=torch.int64)
        self.keep += [router, routing, expert_ns]
        self.arrays.append((gate_up, down))
        self.moe.append((moe, routing, expert_ns))
        return (
            count,
            moe.top_k,
            int(moe.normalize),
            experts[0].intermediate,
            native.LinearWeights(
                native.LINEAR_DENSE, router.data_ptr(), None, None, None, hidden, count, 0, 0
            ),
            ctypes.addressof(gate_up),
            ctypes.addressof(down),
            routing.data_ptr(),
            expert_ns.data_ptr(),
        )

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one the program runs: single-token decodes only, written by
        slot (no ring, no padding rows), float32 rows."""
        return (
            meta.num_decodes == meta.num_seqs == x.shape[0] > 0
            and meta.use_cache
            and not meta.ring
            and meta.write_index is None
            and (meta.lora is None or self.runs_lora)
            and x.dtype == torch.float32
        )

    def run(self, x: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers on the embeddings x [T, hidden] -> (last MLP output, residual stream)."""
        rows = x.shape[0]
        # the checks the modules' kernel wrappers make, once per step
        if meta.max_seq_len > self.table_positions:
            raise ValueError(
                f"decode program: position {meta.max_seq_len - 1} past the rotary table "
                f"({self.table_positions} positions)"
            )
        tables = meta.block_tables
        if meta.max_seq_len > tables.shape[1] * self.block_size or tables.stride(1) != 1:
            raise ValueError(
                f"decode program: a context of {meta.max_seq_len} tokens exceeds the block "
                f"tables ({tables.shape[1]} x {self.block_size})"
            )
        self.shape.window = meta.sliding_window or 0
        threads = torch.get_num_threads()
        if self.sizer is not None:
            if self.sizer.most != threads:  # torch's count changed since: measure afresh
                self.sizer = TeamSizer(threads)
            threads = self.sizer.next_size()
        x = x.contiguous()
        residual = torch.zeros_like(x)  # residual += embeddings: the embeddings exactly
        start = time.perf_counter_ns()
        status = native._run(
            "decode_layers_f32",
            ctypes.byref(self.shape),
            self.layers,
            len(self.layers),
            x.data_ptr(),
            residual.data_ptr(),
            rows,
            meta.positions.data_ptr(),
            meta.slot_mapping.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            meta.seq_lens.data_ptr(),
            None if meta.lora is None else meta.lora.slot_of_row.data_ptr(),
            threads,
            self.spin_ns,
        )
        if status != 0:
            raise MemoryError("decode program: could not allocate its scratch memory")
        if self.sizer is not None:
            self.sizer.record(threads, (time.perf_counter_ns() - start) / rows)
        for moe, routing, expert_ns in self.moe:  # the step's statistics, as the module sets them
            moe.last_routing = routing.tolist()
            moe.last_expert_ns = int(expert_ns[0])
        return x, residual
