"""Tensor parallelism on CPU with gloo: two ranks (rank 0 in this process, one spawned worker),
one thread each, against the same engine on one rank.

Checkpoints are small random Hugging Face models saved with `save_pretrained` (the HF parity
tests' builders); greedy tokens at tensor_parallel_size=2 must equal those at 1 (float32), and
every logits row the observer sees must agree to float32 rounding (the all-reduce sums the
partial products in another order).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import randomize_weights

from engines.base import ConfigError
from engines.builtin import LLM, SamplingParams
from engines.builtin.engine import EngineDeadError

# slow: `make test-fast` leaves it out; serial: its timings run alone (Makefile's `test`)
pytestmark = [pytest.mark.slow, pytest.mark.serial]
transformers = pytest.importorskip("transformers")

_PARITY = Path(__file__).parents[2] / "hf" / "test_hf_parity.py"
_spec = importlib.util.spec_from_file_location("tp_hf_parity", _PARITY)
assert _spec is not None and _spec.loader is not None
parity = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)

MAX_TOKENS = (12, 16, 10, 14)
ONE_THREAD = dict(num_threads=1, dtype="float32", max_model_len=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            if kind == "qwen2_tied":  # biases on q/k/v and one table for embedding and head
                config = transformers.Qwen2Config(**{**parity.BASE, "tie_word_embeddings": True})
                torch.manual_seed(5)
                model = transformers.AutoModelForCausalLM.from_config(config)
                randomize_weights(model, 5)
                assert model.lm_head.weight is model.model.embed_tokens.weight
                assert model.model.layers[0].self_attn.q_proj.bias is not None
            else:
                model = parity.build_hf_model(kind, parity.SEEDS[kind])
            cache[kind] = parity.save_checkpoint(model, tmp_path_factory.mktemp(kind))
        return cache[kind]

    return get


def generate(folder: Path, tp: int, prompts: list[list[int]], **options: Any):
    """Greedy tokens of each prompt, the logits rows observed, the engine's describe() and the
    sequences preempted. `kv_blocks=B`: a KV pool of B blocks (of 16 tokens) on every rank."""
    blocks = options.pop("kv_blocks", None)
    if blocks is not None:  # each rank's K/V heads: the same blocks take 1/tp of the bytes
        config = transformers.AutoConfig.from_pretrained(folder)
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads // tp * 16 * 4
        options["kv_cache_memory_bytes"] = blocks * 16 * per_token
    llm = LLM(model=str(folder), tensor_parallel_size=tp, **{**ONE_THREAD, **options})
    rows: list[torch.Tensor] = []
    preempted: list[int] = []
    llm.engine.add_logits_observer(lambda plan, logits: rows.append(logits.clone()))
    llm.engine.step_observers.append(lambda record: preempted.append(record.num_preempted))
    try:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS
        ]
        outputs = llm.generate(prompts, params)
        facts = llm.engine.describe()
        return [o.token_ids for o in outputs], torch.cat(rows), facts, sum(preempted)
    finally:
        llm.engine.close()


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Two pairs of prompts sharing a 20-token prefix (prefix caching reuses its blocks)."""
    base = parity.make_prompts(seed)
    common = [7 + (i * 37) % 4000 for i in range(20)]
    return [common + base[0], common + base[1], base[2], base[3]]


CASES = {
    "llama_gqa": ("llama_gqa", {}),
    "llama_mqa": ("llama_mqa", {}),  # one K/V head: each rank keeps a replica
    "qwen2_tied": ("qwen2_tied", {}),
    "mistral_swa": ("mistral_swa", {"kv_cache": "paged"}),  # window 8 < the prompts
    # packed qkv_proj and gate_up_proj: each part cut to the rank's rows
    "phi3": ("phi3", {"kv_cache": "paged"}),
    "qwen3": ("qwen3", {}),  # per-head q/k norms: whole on every rank
    # sandwich norms after the all-reduces, soft caps, windowed and global layers in turn
    "gemma2": ("gemma2", {"kv_cache": "paged"}),
    # expert parallelism: 2 of the 4 experts per rank, the shared expert's width halved, the
    # dense layer split as any MLP; and Mixtral's experts with INT4 weights
    "qwen2_moe_ep": ("qwen2_moe", {"enable_expert_parallel": True}),
    "mixtral_ep_int4": (
        "mixtral",
        {"enable_expert_parallel": True, "quantization": "int4", "quantization_group_size": 32},
    ),
    "paged_prefix_chunked": (
        "llama_gqa",
        {
            "kv_cache": "paged",
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 16,
            "block_size": 8,
        },
    ),
    # a pool of 6 blocks cannot hold the four sequences at once: some are preempted and
    # recomputed, on every rank alike (the block tables come with each step)
    "paged_preemption": ("llama_gqa", {"kv_cache": "paged", "kv_blocks": 6}),
    "int8": ("llama_gqa", {"quantization": "int8", "kv_cache": "paged"}),
    "int4": ("llama_gqa", {"quantization": "int4", "quantization_group_size": 32}),
    # rank 0 drafts and verifies; the other ranks run the verifying rows like any others
    "ngram_speculation": (
        "llama_gqa",
        {
            "kv_cache": "paged",
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 1,
            },
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_greedy_tokens_of_one(checkpoint, case: str) -> None:
    kind, options = CASES[kind_case := case]
    folder = checkpoint(kind)
    seed = parity.SEEDS.get(kind, 5)
    prompts = (
        shared_prefix_prompts(seed)
        if options.get("enable_prefix_caching")
        else parity.make_prompts(seed)
    )
    one, logits_one, facts_one, preempted_one = generate(folder, 1, prompts, **options)
    two, logits_two, facts, preempted_two = generate(folder, 2, prompts, **options)
    assert facts["tensor_parallel"]["backend"] == "gloo", kind_case
    assert two == one
    if "kv_blocks" in options:
        assert facts["kv_num_blocks"] == facts_one["kv_num_blocks"] < 10
        assert preempted_two == preempted_one > 0
    assert logits_two.shape == logits_one.shape
    scale = float(logits_one.std())
    assert float((logits_two - logits_one).abs().max()) < 1e-4 * scale


def expected_weight_bytes(cfg: Any, size: int, element: int = 4) -> int:
    """Per rank: the split layers' 1/size, the replicated K/V heads whole, norms whole."""
    hidden, head = cfg.hidden_size, cfg.head_dim
    kv_heads = max(1, cfg.num_key_value_heads // size)
    q = cfg.num_attention_heads // size * head
    per_layer = (
        hidden * q * 2  # q_proj rows, o_proj columns
        + 2 * hidden * kv_heads * head  # k_proj, v_proj rows
        + 3 * hidden * (cfg.intermediate_size // size)  # gate, up rows; down columns
        + 2 * hidden  # the two norms
    )
    vocab = -(-cfg.vocab_size // size)  # padded up to a multiple of the ranks
    tables = vocab * hidden * (1 if cfg.tie_word_embeddings else 2)
    return element * (cfg.num_hidden_layers * per_layer + tables + hidden)


@pytest.mark.parametrize("kind", ["llama_gqa", "llama_mqa"])
def test_per_rank_weight_bytes_are_the_shard_exactly(checkpoint, kind: str) -> None:
    folder = checkpoint(kind)
    config = transformers.AutoConfig.from_pretrained(folder)
    llm = LLM(model=str(folder), tensor_parallel_size=2, **ONE_THREAD)
    try:
        facts = llm.engine.describe()
    finally:
        llm.engine.close()
    assert facts["weight_bytes"] == expected_weight_bytes(config, 2)
    replicated = config.num_key_value_heads < 2
    assert facts["tensor_parallel"]["kv_heads_replicated"] is replicated
    one = LLM(model=str(folder), **ONE_THREAD).engine.describe()
    assert one["weight_bytes"] == expected_weight_bytes(config, 1)
    # each rank's KV per token: its K/V heads
    assert facts["kv_bytes_per_token"] * (1 if replicated else 2) == one["kv_bytes_per_token"]


def test_a_model_the_ranks_do_not_divide_is_refused_before_any_start() -> None:
    refused = r"engine\.tensor_parallel_size: 3 is invalid.*allowed: 1\|2\|4"
    with pytest.raises(ConfigError, match=refused):
        LLM(model="tiny", tensor_parallel_size=3)


def test_int4_groups_must_not_straddle_shards(checkpoint) -> None:
    # o_proj has 64 inputs: 32 per rank; 64-input groups would straddle the two shards
    with pytest.raises(ConfigError, match=r"engine\.quantization_group_size.*allowed"):
        LLM(
            model=str(checkpoint("llama_gqa")),
            tensor_parallel_size=2,
            quantization="int4",
            quantization_group_size=64,
            **ONE_THREAD,
        )


def worker_processes(llm: LLM) -> list[subprocess.Popen]:
    peers = llm.engine.peers
    assert peers is not None and peers.launcher == "spawn"
    return list(peers.processes)


PROMPT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_worker_that_dies_or_hangs_fails_the_engine_within_the_timeout(how: str) -> None:
    timeout_s = 3.0
    llm = LLM(
        model="tiny", tensor_parallel_size=2, tensor_parallel_timeout_s=timeout_s, num_threads=1
    )
    (worker,) = worker_processes(llm)
    assert llm.generate("hello there", PROMPT)[0].token_ids  # the ranks work
    os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    began = time.monotonic()
    with pytest.raises(EngineDeadError, match="tensor-parallel") as error:
        llm.generate(["hello again", "and more"], PROMPT)
    assert time.monotonic() - began < timeout_s + 5
    if how == "killed":
        assert "killed by SIGKILL" in str(error.value)
    assert llm.engine.failure is not None
    with pytest.raises(EngineDeadError):  # the engine stays failed
        llm.generate("once more", PROMPT)
    # nothing is left behind: the failed engine ended its worker (a stopped one is killed)
    worker.wait(timeout=15)
    assert worker.poll() is not None


def test_compiled_ranks_give_the_tokens_of_one_without_recompiling(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # engine.compile=true: the collectives ran inside the compiled graphs, where dynamo guarded
    # on TPGroup's counters (plain ints) and recompiled the forward every step until its limit
    # (8), then ran it eagerly, on the worker rank
    prompts = ["hello world this is", "the quick brown fox jumps over"]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)  # 10 steps > 8
    plain = LLM(model="tiny", num_threads=1)
    expected = [o.token_ids for o in plain.generate(prompts, greedy)]
    plain.engine.close()
    llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1, compile=True)
    try:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    finally:
        llm.engine.close()
    assert "recompile_limit" not in capfd.readouterr().err


def test_closing_the_engine_ends_its_workers() -> None:
    llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1)
    (worker,) = worker_processes(llm)
    llm.generate("hello", PROMPT)
    llm.engine.close()
    assert worker.wait(timeout=15) == 0


def test_ctrl_c_inside_a_step_ends_the_workers_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1)
    (worker,) = worker_processes(llm)
    llm.generate("hello", PROMPT)
    assert llm.engine.peers is not None

    def interrupted(x: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt  # rank 0 stops after the step went out: rank 1 is inside it

    monkeypatch.setattr(llm.engine.peers.tp, "all_reduce", interrupted)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        llm.generate("hello again", PROMPT)
    llm.engine.close()  # what a run does next; it used to wait ~10 s on the busy worker
    assert worker.wait(timeout=15) is not None
    assert time.monotonic() - began < 4
    assert "out of step" in str(llm.engine.failure)


#: A spawned worker whose shard takes two minutes to load: rank 0, stopped meanwhile, must not
#: wait for it
SLOW_LOADING_WORKER = [
    sys.executable,
    "-c",
    "import sys, time; sys.path.insert(0, sys.argv[1])\n"
    "import engines.builtin.model_runner as model_runner\n"
    "class Loading:\n"
    "    def __init__(self, *args, **kwargs):\n"
    "        time.sleep(120)\n"
    "model_runner.ModelRunner = Loading\n"
    "from engines.builtin.distributed.worker import spawned_main\n"
    "spawned_main(sys.argv[1:])\n",
]


@pytest.fixture
def slow_loading_workers(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen]:
    """The workers rank 0 spawns, each loading for two minutes."""
    from engines.builtin.distributed import launch

    spawned: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if list(args[0][:3]) == SLOW_LOADING_WORKER:  # not a compiler the load runs
                spawned.append(self)

    monkeypatch.setattr(launch, "WORKER_COMMAND", SLOW_LOADING_WORKER)
    monkeypatch.setattr(launch.subprocess, "Popen", Recorded)
    return spawned


def test_ctrl_c_while_rank_0_loads_ends_the_loading_workers_at_once(
    monkeypatch: pytest.MonkeyPatch, slow_loading_workers: list[subprocess.Popen]
) -> None:
    # it took 10 s: rank 0 asked the workers to exit, which a loading worker cannot hear
    # (5 s), then waited for them to exit (5 s), then killed them
    import torch.distributed as dist

    import engines.builtin.engine as engine_module

    interrupted: list[float] = []

    class Interrupted:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            interrupted.append(time.monotonic())
            raise KeyboardInterrupt

    monkeypatch.setattr(engine_module, "ModelRunner", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        LLM(model="tiny", tensor_parallel_size=2, num_threads=1)
    stopped_in = time.monotonic() - interrupted[0]
    assert [worker.poll() for worker in slow_loading_workers] == [-signal.SIGKILL]
    assert not dist.is_initialized()
    assert stopped_in < 4


def test_ctrl_c_while_rank_0_waits_for_the_workers_to_load_stops_it_at_once(
    monkeypatch: pytest.MonkeyPatch, slow_loading_workers: list[subprocess.Popen]
) -> None:
    # rank 0, loaded first, waited for the workers inside gloo (C++), where Ctrl-C reached it
    # only when they had loaded, or after the start-up deadline (300 s)
    import threading

    import torch.distributed as dist

    from engines.builtin.distributed.group import ControlChannel

    interrupted: list[float] = []
    send = ControlChannel.send

    def send_then_ctrl_c(self: ControlChannel, message: Any, timeout_s: float | None = None):
        if message[0] == "kv":  # rank 0 has loaded; the workers take it once they have

            def ctrl_c() -> None:
                interrupted.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)

            threading.Timer(0.5, ctrl_c).start()
        return send(self, message, timeout_s)

    monkeypatch.setattr(ControlChannel, "send", send_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        LLM(model="tiny", tensor_parallel_size=2, num_threads=1)
    stopped_in = time.monotonic() - interrupted[0]
    assert [worker.poll() for worker in slow_loading_workers] == [-signal.SIGKILL]
    assert not dist.is_initialized()
    assert stopped_in < 4


TORCHRUN_SCRIPT = """
import json
from engines.builtin import LLM, SamplingParams
llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1)
outs = llm.generate(["hello there", "one two three"],
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
print("TOKENS", json.dumps([o.token_ids for o in outs]), llm.engine.peers.launcher)
llm.engine.close()
llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1)  # the ranks serve a second one
print("SECOND", json.dumps(llm.generate("hello there", SamplingParams(temperature=0.0,
      max_tokens=8, ignore_eos=True))[0].token_ids))
"""


def test_ranks_started_the_way_torchrun_starts_them(tmp_path: Path) -> None:
    """The multi-node path on one machine: two processes, RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT in their environment, over loopback; rank 0 is the engine, rank 1 serves."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    lines = dict(line.split(" ", 1) for line in outputs[0][0].splitlines() if " " in line)
    assert lines["TOKENS"].endswith("torchrun")
    assert outputs[1][0] == ""  # rank 1 printed nothing: it never ran the script past LLM()
    llm = LLM(model="tiny", num_threads=1)
    expected = [
        o.token_ids
        for o in llm.generate(
            ["hello there", "one two three"],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        )
    ]
    import json

    assert json.loads(lines["TOKENS"].rsplit(" ", 1)[0]) == expected
    assert json.loads(lines["SECOND"]) == expected[0]


def test_torchrun_world_must_match_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ):
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"engine\.tensor_parallel_size: 2.*WORLD_SIZE=4"):
        LLM(model="tiny", tensor_parallel_size=2)


def test_a_worker_that_cannot_start_fails_the_engine_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engines.builtin.distributed import launch
    from engines.builtin.distributed.group import TensorParallelError

    monkeypatch.setattr(launch, "WORKER_COMMAND", ["false"])  # exits 1 before joining
    began = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 exited with code 1 while starting"):
        LLM(model="tiny", tensor_parallel_size=2, num_threads=1)
    assert time.monotonic() - began < 30  # not the 300 s start-up deadline
