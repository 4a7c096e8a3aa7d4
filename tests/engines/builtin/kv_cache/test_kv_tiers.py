"""KV tiers (kv_cache/tiers.py): blocks evicted from the pool come back from host memory or
disk with the tokens and logits recomputing them would give, and every fault (a corrupt or
missing file, a full disk, a folder that cannot be written) ends in a counted fallback or a
clear error."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.base import ConfigError, Finished, StepRecord
from engines.builtin import LLM, SamplingParams
from engines.builtin.kv_cache.block_pool import CachedBlock
from engines.builtin.kv_cache.tiers import KVTierStore

TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # tiny: layers x K,V x kv_heads x head_dim x fp32
BLOCK = 4
BLOCK_BYTES = BLOCK * TOKEN_BYTES
# 40 blocks: about three of the prompts below, so each round evicts the one before it
POOL = dict(
    kv_cache="paged",
    block_size=BLOCK,
    enable_prefix_caching=True,
    kv_cache_memory_bytes=40 * BLOCK_BYTES,
)
PROMPTS = [[(i * 37 + k * 11) % 900 + 5 for k in range(50)] for i in range(8)]


def greedy(max_tokens: int = 6, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs
    )


def rounds(llm: LLM, count: int = 2) -> tuple[list[list[int]], list[StepRecord]]:
    """The prompts one at a time, then (count=2) again in reverse order: the pool holds only
    the last few, the host tier the ones before, the disk the oldest."""
    steps: list[StepRecord] = []
    llm.engine.step_observers.append(steps.append)
    order = (PROMPTS + PROMPTS[::-1])[: count * len(PROMPTS)]
    tokens = [llm.generate([prompt], [greedy()])[0].outputs[0].token_ids for prompt in order]
    return tokens, steps


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    """No tiers: the second round recomputes what the first one's evictions lost."""
    llm = LLM("tiny", dtype="float32", **POOL)
    tokens, _ = rounds(llm)
    llm.engine.close()
    return tokens


TIERS = {
    "host": dict(kv_host_tier_bytes=1 << 20),
    "disk": dict(kv_disk_tier_bytes=1 << 20),
    # a host tier of 20 blocks in front of the disk: blocks pass through both
    "host_disk": dict(kv_host_tier_bytes=20 * BLOCK_BYTES, kv_disk_tier_bytes=1 << 20),
}


@pytest.mark.parametrize("tiers", list(TIERS))
def test_tier_hits_give_the_recomputed_tokens(tiers: str, plain: list[list[int]]) -> None:
    llm = LLM("tiny", dtype="float32", **POOL, **TIERS[tiers])
    tokens, steps = rounds(llm)
    kv = llm.engine.kv
    assert tokens == plain
    for tier in ("host", "disk"):
        # the second round's prompts came back from the tiers the config names
        assert (kv.tier_loaded_tokens[tier] > 0) == (tier in tiers), kv.tier_loaded_tokens
    assert kv.tiers is not None and kv.tiers.counters.corrupt_blocks == 0
    saved = sum(s.kv_bytes_saved for s in steps)
    loaded = sum(s.kv_bytes_loaded for s in steps)
    assert saved % BLOCK_BYTES == 0 and saved >= loaded > 0
    assert loaded == sum(kv.tier_loaded_tokens.values()) * TOKEN_BYTES
    # a block whose file is still being written is loaded from the writer's copy, unread
    assert sum(s.kv_disk_read_bytes for s in steps) <= kv.tier_loaded_tokens["disk"] * TOKEN_BYTES
    assert all(s.kv_transfer_ns > 0 for s in steps if s.kv_bytes_saved or s.kv_bytes_loaded)
    folder = None if kv.tiers.disk is None else kv.tiers.disk.path
    llm.engine.close()
    assert folder is None or not folder.exists()  # the disk tier's files go with the engine


@pytest.mark.parametrize(
    "options",
    [
        dict(enable_chunked_prefill=True, max_num_batched_tokens=12),
        dict(max_num_seqs=8),  # all at once: the pool is too small, so sequences are preempted
    ],
    ids=["chunked", "batched_preempt"],
)
def test_tiers_with_chunked_prefill_and_preemption(options: dict) -> None:
    def run(**tiers: int) -> tuple[list[list[int]], list[StepRecord], LLM]:
        llm = LLM("tiny", dtype="float32", **POOL, **options, **tiers)
        steps: list[StepRecord] = []
        llm.engine.step_observers.append(steps.append)
        outs = []
        for _ in range(2):
            outs += llm.generate(PROMPTS, [greedy(8)] * len(PROMPTS))
        return [o.outputs[0].token_ids for o in outs], steps, llm

    expected, _, _ = run()
    tokens, steps, llm = run(kv_host_tier_bytes=8 * BLOCK_BYTES, kv_disk_tier_bytes=1 << 20)
    assert tokens == expected
    assert sum(llm.engine.kv.tier_loaded_tokens.values()) > 0
    if "max_num_seqs" in options:
        assert sum(s.num_preempted for s in steps) > 0
    llm.engine.close()


def test_a_prefix_from_disk_gives_the_logits_of_one_found_on_the_device() -> None:
    """The same prompt after a first one that shares its prefix: once with that prefix still
    in the pool, once with it evicted to disk and read back; the logprobs are equal exactly."""
    shared = list(range(300, 340))
    first, second = [*shared, 1, 2, 3], [*shared, 7, 8, 9, 10]

    def logprobs(llm: LLM, evict: bool) -> tuple[list, list[int]]:
        llm.generate([first], [greedy()])
        if evict:  # fill the pool with other prompts, pushing the shared blocks out
            llm.generate(PROMPTS[:4], [greedy()] * 4)
        hits = dict(llm.engine.kv.tier_loaded_tokens)
        out = llm.generate([second], [greedy(logprobs=5)])[0].outputs[0]
        if evict:  # every full block of the shared prefix came back from disk
            assert llm.engine.kv.tier_loaded_tokens["disk"] - hits["disk"] == len(shared)
        return [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or []], out.token_ids

    on_device = LLM("tiny", dtype="float32", **{**POOL, "kv_cache_memory_bytes": 400 * BLOCK_BYTES})
    expected = logprobs(on_device, evict=False)
    from_disk = LLM("tiny", dtype="float32", **POOL, kv_disk_tier_bytes=1 << 20)
    got = logprobs(from_disk, evict=True)
    assert got == expected
    from_disk.engine.close()


def test_loads_of_an_admission_given_back_still_run() -> None:
    """A prompt whose prefix is in the host tier arrives while a long request holds most of
    the pool: its match loads what fits, then it cannot be admitted and gives the blocks back
    (cached, evictable). Those loads must still run, or its later admission (a device hit on
    them) would read blocks nobody wrote."""
    prefix = list(range(500, 548))  # 12 blocks
    long_prompt = list(range(1000, 1100))  # with its 40 tokens: 35 of the 40 blocks

    def run(**tiers: int) -> tuple[list[list[int]], LLM]:
        llm = LLM("tiny", dtype="float32", **POOL, **tiers)
        llm.generate([[*prefix, 1]], [greedy()])
        llm.generate(PROMPTS[:3], [greedy()] * 3)  # pushes the prefix out of the pool
        engine = llm.engine
        outputs: dict[str, list[int]] = {"long": [], "again": []}

        def step() -> None:
            for event in engine.step():
                outputs[event.request_id].extend(getattr(event, "token_ids", ()))

        engine.add_request("long", long_prompt, greedy(40))
        step()  # the long request is running
        engine.add_request("again", [*prefix, 2, 3], greedy(6))
        while engine.has_unfinished_requests():
            step()
        return [outputs["long"], outputs["again"]], llm

    expected, _ = run()
    tokens, llm = run(kv_host_tier_bytes=1 << 20)
    assert tokens == expected
    assert llm.engine.kv.tier_loaded_tokens["host"] > 0
    llm.engine.close()


def _written(llm: LLM) -> list[Path]:
    store = llm.engine.kv.tiers
    assert store is not None and store.disk is not None
    store.sync()
    return sorted(store.disk.path.glob("*.kv"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "swap"])
def test_a_damaged_tier_file_is_recomputed_and_counted(damage: str, plain: list) -> None:
    llm = LLM("tiny", dtype="float32", **POOL, kv_disk_tier_bytes=1 << 20)
    first, _ = rounds(llm, count=1)
    files = _written(llm)
    assert files
    for file in files:
        raw = bytearray(file.read_bytes())
        if damage == "flip":
            raw[-1] ^= 0x40  # one bit of the last value
            file.write_bytes(bytes(raw))
        elif damage == "truncate":
            file.write_bytes(bytes(raw[:-8]))
        elif damage == "delete":
            file.unlink()
    if damage == "swap":  # each file holds another block's bytes under its own name
        contents = [f.read_bytes() for f in files]
        for file, content in zip(files, contents[1:] + contents[:1], strict=True):
            file.write_bytes(content)
    second = [llm.generate([p], [greedy()])[0].outputs[0].token_ids for p in PROMPTS[::-1]]
    store = llm.engine.kv.tiers
    assert first + second == plain  # no token from a damaged block
    assert store is not None and store.counters.corrupt_blocks > 0
    assert llm.engine.kv.tier_loaded_tokens["disk"] == 0
    assert store.counters.last_error
    if damage != "delete":  # the damaged files read went with their entries: no file orphaned
        assert len(_written(llm)) == store.disk_blocks
    llm.engine.close()


FULL_DISK = """
import json, resource, signal, sys
sys.path.insert(0, {tests!r})
from test_kv_tiers import LLM, POOL, rounds
# the process may write files of 100 bytes at most: each block's write stops short (as on a
# disk that fills up mid-file), then fails
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
llm = LLM("tiny", dtype="float32", **POOL, kv_disk_tier_bytes=1 << 20)
tokens, _ = rounds(llm)
store = llm.engine.kv.tiers
store.sync()
print(json.dumps(dict(tokens=tokens, errors=store.counters.disk_write_errors,
    written=store.counters.disk_written_blocks, on_disk=store.disk_blocks,
    loaded=llm.engine.kv.tier_loaded_tokens["disk"], message=store.counters.last_error)))
"""


def test_a_full_disk_drops_blocks_and_counts_the_errors(plain: list) -> None:
    script = FULL_DISK.format(tests=str(Path(__file__).parent))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == plain
    assert result["errors"] > 0 and result["written"] == result["on_disk"] == 0
    assert result["loaded"] == 0  # nothing came back from a file that was never complete
    assert "File too large" in result["message"] or "0 of the last" in result["message"]


def test_a_save_that_fails_is_dropped_and_fails_no_request(monkeypatch, plain: list) -> None:
    from engines.builtin import model_runner

    real, calls = model_runner.read_blocks, []

    def flaky(caches: list, blocks: list[int]) -> list:
        calls.append(blocks)
        if len(calls) % 2:  # every other save fails
            raise RuntimeError("injected")
        return real(caches, blocks)

    monkeypatch.setattr(model_runner, "read_blocks", flaky)
    llm = LLM("tiny", dtype="float32", **POOL, kv_host_tier_bytes=1 << 20)
    tokens, _ = rounds(llm)
    store = llm.engine.kv.tiers
    assert tokens == plain  # no request failed, none read a block that was never saved
    assert len(calls) > 1 and store is not None
    assert all(entry.saved for entry in store.entries.values())
    assert store.host_blocks == sum(len(b) for b in calls[1::2])  # the saves that ran
    llm.engine.close()


def test_a_disk_tier_folder_that_cannot_be_made_is_a_clear_error(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("mine")
    with pytest.raises(ConfigError, match=r"engine\.kv_disk_tier_path"):
        LLM("tiny", **POOL, kv_disk_tier_bytes=1 << 20, kv_disk_tier_path=str(not_a_folder))
    assert not_a_folder.read_text() == "mine"


def test_the_disk_tier_keeps_to_its_own_folder(tmp_path: Path) -> None:
    mine = tmp_path / "keep.kv"
    mine.write_text("mine")
    llm = LLM("tiny", **POOL, kv_disk_tier_bytes=1 << 20, kv_disk_tier_path=str(tmp_path))
    rounds(llm, count=1)
    folder = llm.engine.kv.tiers.disk.path
    assert folder.parent == tmp_path and _written(llm)
    llm.engine.close()
    assert not folder.exists() and mine.read_text() == "mine"


def test_the_folder_goes_with_an_engine_never_closed(tmp_path: Path) -> None:
    llm = LLM("tiny", **POOL, kv_disk_tier_bytes=1 << 20, kv_disk_tier_path=str(tmp_path))
    rounds(llm, count=1)
    folder = llm.engine.kv.tiers.disk.path
    assert _written(llm)
    del llm
    gc.collect()
    assert not folder.exists()


FORKED = """
import os, sys
sys.path.insert(0, {tests!r})
from test_kv_tiers import LLM, POOL, rounds
llm = LLM("tiny", **POOL, kv_disk_tier_bytes=1 << 20, kv_disk_tier_path={parent!r})
rounds(llm, count=1)
folder = llm.engine.kv.tiers.disk.path
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal exit: atexit handlers and finalizers run in the child
os.waitpid(child, 0)
print(folder.exists())
"""


def test_a_forked_child_leaves_its_parents_folder_and_a_dead_ones_is_cleared(
    tmp_path: Path,
) -> None:
    dead = tmp_path / "inferlab-kv-999999999-0123abcd"  # no such process
    dead.mkdir()
    (dead / "0000000000000001.kv").write_bytes(b"x")
    mine = tmp_path / f"inferlab-kv-{os.getpid()}-0123abcd"  # a live process's
    mine.mkdir()
    script = FORKED.format(tests=str(Path(__file__).parent), parent=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"  # still there after the child's exit
    assert not dead.exists() and mine.exists()
    assert [p.name for p in tmp_path.iterdir()] == [mine.name]  # the parent's went at its exit


def test_per_request_tier_tokens_count_every_admission() -> None:
    """Preempted requests are readmitted and load again: the requests' figures add up to the
    engine's counters, and without tiers they are None, not 0."""

    def finished(**tiers: int) -> tuple[list[Finished], LLM]:
        llm = LLM("tiny", dtype="float32", **POOL, max_num_seqs=8, **tiers)
        engine = llm.engine
        events: list[Finished] = []
        for round_ in range(2):
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(f"{round_}-{i}", prompt, greedy(8))
            while engine.has_unfinished_requests():
                events += [e for e in engine.step() if isinstance(e, Finished)]
        return events, llm

    events, llm = finished(kv_host_tier_bytes=8 * BLOCK_BYTES, kv_disk_tier_bytes=1 << 20)
    hits = llm.engine.scheduler.prefix_tier_hits
    assert sum(e.num_preemptions for e in events) > 0
    for tier in ("host", "disk"):
        assert sum(getattr(e, f"cached_prompt_tokens_{tier}") for e in events) == hits[tier]
    assert sum(hits.values()) > 0
    gauges = llm.engine.gauges()
    assert gauges.kv_tier_hits == (hits["host"], hits["disk"])
    llm.engine.close()
    events, _ = finished()
    assert {(e.cached_prompt_tokens_host, e.cached_prompt_tokens_disk) for e in events} == {
        (None, None)
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(kv_cache="paged", kv_host_tier_bytes=1 << 20), "enable_prefix_caching=true"),
        (
            dict(**POOL, kv_disk_tier_bytes=1 << 20, tensor_parallel_size=2),
            "tensor_parallel_size=1",
        ),
        (dict(kv_host_tier_bytes=-1), "kv_host_tier_bytes"),
        (dict(**POOL, kv_disk_tier_path="/tmp"), "kv_disk_tier_path"),
        (dict(**POOL, kv_disk_tier_bytes=1 << 20, kv_disk_tier_path=" "), "kv_disk_tier_path"),
        (dict(**POOL, kv_host_tier_bytes=BLOCK_BYTES - 1), "holds no KV block"),
        (dict(**POOL, kv_host_tier_bytes=1 << 62), "more than this machine's memory"),
        (dict(**POOL, kv_disk_tier_bytes=1 << 62), "more than the free space"),
        (
            dict(**POOL, kv_disk_tier_bytes=1 << 20, kv_disk_tier_path="/no/such/folder"),
            "kv_disk_tier_path",
        ),
    ],
)
def test_tier_options_are_checked(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LLM("tiny", **options)


# ---- the store alone --------------------------------------------------------------------------


def _meta(key: int) -> CachedBlock:
    return CachedBlock(block_hash=key * 7, token_ids=(key,), parent=None, content_id=key)


def _payload(key: int) -> torch.Tensor:
    return torch.full((64,), key, dtype=torch.uint8)


def test_the_host_tier_keeps_its_limit_least_recently_used_first() -> None:
    store = KVTierStore(block_bytes=64, host_bytes=3 * 64, disk_bytes=0)
    for key in range(3):
        assert store.reserve(_meta(key))
        store.fill(key, _payload(key))
    assert store.claim(0) == "host"  # 0 is now the most recently used
    store.release(0)
    assert store.reserve(_meta(3))
    assert store.host_blocks == 4  # over until its bytes are saved
    store.fill(3, _payload(3))
    assert store.host_blocks == 3
    assert store.lookup(7, (1,), None) is None  # 1 was the least recently used
    assert store.lookup(0, (0,), None) == 0
    assert not store.reserve(_meta(0))  # held already: nothing to save
    assert store.counters.dropped_blocks == 1


def test_a_pinned_or_unsaved_block_never_leaves_the_host() -> None:
    store = KVTierStore(block_bytes=64, host_bytes=64, disk_bytes=0)
    store.reserve(_meta(0))
    store.fill(0, _payload(0))
    store.claim(0)  # a load is planned: pinned
    store.reserve(_meta(1))
    store.fill(1, _payload(1))
    # 0 was used longest ago, but its load has not run: the newer 1 went instead
    assert store.lookup(7, (1,), None) is None
    assert store.lookup(0, (0,), None) == 0 and torch.equal(store.payload(0), _payload(0))
    store.release(0)
    assert store.host_blocks == 1


def test_the_disk_tier_takes_what_the_host_lets_go_and_reads_it_back() -> None:
    store = KVTierStore(block_bytes=64, host_bytes=64, disk_bytes=2 * 64)
    for key in range(4):
        store.reserve(_meta(key))
        store.fill(key, _payload(key))
    assert store.disk is not None
    store.sync()
    assert store.host_blocks == 1 and store.disk_blocks == 2  # 0 went off the end of the disk
    assert store.lookup(0, (0,), None) is None
    assert store.claim(1) == "disk" and torch.equal(store.payload(1), _payload(1))
    assert store.counters.disk_read_bytes == 64
    store.release(1)
    store.close()
    assert not store.disk.path.exists()


def test_transfers_move_in_runs_that_never_name_a_block_twice() -> None:
    from engines.builtin.kv_cache.tiers import BlockTransfer
    from engines.builtin.model_runner import _runs_of_one_kind

    transfers = [
        BlockTransfer("save", 3, 10),
        BlockTransfer("save", 4, 11),
        BlockTransfer("load", 3, 12),
        BlockTransfer("load", 5, 13),
        BlockTransfer("load", 3, 14),  # 3 given back and loaded again: a run of its own
        BlockTransfer("save", 5, 13),
    ]
    runs = _runs_of_one_kind(transfers)
    assert [[(t.kind, t.block) for t in run] for run in runs] == [
        [("save", 3), ("save", 4)],
        [("load", 3), ("load", 5)],
        [("load", 3)],
        [("save", 5)],
    ]


def test_a_slow_disk_fills_the_write_buffer_and_no_more(monkeypatch) -> None:
    """Blocks waiting for their writes keep their host copies, up to the buffer: past it the
    host tier drops what it lets go instead of holding it."""
    import threading

    from engines.builtin.kv_cache import disk_tier, tiers

    gate = threading.Event()
    real = disk_tier._write_file

    def slow(*args: object) -> str | None:
        gate.wait()
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_tier, "_write_file", slow)
    monkeypatch.setattr(tiers, "WRITE_BUFFER_BYTES", 2 * 64)
    store = KVTierStore(block_bytes=64, host_bytes=0, disk_bytes=10 * 64)
    for key in range(5):
        store.reserve(_meta(key))
        store.fill(key, _payload(key))
    waiting = [k for k, e in store.entries.items() if e.payload is not None]
    assert len(waiting) == 2 and store.counters.dropped_blocks == 3
    gate.set()
    store.sync()
    assert store.disk_blocks == 2 and store.counters.disk_written_blocks == 2
    assert all(e.payload is None for e in store.entries.values())  # written: host copies gone
    store.close()


# ---- reads ahead (prefetch) -------------------------------------------------------------------


def _on_disk_only(keys: range, disk_blocks: int = 10) -> KVTierStore:
    """A store whose blocks `keys` are written to disk and held nowhere else."""
    store = KVTierStore(block_bytes=64, host_bytes=0, disk_bytes=disk_blocks * 64)
    for key in keys:
        store.reserve(_meta(key))
        store.fill(key, _payload(key))
    store.sync()
    assert all(store.entries[k].on_disk and store.entries[k].payload is None for k in keys)
    return store


def _gated_reads(monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[int]]:
    """The reader thread's reads wait for the returned event; the keys read are listed."""
    import threading

    from engines.builtin.kv_cache import disk_tier

    gate, read = threading.Event(), []
    real = disk_tier._read_file

    def gated(path: Path, key: int, nbytes: int) -> torch.Tensor:
        if threading.current_thread().name == "kv-disk-tier-reader":
            gate.wait()
        read.append(key)
        return real(path, key, nbytes)

    monkeypatch.setattr(disk_tier, "_read_file", gated)
    return gate, read


def test_blocks_read_ahead_are_claimed_without_a_read_on_the_loop() -> None:
    store = _on_disk_only(range(3))
    assert store.prefetch([0, 1, 2, 99]) == 3  # 99: no such block
    assert store.prefetch([0, 1, 2]) == 0  # under way: not read twice
    while store._reads_in_flight:
        store.sync()
    for key in range(3):
        assert store.claim(key) == "disk" and torch.equal(store.payload(key), _payload(key))
        store.release(key)
    counters = store.counters
    assert counters.prefetched_blocks == 3 and counters.disk_read_bytes == 0
    assert counters.loaded_blocks["disk"] == 3 and counters.prefetch_read_ns > 0
    store.close()


def test_a_claim_waits_for_a_read_under_way_and_reads_a_queued_one_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A claim never waits behind the whole queue of reads ahead: a block whose read has not
    started is read on the spot (that read called off); one under way is waited for."""
    import threading
    import time

    gate, read = _gated_reads(monkeypatch)
    store = _on_disk_only(range(3))
    assert store.disk is not None
    store.prefetch([0, 1, 2])
    while store.disk._reads.under_way is None:  # the reader holds 0 at the gate
        time.sleep(0.01)
    assert store.claim(2) == "disk" and torch.equal(store.payload(2), _payload(2))
    assert store.counters.disk_read_bytes == 64  # read here, at once
    threading.Timer(0.2, gate.set).start()  # type: ignore[attr-defined]
    assert store.claim(0) == "disk" and torch.equal(store.payload(0), _payload(0))
    assert store.counters.disk_read_bytes == 64 and store.counters.disk_read_ns >= 150e6
    while store._reads_in_flight:
        store.sync()
    assert sorted(read) == [0, 1, 2]  # each read once: 2 was called off on the reader
    assert store.counters.prefetched_blocks == 2  # 0, and 1 (left for a later claim)
    store.close()


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_file_read_ahead_is_found_when_claimed(damage: str) -> None:
    store = _on_disk_only(range(2))
    assert store.disk is not None
    file = store.disk.file(1)
    if damage == "delete":
        file.unlink()
    else:
        raw = bytearray(file.read_bytes())
        raw[-1] ^= 1
        file.write_bytes(bytes(raw))
    store.prefetch([0, 1])
    assert store.claim(0) == "disk"
    assert store.claim(1) is None  # read again on the loop, found damaged, dropped
    assert store.counters.corrupt_blocks == 1 and 1 not in store.entries
    store.close()


def test_reads_ahead_keep_to_their_budget_letting_the_oldest_go() -> None:
    store = _on_disk_only(range(5))
    store.max_prefetched = 2  # WRITE_BUFFER_BYTES' worth, in blocks
    assert store.prefetch([0, 1, 2]) == 2  # two in flight: the budget
    while store._reads_in_flight:
        store.sync()
    assert store.prefetch([2, 3]) == 2  # 0 and 1, unused, make room
    assert store.counters.prefetch_unused == 2
    assert store.entries[0].payload is None and store.entries[1].payload is None
    assert store.claim(0) == "disk"  # read again, on the loop
    assert store.counters.disk_read_bytes == 64
    store.close()


def test_no_reads_ahead_where_the_reader_does_not_answer() -> None:
    """A forked child has no reader thread: it reads at the match, and never waits."""
    store = _on_disk_only(range(3))
    assert store.disk is not None
    store.disk._reads.lock.acquire()  # held at the fork by the reader, which the child lacks
    store.entries[2].prefetching = True  # its read ahead was queued before the fork
    store.disk._pid = -1  # as seen from a child of the process that made it
    assert store.prefetch([0, 1]) == 0
    assert store.claim(0) == "disk" and store.claim(2) == "disk"
    assert store.counters.disk_read_bytes == 2 * 64
    store.disk._pid = os.getpid()
    store.disk._reads.lock.release()
    store.close()


def test_a_block_dropped_while_read_ahead_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    gate, read = _gated_reads(monkeypatch)
    store = _on_disk_only(range(2), disk_blocks=2)
    store.prefetch([0])
    for key in (2, 3):  # two newer blocks push 0 and 1 off the disk
        store.reserve(_meta(key))
        store.fill(key, _payload(key))
    store.sync()
    assert 0 not in store.entries
    gate.set()  # type: ignore[attr-defined]
    while store._reads_in_flight:
        store.sync()
    assert read == [0]  # its read ran (and failed: the file went), and was not kept
    assert store.counters.prefetched_blocks == 0 and 0 not in store.entries
    assert store.claim(2) == "disk" and torch.equal(store.payload(2), _payload(2))
    store.close()


@pytest.mark.parametrize("prefetch", [True, False])
def test_reads_ahead_give_the_recomputed_tokens(prefetch: bool, plain: list) -> None:
    """The second round's requests are stepped once their reads ahead are answered (as a
    request waiting in a queue would be): with them on, the step loop reads nothing."""
    llm = LLM("tiny", dtype="float32", **POOL, kv_disk_tier_bytes=1 << 20,
              kv_disk_tier_prefetch=prefetch)  # fmt: skip
    first, _ = rounds(llm, count=1)
    engine, store = llm.engine, llm.engine.kv.tiers
    assert store is not None
    steps: list[StepRecord] = []
    engine.step_observers.append(steps.append)
    second = []
    for i, prompt in enumerate(PROMPTS[::-1]):
        store.sync()  # the writes done: a block written after its request arrived is not read ahead
        engine.add_request(f"again{i}", prompt, greedy())
        while store._reads_in_flight:
            store.sync()
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for event in engine.step():
                tokens.extend(getattr(event, "token_ids", ()))
        second.append(tokens)
    assert first + second == plain and engine.kv.tier_loaded_tokens["disk"] > 0
    read_on_loop = sum(s.kv_disk_read_bytes for s in steps)
    assert (store.counters.prefetched_blocks > 0) == prefetch
    assert (read_on_loop == 0) == prefetch  # every disk hit was read ahead, or none was
    engine.close()
