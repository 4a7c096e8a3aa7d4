"""An engine copied into a child by os.fork() (hostile pass, issue 36): libgomp's threads are
not copied, so a step on more than one thread waited for ever in the child (in the decode
program's team barrier, or in torch's own regions). Now generate() fails at once, saying why
and what works; on one thread the child generates the parent's tokens."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch

from engines.builtin import LLM, SamplingParams
from engines.builtin.engine import EngineForkedError

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
PROMPTS = [[5] * 150, [3], [9] * 40]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY)]


def forked(action: Callable[[], str]) -> str:
    """What `action` said in a child made by os.fork(), or the error's type and message (a
    child still running after 60 s is killed: "hung")."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and never return into pytest
        os.close(read)
        try:
            said = action()
        except BaseException as exc:
            said = f"{type(exc).__name__}: {exc}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read)
            return "hung"
        time.sleep(0.05)
    with os.fdopen(read) as pipe:
        return pipe.read()


def in_child(llm: LLM, threads: int | None) -> str:
    """What generate() in a forked child did (forked()), on `threads` if given."""

    def generate() -> str:
        if threads is not None:
            torch.set_num_threads(threads)
        return repr(tokens(llm))

    return forked(generate)


@pytest.mark.parametrize("policy", ["auto", "passive"])
def test_a_forked_copy_of_an_engine_fails_clearly_instead_of_hanging(policy: str) -> None:
    llm = LLM(
        model="tiny",
        dtype="float32",
        num_threads=2,
        cpu_wait_policy=policy,
        quantization="int4",
        max_model_len=256,
        max_num_seqs=4,
    )
    expected = tokens(llm)
    said = in_child(llm, threads=None)
    assert said.startswith("EngineForkedError: this engine was built in process"), said
    assert "torch.set_num_threads(1)" in said and "'spawn'" in said
    assert in_child(llm, threads=1) == repr(expected)  # the way out it names works
    assert tokens(llm) == expected  # and the parent is untouched
    torch.set_num_threads(2)


def test_a_new_engine_in_a_forked_copy_fails_clearly_instead_of_hanging() -> None:
    """The parent's engines started OpenMP's threads: a new engine built in the child on 2
    threads would wait for them for ever (hostile pass, issue 36); on 1 thread it works."""
    LLM(model="tiny", dtype="float32", num_threads=2, max_model_len=64).generate([[3]], GREEDY)

    def build() -> str:
        try:
            LLM(model="tiny", dtype="float32", num_threads=2, max_model_len=64)
            said = "built"
        except EngineForkedError as exc:
            said = f"EngineForkedError: {exc}"
        child = LLM(model="tiny", dtype="float32", num_threads=1, max_model_len=64)
        return said + f" | one thread: {len(child.generate([[3]], GREEDY)[0].token_ids)} tokens"

    said = forked(build)
    torch.set_num_threads(2)
    assert said.startswith("EngineForkedError: an engine ran in process"), said
    assert said.endswith("| one thread: 8 tokens"), said


def test_the_engine_it_was_built_in_is_not_refused() -> None:
    llm = LLM(model="tiny", dtype="float32", num_threads=2, max_model_len=64)
    llm.engine.ensure_open()
    with pytest.raises(EngineForkedError):
        llm.engine.pid += 1  # as in a child: another process than the one that built it
        llm.engine.ensure_open()
