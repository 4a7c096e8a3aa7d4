"""Threads on a busy machine: OpenMP's threads sleep instead of spinning (set before torch
loads libgomp), the default thread count fits the CPUs this process may use, and provenance
records the threads each library ran with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engines.builtin import native
from engines.builtin import platform as plat
from harness.measuring import provenance

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[2]
SHOW_POLICY = "import engines.openmp, json; print(json.dumps(engines.openmp.wait_policy()))"


IMPORT_ENGINE = f"import engines.builtin; {SHOW_POLICY}"
#: name -> (code, environment) of each fresh interpreter the tests below read
INTERPRETERS: dict[str, tuple[str, dict[str, str]]] = {
    "default": (IMPORT_ENGINE, {}),
    "OMP_WAIT_POLICY=ACTIVE": (IMPORT_ENGINE, {"OMP_WAIT_POLICY": "ACTIVE"}),
    "GOMP_SPINCOUNT=1000": (IMPORT_ENGINE, {"GOMP_SPINCOUNT": "1000"}),
    "torch first": (f"import torch; {IMPORT_ENGINE}", {}),
}


@pytest.fixture(scope="module")
def interpreters() -> dict[str, subprocess.CompletedProcess[str]]:
    """Each of INTERPRETERS in a fresh interpreter (libgomp reads its variables once, when
    loaded), with OMP_DISPLAY_ENV=VERBOSE so that libgomp prints the settings it took; all
    started at once (each spends seconds importing torch)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        )
        for name, (code, env) in INTERPRETERS.items()
    }
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def python(
    interpreters: dict[str, subprocess.CompletedProcess[str]], name: str
) -> subprocess.CompletedProcess[str]:
    """The named interpreter's run, which must have succeeded."""
    result = interpreters[name]
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_openmp_threads_sleep_instead_of_spinning_by_default(interpreters) -> None:
    """libgomp's default spins 300,000 turns at every barrier, holding a core that a
    descheduled partner needs; a step runs hundreds of parallel regions."""
    result = python(interpreters, "default")
    assert "GOMP_SPINCOUNT = '0'" in result.stderr  # what libgomp itself took
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": None,
        "source": "inferlab default",
    }


def test_the_users_own_policy_is_kept(interpreters) -> None:
    result = python(interpreters, "OMP_WAIT_POLICY=ACTIVE")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["source"] == "environment"
    result = python(interpreters, "GOMP_SPINCOUNT=1000")
    assert "GOMP_SPINCOUNT = '1000'" in result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["OMP_WAIT_POLICY"] is None


def test_too_late_is_said_when_torch_came_first(interpreters) -> None:
    result = python(interpreters, "torch first")
    assert "GOMP_SPINCOUNT = '300000'" in result.stderr
    policy = json.loads(result.stdout.splitlines()[-1])
    assert policy["OMP_WAIT_POLICY"] is None and "torch imported first" in policy["source"]


@pytest.fixture
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_threads_fit_the_cpus_this_process_may_use(monkeypatch, keep_threads) -> None:
    torch.set_num_threads(2)
    monkeypatch.setattr(plat.os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(plat, "cgroup_cpu_quota", lambda: None)
    plat.Platform.create("cpu")
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    plat.Platform.create("cpu", num_threads=2)  # an explicit count is the user's
    assert torch.get_num_threads() == 2


def test_a_cgroup_cpu_quota_lowers_the_count(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert plat.cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert plat.cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu/cpu.cfs_quota_us").write_text("-1\n")  # v1: no quota
    (tmp_path / "cpu/cpu.cfs_period_us").write_text("100000\n")
    assert plat.cgroup_cpu_quota(tmp_path) is None
    monkeypatch.setattr(plat.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(plat, "cgroup_cpu_quota", lambda: 1.5)
    assert plat.available_cpus() == (2, "cgroup CPU quota 1.5")


def test_provenance_records_each_librarys_threads(tmp_path: Path, keep_threads) -> None:
    assert native.load() is not None, native.reason()
    record = provenance.collect({"engine": {}})
    threads = record["threads"]
    assert threads["torch_intra_op"] == torch.get_num_threads() == record["torch_num_threads"]
    assert threads["torch_inter_op"] == torch.get_num_interop_threads()
    assert threads["native_kernels"] == torch.get_num_threads()
    assert threads["omp_get_max_threads"] >= 1 and "mkl_get_max_threads" in threads
    assert threads["affinity"] == sorted(os.sched_getaffinity(0))
    assert threads["available_cpus"] == len(os.sched_getaffinity(0))
    assert set(threads["omp_wait_policy"]) == {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "source"}
    # written before the engine loads; updated once it has set its threads
    path = tmp_path / "provenance.json"
    path.write_text(json.dumps(record))
    torch.set_num_threads(1)
    provenance.record_threads(path)
    updated = json.loads(path.read_text())
    assert updated["torch_num_threads"] == updated["threads"]["torch_intra_op"] == 1
    assert updated["threads"]["native_kernels"] == 1
    assert updated["git_commit"] == record["git_commit"]
