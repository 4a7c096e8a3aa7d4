"""Shared fixtures for the built-in engine tests."""

from __future__ import annotations

import os

# Triton kernels run under its interpreter on CPU. Triton decides interpreter or compiler when
# a function is decorated, so the flag must be set before triton's first import: conftest is
# imported before any test module. On a GPU: INFERLAB_TRITON_DEVICE=cuda pytest ...
TRITON_DEVICE = os.environ.get("INFERLAB_TRITON_DEVICE", "cpu")
if TRITON_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import asyncio  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Literal  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import engines.backends  # noqa: E402, F401  (the config groups' schemas, for configs.compose)
import workloads  # noqa: E402, F401
from engines.builtin import LLM  # noqa: E402
from harness.running import config_schema  # noqa: E402, F401

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def make_tiny() -> Callable[..., LLM]:
    """A fresh `tiny`-preset engine (dummy weights, fp32, CPU) with small limits."""

    def make(**options: Any) -> LLM:
        defaults: dict[str, Any] = dict(
            dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8
        )
        return LLM(model="tiny", **{**defaults, **options})

    return make


@pytest.fixture(scope="module")
def tiny_llm() -> LLM:
    """One shared contiguous-KV `tiny` engine for tests that only run generate to completion."""
    return LLM(model="tiny", dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)


@pytest.fixture(autouse=True)
def _asyncio_default_loop_policy() -> Iterator[None]:
    """Importing guidellm installs uvloop's policy for the whole process, and uvloop's
    millisecond timers wake a sleep up to 1 ms early: the driver tests' send times then read
    early. Whatever a test installs is undone after it."""
    policy = asyncio.get_event_loop_policy()
    yield
    if asyncio.get_event_loop_policy() is not policy:
        asyncio.set_event_loop_policy(policy)


@pytest.fixture(scope="session", autouse=True)
def _single_torch_thread():
    """The test models are tiny: one intra-op thread is fastest, and it keeps OpenMP from
    spinning (orders of magnitude slower) when other work shares the CPU cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_rate_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real two-job `inferlab run -m` sweep on `tiny` (Poisson rates 100 and 400 req/s, so
    there is a steady-state window; a TTFT SLO, so goodput is reported), shared read-only by
    the results, report and gate tests: copy it before changing anything."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    overrides = [
        "model=tiny",
        "workload.num_requests=8",
        "workload.input_len=16",
        "workload.output_len=[4,12]",
        "run.warmup_requests=1",
        "workload.arrival.process=poisson",
        "workload.arrival.rate=100,400",
        "run.slo.ttft_s=0.5",
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "run",
            "-m",
            *overrides,
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return sweep_dir


@pytest.fixture(scope="session")
def smollm2_gguf() -> Iterator[Path]:
    """The real model the tests run (model=smollm2-135m): its GGUF file, installed by
    `make setup-real` (make test does it); absent, the test fails naming that target.

    While the session runs, the file is parsed once: gguf.GGUFReader reads every one of its
    ~100k vocabulary and merge strings into numpy views (~5 s, more on a busy machine) and each
    open repeated that (the config, the weights, the converters, transformers' loader). Every
    reader of this version of the file (path, size, modification time) gets the same read-only
    reader; any other file, or another mode, gets a fresh one."""
    import gguf

    from models.packaged import PackagedModelMissingError, packaged_model_path

    try:
        path = packaged_model_path("smollm2-135m")
    except PackagedModelMissingError as exc:
        pytest.fail(f"{exc} (make test installs it)")
    fresh_reader = gguf.GGUFReader
    parsed: dict[tuple[int, int], Any] = {}

    def reader(file: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> Any:
        if mode != "r" or Path(file).resolve() != path.resolve():
            return fresh_reader(file, mode)
        stat = path.stat()
        version = (stat.st_size, stat.st_mtime_ns)
        if version not in parsed:
            parsed.clear()
            parsed[version] = fresh_reader(file, mode)
        return parsed[version]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        yield path
