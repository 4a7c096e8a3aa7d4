"""CUDA graphs for decode (`enforce_eager=false`, `cuda_graph_batch_sizes`) and `compile`.

On CPU: option validation, the CPU fallback, the bucket padding run eagerly over the same
static buffers (`DecodeGraphs(capture=False)`, Triton kernels under the interpreter), and
torch.compile. On a CUDA machine the graph tests capture and replay for real:
INFERLAB_TRITON_DEVICE=cuda pytest tests/engines/builtin/test_cuda_graphs.py
(scripts/gpu_check.sh runs it).
"""

from __future__ import annotations

import os

import pytest
import torch

from engines.base import ConfigError
from engines.builtin import LLM
from engines.builtin.config import EngineConfig
from engines.builtin.cuda_graphs import DecodeGraphs, default_batch_sizes
from engines.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

TRITON_DEVICE = os.environ.get("INFERLAB_TRITON_DEVICE", "cpu")  # see tests/conftest.py
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Eight prompts whose outputs end one step apart: the decode batch shrinks 8, 7, ..., 1, so
# every bucket serves batches that are full and batches padded up to it.
PROMPTS = [[7 + i, *range(50, 52 + 3 * i)] for i in range(8)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True) for i in range(8)]


def greedy(llm: LLM, count: int) -> list[list[int]]:
    outs = llm.generate(PROMPTS[:count], PARAMS[:count])
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


# ---- options ----------------------------------------------------------------------------------


def test_default_batch_sizes_follow_vllm() -> None:
    assert default_batch_sizes(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_batch_sizes(256)[-1] == 256 and len(default_batch_sizes(256)) == 35
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    assert default_batch_sizes(1) == [1]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("enforce_eager", "no", "engine.enforce_eager: 'no' is invalid; allowed: true|false"),
        ("compile", 1, "engine.compile: 1 is invalid; allowed: true|false"),
        ("cuda_graph_batch_sizes", [0, 4], "integers in [1, max_num_seqs=8]"),
        ("cuda_graph_batch_sizes", [16], "integers in [1, max_num_seqs=8]"),
        ("cuda_graph_batch_sizes", [], "a non-empty list"),
        ("cuda_graph_batch_sizes", "8", "a non-empty list"),
        ("cuda_graph_batch_sizes", [True], "a non-empty list"),
    ],
)
def test_bad_speed_options_are_refused(option: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("|", r"\|")):
        EngineConfig(max_num_seqs=8, **{option: value})


def test_batch_sizes_are_sorted_and_deduplicated() -> None:
    config = EngineConfig(max_num_seqs=8, cuda_graph_batch_sizes=[8, 1, 4, 8])
    assert config.cuda_graph_batch_sizes == [1, 4, 8]


def test_enforce_eager_false_is_accepted_and_explained_on_cpu(make_tiny) -> None:
    eager = make_tiny()
    llm = make_tiny(enforce_eager=False)
    facts = llm.engine.describe()
    assert facts["enforce_eager"] is False and facts["cuda_graphs"] is False
    assert facts["cuda_graph_batch_sizes"] == []
    assert "not used" in facts["cuda_graphs_note"] and "CUDA device" in facts["cuda_graphs_note"]
    assert eager.engine.describe()["cuda_graphs"] is False
    assert "cuda_graphs_note" not in eager.engine.describe()
    assert greedy(llm, 3) == greedy(eager, 3)


# ---- bucket padding, run eagerly (CPU: Triton interpreter) -------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache="contiguous"),
        dict(kv_cache="paged", block_size=4, kv_cache_dtype="int8"),
    ],
    ids=["contiguous", "paged-int8"],
)
def test_padded_buckets_give_eager_tokens(options: dict) -> None:
    """Everything a replay does except the capture: decodes written into the static buffers,
    padded up to a bucket (padding rows: slot -1, length 0), the decode kernel sized for
    max_model_len. Buckets 1, 2, 4, 8 serve batches of 5 down to 1 (5 and 3 padded). The
    reference is the eager torch backend (test_triton_kv_int8 / test_triton_kernels show the
    eager Triton backend gives its tokens), because the interpreter is slow."""
    pytest.importorskip("triton")
    from engines.builtin.attention.triton_backend import TritonAttention

    common = dict(
        model="tiny",
        dtype="float32",
        device=TRITON_DEVICE,
        max_model_len=64,
        max_num_seqs=8,
        **options,
    )
    expected = greedy(LLM(**common, attention_backend="torch"), 5)
    llm = LLM(**common, attention_backend="triton")
    runner = llm.engine.runner
    for layer in runner.model.layers:  # 32-key partitions: max_model_len=64 spans two
        layer.attn.backend = TritonAttention(partition_size=32, decode_block_n=16)
    runner.decode_graphs = DecodeGraphs(runner, [1, 2, 4, 8], capture=False)
    assert greedy(llm, 5) == expected
    assert runner.decode_graphs.replays >= 5  # every decode-only step went through a bucket
    if options["kv_cache"] == "paged":  # no sequence owns the NULL block 0: padding rows
        for cache in runner.kv_caches:  # must not have stored anything there either
            planes = [
                cache.k,
                cache.v,
                *((cache.k_scale, cache.v_scale) if cache.scaled else ()),
            ]
            assert all(not plane[0].any() for plane in planes)


# ---- torch.compile ------------------------------------------------------------------------


def test_compile_gives_eager_tokens_on_cpu(make_tiny) -> None:
    """torch.compile of the forward (inductor's C++ backend on CPU; ~25 s for tiny)."""
    from torch._dynamo.utils import counters

    expected = greedy(make_tiny(), 4)
    llm = make_tiny(compile=True)
    assert llm.engine.describe()["compile"] is True
    graphs_before = counters["stats"]["unique_graphs"]
    assert greedy(llm, 4) == expected
    assert counters["stats"]["unique_graphs"] > graphs_before  # the forward really compiled


# ---- on a CUDA GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache="contiguous"),
        dict(kv_cache="paged", block_size=16),
        dict(kv_cache="paged", block_size=16, kv_cache_dtype="int8"),
    ],
    ids=["contiguous", "paged", "paged-int8"],
)
def test_cuda_graph_replay_gives_eager_tokens(options: dict) -> None:
    common = dict(
        model="tiny",
        dtype="float32",
        device="cuda",
        max_model_len=256,
        max_num_seqs=8,
        attention_backend="triton",
        **options,
    )
    eager = LLM(**common)
    graphed = LLM(**common, enforce_eager=False)
    facts = graphed.engine.describe()
    assert facts["cuda_graphs"] is True and facts["cuda_graph_batch_sizes"] == [1, 2, 4, 8]
    graphs = graphed.engine.runner.decode_graphs
    assert all(b.graph is not None for b in graphs.buckets.values())
    for count in (1, 3, 5, 8):
        before = graphs.replays
        assert greedy(graphed, count) == greedy(eager, count), count
        assert graphs.replays > before


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_with_chosen_buckets_and_compile() -> None:
    common = dict(
        model="tiny",
        dtype="float32",
        device="cuda",
        max_model_len=256,
        max_num_seqs=8,
        attention_backend="triton",
        kv_cache="paged",
    )
    expected = greedy(LLM(**common), 8)
    llm = LLM(**common, enforce_eager=False, cuda_graph_batch_sizes=[2, 8], compile=True)
    assert llm.engine.runner.decode_graphs.sizes == [2, 8]
    assert greedy(llm, 8) == expected


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_refuse_the_dense_backend() -> None:
    with pytest.raises(ValueError, match="attention_backend=triton"):
        LLM(
            model="tiny",
            device="cuda",
            max_model_len=256,
            max_num_seqs=8,
            attention_backend="sdpa",
            enforce_eager=False,
        )
