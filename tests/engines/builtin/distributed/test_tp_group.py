"""The model's collectives on a real process group of one rank: gloo here, NCCL on a GPU (the
GPU check script runs this file with a CUDA device). A world of one sums and gathers nothing,
so the logits must equal the model's without any group; what it proves is that every call
the model makes to torch.distributed runs, on the backend the engine would use."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from engines.builtin.attention import make_attention
from engines.builtin.attention.metadata import AttentionMetadata
from engines.builtin.distributed.group import TPGroup
from engines.builtin.layers import make_linear_method
from engines.builtin.model import Transformer
from engines.builtin.weights import load_weights
from models.location import resolve_model
from models.weights import dummy_state_dict

BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param(
        "nccl",
        id="nccl",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.fixture
def world_of_one(request: pytest.FixtureRequest) -> Iterator[object]:
    if dist.is_initialized():
        pytest.fail("a torch.distributed world is already up in this process")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        request.param, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    try:
        yield dist.new_group(backend=request.param)
    finally:
        dist.destroy_process_group()


def prefill_metadata(num_tokens: int, device: torch.device) -> AttentionMetadata:
    """One sequence of `num_tokens`, no cache."""
    return AttentionMetadata(
        positions=torch.arange(num_tokens, device=device),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
        query_start_loc_host=[0, num_tokens],
        seq_lens_host=[num_tokens],
        num_decodes=0,
        max_seq_len=num_tokens,
        block_size=16,
        sliding_window=None,
        use_cache=False,
        ring=False,
    )


def logits_of(tp: TPGroup | None, device: torch.device) -> torch.Tensor:
    cfg = resolve_model("tiny")
    with torch.device("meta"):
        model = Transformer(
            cfg, make_linear_method("none"), make_attention("torch"), 64, device, tp=tp
        )
    load_weights(model, dummy_state_dict(cfg, 0).items(), torch.float32, device)
    ids = torch.arange(3, 40, device=device)
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, prefill_metadata(len(ids), device)))
    assert logits is not None
    return logits


@pytest.mark.parametrize("world_of_one", BACKENDS, indirect=True)
def test_a_world_of_one_runs_every_collective_and_changes_nothing(world_of_one) -> None:
    backend = dist.get_backend(world_of_one)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    group = TPGroup(0, 1, world_of_one)
    with_group = logits_of(group, device)
    assert group.comm_calls == 2 * resolve_model("tiny").num_layers + 2  # + embedding, gather
    ns, sent = group.take_counters()
    assert ns > 0 and sent > 0
    torch.testing.assert_close(with_group, logits_of(None, device), rtol=0, atol=0)


def test_more_ranks_than_cuda_devices_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.base import ConfigError
    from engines.builtin.distributed.launch import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_device("cuda", 0, 1) == "cuda:0"
    with pytest.raises(ConfigError, match=r"engine\.tensor_parallel_size: 2 ranks need 2 CUDA"):
        rank_device("cuda", 0, 2)
    assert rank_device("cpu", 1, 2) == "cpu"


def test_a_missing_cuda_device_is_refused_as_engine_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # one rank asked for a GPU that is not there: the fault is engine.device, which the error
    # used to leave out, blaming engine.tensor_parallel_size=1 ("allowed: 1..1")
    from engines.base import ConfigError
    from engines.builtin import LLM
    from engines.builtin.distributed.launch import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^engine\.device: 'cuda' requested but CUDA is not"):
        LLM(model="tiny", device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^engine\.device: 'cuda:1' is not on this machine"):
        rank_device("cuda:1", 0, 1)
    with pytest.raises(ConfigError, match=r"^engine\.device: 'cuda:x' is invalid"):
        LLM(model="tiny", device="cuda:x")
