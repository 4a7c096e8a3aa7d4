"""The `make check-*` targets (scripts/README.md): each runs its script, and a script fails
(exit 1) exactly when its target is missed. The measurements themselves time the machine, so
they are not run here; what is checked is what does not depend on speed: that every target
runs a script that exists, and the verdict a script draws from given figures."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
TARGETS = {
    "check-roofline": "scripts/bench_roofline.py",
    "check-llamacpp-overhead": "scripts/bench_llamacpp_overhead.py",
    "check-server-ttft": "scripts/bench_server_ttft.py",
    "check-gate": "scripts/gate_validation.py",
}


def script(name: str) -> ModuleType:
    path = REPO / "scripts" / f"{name}.py"
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", TARGETS)
def test_each_check_target_runs_its_script(target: str) -> None:
    """`make -n` prints the commands without running them (nor the setup they depend on)."""
    done = subprocess.run(  # under `make test` a nested make would print its directory
        ["make", "--no-print-directory", "-n", target, "ARGS=--given-option"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert f"{TARGETS[target]} " in last and last.endswith("--given-option"), last
    assert (REPO / TARGETS[target]).is_file()


def test_server_ttft_fails_when_a_measured_gap_misses_5_ms() -> None:
    exit_status = script("bench_server_ttft").exit_status
    assert exit_status({"p50_delta_ms": 3.3, "p50_delta_raw_ms": -1.4}) == 0
    assert exit_status({"p50_delta_ms": 5.0, "loaded_p50_gap_ms": 1.9}) == 0
    assert exit_status({"p50_delta_ms": 3.3, "p50_delta_raw_ms": 5.2}) == 1
    assert exit_status({"loaded_p50_gap_ms": 279.6}) == 1  # part 2 alone (--skip-batch1)


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / f"{name}.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("name", "args", "named"),
    [
        ("bench_roofline", ["--batch-sizes", "1,x"], "--batch-sizes: '1,x' is invalid"),
        ("bench_roofline", ["--batch-sizes", "0"], "--batch-sizes: '0' is invalid"),
        ("bench_server_ttft", ["model=tinyy", "--requests", "2"], "model/tinyy"),
        ("bench_server_ttft", ["--requests", "0"], "--requests: '0' is invalid"),
        # nothing left to measure: it passed, exit 0, having checked nothing
        ("bench_server_ttft", ["--skip-batch1", "--background-streams", "0"], "nothing to measure"),
        ("bench_llamacpp_overhead", ["--requests", "2"], "--requests: 2 is fewer than"),
        ("gate_validation", ["--gates", "0"], "--gates: '0' is invalid"),
    ],
)
def test_a_bad_argument_exits_2_in_one_line_not_1_the_target_missed(
    name: str, args: list[str], named: str
) -> None:
    done = run_script(name, *args)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_roofline_run_the_configuration_refuses_exits_2(tmp_path: Path) -> None:
    roofline = script("bench_roofline")
    args = roofline.argparse.Namespace(
        model="tinyy",
        dtype="float32",
        prompt_len=8,
        decode_tokens=4,
        engine_option={},
        warmup_requests=0,
    )
    with pytest.raises(SystemExit) as stopped:
        roofline.run_batch(args, 1, 1, tmp_path)
    assert stopped.value.code == 2


def test_a_roofline_out_that_holds_results_is_refused_untouched(tmp_path: Path) -> None:
    """Before: a second check-roofline into the same --out replaced its run folders and
    bench_roofline.csv, leaving the first's other batch sizes beside them."""
    (tmp_path / "batch-2").mkdir()
    (tmp_path / "batch-2" / "summary.json").write_text('{"status": "complete"}')
    (tmp_path / "bench_roofline.csv").write_text("mine\n")
    done = run_script("bench_roofline", "--batch-sizes", "1", "--out", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert f"--out: {tmp_path} already holds" in done.stderr
    assert (tmp_path / "bench_roofline.csv").read_text() == "mine\n"
    assert not (tmp_path / "batch-1").exists()
