"""CUDA graphs for decode steps, and torch.compile of the model forward.

A decode step launches a few kernels per layer, each doing little work: at small batch sizes
the step is bound by kernel launch overhead, not by the GPU. A CUDA graph records the whole
forward (model + LM head) once and replays it with one launch. A graph replays fixed shapes
at fixed addresses, so:

* one graph per batch-size bucket (`cuda_graph_batch_sizes`, vLLM's default 1, 2, 4, 8, 16,
  24, ... max_num_seqs); a step of n decodes replays the smallest bucket >= n, its rows
  n..bucket-1 padding;
* every input lives in the model runner's preallocated buffers (`StepInputs`: input ids,
  positions, slot mapping, sequence lengths, block tables; see attention/metadata.py), which
  the runner fills (padding rows included) and uploads before each step, so a replay reads
  this step's values;
* padding rows store nothing (slot -1, skipped by the Triton write kernel) and attend to
  nothing (sequence length 0: the decode kernel writes zeros), and their logits are dropped;
* the decode kernel's grid is sized for max_model_len, not for this step's longest context
  (a host value the graph cannot see change); partitions past a sequence's end do no work.

Only `attention_backend=triton` qualifies: the dense path sizes its K/V gather from this
step's host-side context lengths, a shape that changes every step.
With `capture=False` the same buckets, buffers and padding run eagerly: that is how CPU tests
(the Triton interpreter) check everything but the capture itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

from engines.builtin.attention import AttentionMetadata
from engines.builtin.attention.dense import AttentionBackend
from engines.builtin.config import EngineConfig
from engines.builtin.kv_cache import LayerKVCache
from engines.builtin.kv_cache.groups import KVGroups
from engines.builtin.model import DecoderLayer, Transformer
from engines.builtin.step_inputs import StepInputs
from models.config import ModelConfig

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # what CUDAGraph.pool() returns


class ModelRunner(Protocol):
    """What graph capture reads of the model runner (model_runner.py imports this module)."""

    config: EngineConfig
    device: torch.device
    ring: bool
    kv_groups: KVGroups | None  # a hybrid cache's groups (kv_cache/groups.py)
    attention: AttentionBackend  # the backend the layers run (auto resolved)
    max_num_seqs: int
    max_num_batched_tokens: int
    model: Transformer
    model_config: ModelConfig
    max_model_len: int
    block_size: int  # set with the KV cache, before graphs are captured
    inputs: StepInputs
    kv_caches: list[LayerKVCache]


def pad_decode_rows(arrays: dict[str, np.ndarray], start: int, end: int) -> None:
    """Rows start..end-1 of a decode batch (host arrays of `StepInputs`) become padding:
    token 0 at position 0, stored nowhere (slot -1), attending to nothing (length 0)."""
    arrays["input_ids"][start:end] = 0
    arrays["positions"][start:end] = 0
    arrays["slots"][start:end] = -1
    arrays["seq_lens"][start:end] = 0
    arrays["qsl"][start + 1 : end + 1] = np.arange(start + 1, end + 1)


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8, up to max_num_seqs (which is
    always a bucket, so every decode batch has one)."""
    sizes = [n for n in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if n <= max_num_seqs]
    return sorted({*sizes, max_num_seqs})


def graphs_unavailable_reason(runner: ModelRunner) -> str | None:
    """Why CUDA graphs cannot serve this engine's decode steps (None: they can)."""
    config = runner.config
    if runner.device.type != "cuda":
        return f"device is {runner.device.type}: CUDA graphs need a CUDA device"
    if not runner.attention.fixed_shapes:
        return (
            f"attention_backend={config.attention_backend}: the dense path's K/V gather "
            "changes shape every step; CUDA graphs need attention_backend=triton"
        )
    if not config.plugged("kv_cache").manager.retains_kv:
        return "kv_cache=none: every step recomputes the whole context (no decode steps)"
    if config.tensor_parallel_size > 1:
        return (
            "engine.tensor_parallel_size > 1: the graphs do not capture the collectives yet "
            "(the other ranks would have to replay theirs in step)"
        )
    if runner.model_config.num_experts:
        return (
            "a mixture-of-experts model: its experts run on the rows routed to them, a "
            "number the host reads every step"
        )
    if runner.kv_groups is not None:
        return (
            "a hybrid KV cache (engine.hybrid_kv_cache): the graphs capture one block table, "
            "its layers read one per KV group; or set engine.hybrid_kv_cache=false"
        )
    if runner.ring:
        return (
            "a sliding-window model's contiguous ring cache (the Triton kernels do not "
            "read it); use kv_cache=paged"
        )
    return None


@dataclass
class _Bucket:
    size: int
    meta: AttentionMetadata  # views into the runner's buffers, sized for the bucket
    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor | None  # the graph's static output [size, vocab]


class DecodeGraphs:
    """Per-bucket decode graphs over `runner`'s buffers; see the module docstring."""

    def __init__(self, runner: ModelRunner, batch_sizes: list[int], capture: bool) -> None:
        limit = min(runner.max_num_seqs, runner.max_num_batched_tokens)
        self.runner = runner
        self.capture = capture
        self.sizes = sorted({n for n in batch_sizes if n <= limit})
        if not self.sizes:
            raise ValueError(
                f"engine.cuda_graph_batch_sizes: {batch_sizes} has no size "
                f"<= {limit} (the most decodes a step can hold)"
            )
        self.buckets: dict[int, _Bucket] = {}
        self.replays = 0  # decode steps served by a bucket (tests and describe())
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller ones reuse its memory
            bucket = _Bucket(size, self._meta(size), None, None)
            if capture:
                pool = self._capture(bucket, pool)
            self.buckets[size] = bucket

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, num_decodes: int) -> int | None:
        """The smallest bucket that holds num_decodes rows, if any."""
        return next((n for n in self.sizes if n >= num_decodes), None)

    def run(self, size: int, num_decodes: int) -> torch.Tensor:
        """Logits [num_decodes, vocab] of a decode-only step whose rows the runner has already
        uploaded: rows 0..num_decodes-1 real, the rest of bucket `size` padding
        (`pad_decode_rows`)."""
        bucket = self.buckets[size]
        if bucket.graph is not None:
            bucket.graph.replay()
            logits = bucket.logits
        else:
            logits = self._forward(bucket)
        self.replays += 1
        assert logits is not None
        return logits[:num_decodes]

    # ---- internals ------------------------------------------------------------------------

    def _meta(self, size: int) -> AttentionMetadata:
        """Metadata over the first `size` rows of the runner's buffers. The host-side lengths
        are max_model_len: they size the decode kernel's grid for any context."""
        r = self.runner
        dev = r.inputs.device
        return AttentionMetadata(
            positions=dev["positions"][:size],
            slot_mapping=dev["slots"][:size],
            query_start_loc=dev["qsl"][: size + 1],
            seq_lens=dev["seq_lens"][:size],
            block_tables=dev["block_tables"][:size],
            query_start_loc_host=list(range(size + 1)),
            seq_lens_host=[r.max_model_len] * size,
            num_decodes=size,
            max_seq_len=r.max_model_len,
            block_size=r.block_size,
            sliding_window=r.model_config.kv_sliding_window,
            use_cache=True,
            ring=False,
        )

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        model = self.runner.model
        bucket.meta.per_step.clear()  # derived from the previous step's values
        hidden = model(self.runner.inputs.device["input_ids"][: bucket.size], bucket.meta)
        logits = model.compute_logits(hidden)
        assert logits is not None  # one rank: graphs are off under tensor parallelism
        return logits

    def _capture(self, bucket: _Bucket, pool: _POOL_HANDLE | None) -> _POOL_HANDLE:
        """Warm up (compiles the Triton kernels; no launch may compile during capture), then
        record the bucket's forward. Returns the memory pool the graphs share."""
        inputs = self.runner.inputs
        pad_decode_rows(inputs.host_arrays(), 0, bucket.size)
        inputs.upload(with_tables=False, num_seqs=0)
        for _ in range(2):
            self._forward(bucket)
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            bucket.logits = self._forward(bucket)
        bucket.graph = graph
        return graph.pool() if pool is None else pool


# ---- torch.compile ----------------------------------------------------------------------------


class _EagerAttention:
    """The attention backend run outside torch.compile: its host-side loops over sequences and
    Triton launches stay eager (a graph break), the tensor code around it is compiled."""

    def __init__(self, inner: Callable[..., torch.Tensor]) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.fixed_shapes: bool = getattr(inner, "fixed_shapes", False)
        self.kv_cache_class: type[LayerKVCache] = getattr(inner, "kv_cache_class", LayerKVCache)
        self.caps_scores: bool = getattr(inner, "caps_scores", False)
        self.reads_fp8_kv: bool = getattr(inner, "reads_fp8_kv", False)
        # wrapped here, not by a decorator: torch.compiler.disable imports torch._dynamo
        # (seconds), which every process importing the engine would pay, compiled or not
        self._eager = torch.compiler.disable(self._inner_call)

    def _inner_call(self, *args: object) -> torch.Tensor:
        return self.inner(*args)

    def __call__(self, *args: object) -> torch.Tensor:
        return self._eager(*args)


def compile_model(runner: ModelRunner) -> None:
    """torch.compile the model forward (dynamic shapes: the packed token count changes every
    step). Attention and the KV-cache write run eagerly between compiled pieces. Inductor
    needs a working C++ compiler on CPU (Triton on CUDA); a failure surfaces on the first
    step as an error naming engine.compile."""
    for module in runner.model.layers:
        layer = cast(DecoderLayer, module)  # ModuleList iterates as Module
        layer.attn.backend = _EagerAttention(layer.attn.backend)
    for cache in runner.kv_caches:
        cache.write = torch.compiler.disable(cache.write)  # type: ignore[method-assign]
    runner.model.tp.keep_out_of_compiled_graphs()
    runner.model.forward = torch.compile(runner.model.forward, dynamic=True)  # type: ignore[method-assign]
