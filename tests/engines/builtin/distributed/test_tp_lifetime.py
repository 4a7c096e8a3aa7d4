"""A tensor-parallel LLM's lifetime in a process that goes on (a notebook, a script comparing
configurations): closed, left in a `with` block, dropped, or left open at exit, it ends its
workers cleanly and destroys the world it made, so the next LLM of the process starts.

Each scenario runs in a fresh Python: a world left behind would poison this test process for
every later tensor-parallel test (commit cb3a785)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

ROOT = Path(__file__).parents[4]

ONE_AFTER_ANOTHER = """
import gc, json, os
import torch.distributed as dist
from engines.base import ConfigError
from engines.builtin import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
OPTIONS = dict(model="tiny", tensor_parallel_size=2, num_threads=1)
facts = {}

def worker_of(llm):
    (worker,) = llm.engine.peers.processes
    return worker

# dropped (a notebook's `del llm`, or a cell run again)
llm = LLM(**OPTIONS)
first = worker_of(llm)
facts["tokens"] = llm.generate("hello there", GREEDY)[0].token_ids
del llm
gc.collect()
facts["dropped"] = [first.wait(timeout=30), dist.is_initialized()]

# a second, in a with block, while a third is refused by name while it is open
with LLM(**OPTIONS) as llm:
    second = worker_of(llm)
    facts["second_tokens"] = llm.generate("hello there", GREEDY)[0].token_ids
    try:
        LLM(**OPTIONS)
    except ConfigError as exc:
        facts["while_open"] = str(exc)
facts["with"] = [second.wait(timeout=30), dist.is_initialized()]

# closed twice, then one rank
llm = LLM(**OPTIONS)
third = worker_of(llm)
llm.close()
llm.close()
facts["closed"] = [third.wait(timeout=30), dist.is_initialized()]
facts["one_rank"] = LLM(model="tiny", num_threads=1).generate("hello there", GREEDY)[0].token_ids
print("FACTS", json.dumps(facts), flush=True)
"""


def run_script(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "script.py"
    path.write_text(script)
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout, whatever is installed
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_two_tensor_parallel_llms_one_after_the_other_in_one_process(tmp_path: Path) -> None:
    # the second used to be refused ("this process already has a torch.distributed world that
    # torchrun did not start"), and the first's worker printed a gloo traceback at exit
    done = run_script(ONE_AFTER_ANOTHER, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.split("FACTS ", 1)[1])
    assert facts["dropped"] == [0, False]  # the worker exited by itself; the world is gone
    assert facts["with"] == [0, False]
    assert facts["closed"] == [0, False]
    assert facts["second_tokens"] == facts["tokens"] == facts["one_rank"]
    assert facts["while_open"].startswith(
        "engine.tensor_parallel_size: 2, but another tensor-parallel engine of this process is "
        "still open"
    )
    close_it = "close it first: llm.close(), or build it in `with LLM(...) as llm:`"
    assert close_it in facts["while_open"]
    assert "Traceback" not in done.stderr and "failed" not in done.stderr, done.stderr[-3000:]


LEFT_OPEN = """
from engines.builtin import LLM
llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1)
(worker,) = llm.engine.peers.processes
print("WORKER", worker.pid, flush=True)
"""


def test_an_llm_left_open_at_exit_ends_its_worker_without_a_traceback(tmp_path: Path) -> None:
    done = run_script(LEFT_OPEN, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    pid = int(done.stdout.split("WORKER ", 1)[1].split()[0])
    deadline = time.monotonic() + 20
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)
    assert "Traceback" not in done.stderr and "failed" not in done.stderr, done.stderr[-3000:]


def alive(pid: int) -> bool:
    """Running (a zombie not yet reaped by its new parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_alive_tells_a_running_process_from_an_ended_one() -> None:
    assert alive(os.getpid())
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert not alive(ended.pid)
