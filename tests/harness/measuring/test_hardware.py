"""Hardware specs: datasheet files load and validate, the CPU probe measures and caches, `auto`
picks by device."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import configs
from engines.builtin import native
from harness.measuring import hardware, link_probe
from harness.measuring.comm import allreduce_seconds

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TINY_PROBE = {"probe_bytes": 1 << 20, "matmul_size": 64}
FAKE_LINK = {"link_bandwidth": 2e9, "link_latency": 5e-5, "link_probe": {"backend": "fake"}}


@pytest.fixture
def fake_link(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The CPU probe without its 2-process link probe (a real one runs in the link tests):
    fixed link figures; the list counts the calls."""
    calls: list[int] = []

    def fake() -> dict:
        calls.append(1)
        return dict(FAKE_LINK)

    monkeypatch.setattr(hardware, "probe_link", fake)
    return calls


def test_every_spec_file_loads_and_validates() -> None:
    assert hardware.allowed_names() == ["a100", "auto", "cpu", "h100", "h200", "l4"]
    specs = {spec.name: spec for spec in hardware.datasheet_specs()}
    assert sorted(specs) == ["a100", "h100", "h200", "l4"]
    for spec in specs.values():
        assert spec.source and spec.device_names
        assert spec.memory_bandwidth > 1e11
        for dtype in ("float32", "bfloat16", "float16", "int8"):
            assert spec.flops_for(dtype) is not None and spec.flops_for(dtype) > 1e12
        # dense tensor-core bf16 beats plain fp32 on every listed GPU
        assert spec.flops_for("torch.bfloat16") > spec.flops_for("float32")
    assert specs["h200"].memory_bandwidth == 4.8e12
    assert specs["h100"].flops_for("bfloat16") == 989.5e12


def test_specs_state_memory_and_the_link_one_direction_of_the_datasheet_figure() -> None:
    specs = {spec.name: spec for spec in hardware.datasheet_specs()}
    gib = 1 << 30
    memory = {name: spec.memory_bytes for name, spec in specs.items()}
    assert memory == {"h100": 80 * gib, "h200": 141 * gib, "a100": 80 * gib, "l4": 24 * gib}
    # NVLink 4 900 GB/s, NVLink 3 600 GB/s, PCIe Gen4 x16 64 GB/s: both directions together
    bandwidth = {name: spec.link_bandwidth for name, spec in specs.items()}
    assert bandwidth == {"h100": 450e9, "h200": 450e9, "a100": 300e9, "l4": 32e9}
    for spec in specs.values():
        assert spec.link_latency is not None and 0 < spec.link_latency < 1e-5  # a few us
        assert spec.to_dict()["link_bandwidth"] == spec.link_bandwidth  # recorded per run


def test_unknown_name_lists_the_allowed_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"hardware: 'tpu' is invalid; allowed: "
        r"a100\|auto\|cpu\|h100\|h200\|l4",
    ):
        hardware.validate_config("tpu")
    with pytest.raises(ValueError, match="allowed"):
        hardware.resolve({"name": None}, "cpu")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"memory_bandwidth": -1}, r"hardware\.memory_bandwidth: -1 is invalid"),
        ({"peak_flops": {"float32": "fast"}}, r"hardware\.peak_flops\.float32: 'fast' is invalid"),
        ({"peak_flops": []}, r"hardware\.peak_flops: expected a mapping"),
        ({"clock_ghz": 2.0}, r"unknown key\(s\) \['clock_ghz'\]"),
        (
            {"overlap": {"bfloat16": 1.5}},
            r"hardware\.overlap: .* allowed: a mapping dtype -> a number in \[0, 1\]",
        ),
        ({"link_bandwidth": 0}, r"hardware\.link_bandwidth: 0 is invalid; allowed: a number > 0"),
        ({"link_bandwidth": "fast"}, r"hardware\.link_bandwidth: 'fast' is invalid"),
        (
            {"link_latency": -1e-6},
            r"hardware\.link_latency: -1e-06 is invalid; allowed: a number >= 0",
        ),
        ({"link_latency": True}, r"hardware\.link_latency: True is invalid"),
        ({"memory_bytes": -5}, r"hardware\.memory_bytes: -5 is invalid; allowed: a number > 0"),
        ({"memory_bandwidth": float("inf")}, r"hardware\.memory_bandwidth: inf is invalid"),
    ],
)
def test_bad_spec_values_name_the_field(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hardware.validate_config({"name": "h100", **values})


def test_cpu_keys_are_checked() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['memory_bandwidth'\]"):
        hardware.validate_config({"name": "cpu", "memory_bandwidth": 1e9})
    with pytest.raises(ValueError, match="hardware=auto"):
        hardware.validate_config({"name": "auto", "reprobe": True})


@pytest.mark.parametrize(
    "values, message",
    [
        ({"reprobe": "false"}, r"hardware\.reprobe: 'false' is invalid; allowed: true\|false"),
        ({"probe_bytes": "big"}, r"hardware\.probe_bytes: 'big' is invalid; allowed: an integer"),
        (
            {"probe_bytes": 1024},
            r"hardware\.probe_bytes: 1024 is invalid; allowed: an integer "
            r">= 65536",
        ),
        ({"matmul_size": 8.5}, r"hardware\.matmul_size: 8\.5 is invalid"),
    ],
)
def test_cpu_values_are_checked_by_name(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hardware.validate_config({"name": "cpu", **values})
    assert (
        hardware.validate_config(
            {"name": "cpu", "reprobe": True, "probe_bytes": 1 << 20, "matmul_size": 64}
        )["reprobe"]
        is True
    )


def test_overrides_replace_datasheet_values() -> None:
    spec, note = hardware.resolve({"name": "l4", "memory_bandwidth": 2.5e11}, "cpu")
    assert note is None and spec is not None
    assert spec.memory_bandwidth == 2.5e11
    assert spec.flops_for("bfloat16") == 121.0e12  # the rest from the file
    spec, _ = hardware.resolve({"name": "h100", "link_bandwidth": 3.6e11, "link_latency": 0}, None)
    assert spec is not None and (spec.link_bandwidth, spec.link_latency) == (3.6e11, 0.0)
    # the link keys are optional: null leaves them unstated
    spec, _ = hardware.resolve({"name": "h100", "link_bandwidth": None}, None)
    assert spec is not None and spec.link_bandwidth is None and spec.link_latency == 1.1e-6


def test_gpu_names_match_exactly() -> None:
    assert hardware.match_gpu("NVIDIA H200").name == "h200"
    assert hardware.match_gpu("nvidia h100 80gb hbm3").name == "h100"
    assert hardware.match_gpu("NVIDIA L4").name == "l4"
    assert hardware.match_gpu("NVIDIA A100-SXM4-80GB").name == "a100"
    # other boards have other peaks: no silent mismatch
    for other in ("NVIDIA L40S", "NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-40GB"):
        assert hardware.match_gpu(other) is None


def test_auto_picks_by_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    spec, _ = hardware.resolve("auto", "cuda:0")
    assert spec is not None and spec.name == "h200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU 9000")
    spec, note = hardware.resolve("auto", "cuda")
    assert spec is None and "Some GPU 9000" in note
    spec, note = hardware.resolve(None, None)
    assert spec is None and "remote" in note
    probed: list[dict] = []

    def fake_cpu_spec(
        probe_bytes: int, matmul_size: int, reprobe: bool, cache_dir: Path | None
    ) -> hardware.HardwareSpec:
        probed.append({"probe_bytes": probe_bytes, "matmul_size": matmul_size})
        return hardware.HardwareSpec("cpu", 1e10, {"float32": 1e11})

    monkeypatch.setattr(hardware, "cpu_spec", fake_cpu_spec)
    spec, _ = hardware.resolve("auto", "cpu")
    assert spec is not None and spec.name == "cpu"
    assert probed == [{"probe_bytes": 256 << 20, "matmul_size": 1024}]  # cpu.yaml's settings


def test_cpu_probe_is_positive_finite_and_cached(tmp_path: Path, fake_link: list[int]) -> None:
    first = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    assert first.name == "cpu" and not first.details["from_cache"]
    values = [first.memory_bandwidth, *first.peak_flops.values()]
    assert sorted(first.peak_flops) == ["bfloat16", "float16", "float32"]
    assert all(math.isfinite(v) and v > 0 for v in values)
    assert sorted(first.overlap) == sorted(first.peak_flops)
    assert all(0.0 <= v <= 1.0 for v in first.overlap.values())
    cache_files = list(tmp_path.glob("*.json"))
    assert len(cache_files) == 1 and f"-{torch.get_num_threads()}t" in cache_files[0].name

    assert (first.link_bandwidth, first.link_latency) == (2e9, 5e-5)
    assert first.details["link_probe"] == {"backend": "fake"} and len(fake_link) == 1
    assert first.memory_bytes is not None and first.memory_bytes > 1 << 28  # this machine's RAM

    again = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    assert again.details["from_cache"] and len(fake_link) == 1  # the link cached with the rest
    assert again.memory_bandwidth == first.memory_bandwidth
    assert again.peak_flops == first.peak_flops and again.overlap == first.overlap
    assert (again.link_bandwidth, again.link_latency) == (2e9, 5e-5)

    assert not hardware.cpu_spec(**TINY_PROBE, reprobe=True, cache_dir=tmp_path).details[
        "from_cache"
    ]
    # other probe settings do not reuse a cached result
    other = hardware.cpu_spec(probe_bytes=2 << 20, matmul_size=64, cache_dir=tmp_path)
    assert not other.details["from_cache"]


def test_a_cache_from_an_older_probe_is_probed_again(tmp_path: Path, fake_link: list[int]) -> None:
    first = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    path = Path(first.details["cache_file"])
    cached = json.loads(path.read_text())
    del cached["settings"]["probe_version"], cached["measured"]["overlap"]
    path.write_text(json.dumps(cached))
    again = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    assert not again.details["from_cache"] and sorted(again.overlap) == sorted(first.overlap)
    # a version-4 cache (before the link was measured) is not read as a spec without a link
    cached = json.loads(path.read_text())
    cached["settings"]["probe_version"] = 4
    del cached["settings"]["link"], cached["measured"]["link_bandwidth"]
    del cached["measured"]["link_latency"], cached["measured"]["link_probe"]
    path.write_text(json.dumps(cached))
    calls = len(fake_link)
    again = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    assert not again.details["from_cache"] and len(fake_link) == calls + 1
    assert again.link_bandwidth == 2e9


def test_a_link_that_cannot_be_measured_leaves_its_keys_unset_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware, "probe_link", lambda: {"link_error": "no loopback"})
    spec = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    assert spec.link_bandwidth is None and spec.link_latency is None
    assert spec.details["link_error"] == "no loopback"
    assert spec.memory_bandwidth > 0  # the rest of the probe stands


# ---- the link probe: a real 2-process gloo all-reduce over loopback --------------------------


def test_the_link_probe_measures_a_gloo_allreduce_between_two_processes() -> None:
    measured = link_probe.probe_link()
    assert "link_error" not in measured, measured.get("link_error")
    raw = measured["link_probe"]
    assert raw["backend"] == "gloo" and raw["world_size"] == 2
    assert raw["sizes"] == list(link_probe.LINK_SIZES)
    assert all(math.isfinite(t) and 0 < t < 1.0 for t in raw["seconds"])
    # the largest message takes longer than the smallest: bytes cost time
    assert raw["seconds"][-1] > raw["seconds"][0]
    assert 1e6 < measured["link_bandwidth"] < 1e13  # bytes/s through loopback
    assert 0 <= measured["link_latency"] < 0.1
    # the fit is the ring model through the smallest message and the one with the largest
    # bus bandwidth: it reproduces both
    predict = [
        allreduce_seconds(b, 2, measured["link_bandwidth"], measured["link_latency"])
        for b in raw["sizes"]
    ]
    large = raw["busbw"].index(max(raw["busbw"]))
    assert raw["busbw"][large] == pytest.approx(raw["sizes"][large] / raw["seconds"][large])
    if raw["seconds"][large] > raw["seconds"][0]:
        assert predict[large] == pytest.approx(raw["seconds"][large])
    else:  # noise made the large message no slower: the bandwidth is its plain busbw
        assert measured["link_bandwidth"] == pytest.approx(raw["busbw"][large])
    if measured["link_latency"] > 0:  # else clipped at 0: the line passed below the origin
        assert predict[0] == pytest.approx(raw["seconds"][0])
    assert raw["probe_s"] < 30


def test_the_link_fit_inverts_the_ring_model() -> None:
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    for n, bandwidth, latency in [(2, 3e9, 2e-5), (4, 100e9, 1e-6)]:
        seconds = [allreduce_seconds(b, n, bandwidth, latency) for b in sizes]
        fitted = link_probe.fit_link(sizes, seconds, n)
        assert fitted["link_bandwidth"] == pytest.approx(bandwidth)
        assert fitted["link_latency"] == pytest.approx(latency)
    # noise that makes the large message no slower than the small: its plain busbw, and the
    # latency what is left of the small one's time
    fitted = link_probe.fit_link([4096, 1 << 20], [2e-4, 1e-4], 2)
    assert fitted["link_bandwidth"] == pytest.approx((1 << 20) / 1e-4)
    assert fitted["link_latency"] == pytest.approx((2e-4 - 4096 / fitted["link_bandwidth"]) / 2)
    with pytest.raises(ValueError, match="fit_link"):
        link_probe.fit_link([4096], [1e-4], 2)


def test_the_link_probe_reports_failures_instead_of_raising(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(link_probe.sys, "executable", "/bin/false")  # every rank exits 1
    assert link_probe.probe_link()["link_error"].startswith("rank 0 exited with 1")
    monkeypatch.setattr(link_probe.sys, "executable", "/no/such/python")
    assert "FileNotFoundError" in link_probe.probe_link()["link_error"]


@pytest.mark.parametrize(
    ("measured", "expected"), [(1.0, 1.0), (1.5, 0.5), (2.0, 0.0), (3.0, 0.0), (0.5, 1.0)]
)
def test_overlap_from_a_matmul_at_the_ridge(
    monkeypatch: pytest.MonkeyPatch, measured: float, expected: float
) -> None:
    # peak 2e9 FLOP/s and 1e9 B/s: ridge 2 FLOP/byte; m fp32 rows over a 4 MB weight (1024 x
    # 1024) do m/2 FLOP/byte -> 4 rows, so compute = 2*4*1024^2 / 2e9 s and memory =
    # 4*1024^2 / 1e9 s: equal.
    unit = 4 * 1024**2 / 1e9
    seen: list[tuple[int, ...]] = []

    def fake_best(fn: object, repeats: int, budget_s: float) -> float:
        seen.append(tuple(fn().shape))  # type: ignore[operator]
        return measured * unit

    monkeypatch.setattr(hardware, "_best_seconds", fake_best)
    overlap = hardware._overlap(torch.float32, 2e9, 1e9, 4 * 1024**2, repeats=1)
    # torch's plain GEMM, oneDNN's prepacked one and the engine's own, where each is built
    gemms = 1 + torch.backends.mkldnn.is_available() + (native.load() is not None)
    assert len(seen) == gemms and set(seen) == {(4, 1024)}
    assert overlap == pytest.approx(expected)


def test_probe_refuses_sizes_too_small_to_mean_anything() -> None:
    with pytest.raises(ValueError, match="probe_bytes"):
        hardware.probe_cpu(probe_bytes=16, matmul_size=64)


def test_hydra_group_composes() -> None:
    default = OmegaConf.to_container(configs.compose([]))
    h200 = OmegaConf.to_container(configs.compose(["hardware=h200"]))
    cpu = OmegaConf.to_container(configs.compose(["hardware=cpu", "hardware.reprobe=true"]))
    assert default["hardware"] == {"name": "auto", "cost_per_hour": None}
    assert hardware.validate_config(h200["hardware"])["name"] == "h200"
    assert hardware.spec_from_dict(h200["hardware"]).memory_bandwidth == 4.8e12
    assert hardware.validate_config(cpu["hardware"])["reprobe"] is True


@pytest.mark.parametrize("name", ["auto", "cpu", "h100"])
def test_cost_per_hour_overrides_every_spec_and_is_recorded(name: str) -> None:
    """hardware.cost_per_hour, declared once (HardwareCost), is set with no `+` whichever spec
    the config names, and the run's hardware facts carry it (the report's tokens per $)."""
    composed = OmegaConf.to_container(
        configs.compose([f"hardware={name}", "hardware.cost_per_hour=2.5"])
    )
    assert hardware.validate_config(composed["hardware"])["cost_per_hour"] == 2.5
    if name == "h100":
        spec, _ = hardware.resolve(composed["hardware"], None)
        assert hardware.describe_for_run(spec, None)["cost_per_hour"] == 2.5


@pytest.mark.parametrize("value", [-1, 0, "2", True, float("inf")])
def test_a_bad_cost_per_hour_names_the_key(value: object) -> None:
    """0 too: tokens per dollar at no price is no figure (the report drew no panel, silently)."""
    with pytest.raises(
        ValueError, match=r"^hardware\.cost_per_hour: .* is invalid; allowed: a number > 0"
    ):
        hardware.validate_config({"name": "h100", "cost_per_hour": value})
