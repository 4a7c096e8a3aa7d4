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
from harness.measuring import hardware

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TINY_PROBE = {"probe_bytes": 1 << 20, "matmul_size": 64}


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


def test_cpu_probe_is_positive_finite_and_cached(tmp_path: Path) -> None:
    first = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    assert first.name == "cpu" and not first.details["from_cache"]
    values = [first.memory_bandwidth, *first.peak_flops.values()]
    assert sorted(first.peak_flops) == ["bfloat16", "float16", "float32"]
    assert all(math.isfinite(v) and v > 0 for v in values)
    assert sorted(first.overlap) == sorted(first.peak_flops)
    assert all(0.0 <= v <= 1.0 for v in first.overlap.values())
    cache_files = list(tmp_path.glob("*.json"))
    assert len(cache_files) == 1 and f"-{torch.get_num_threads()}t" in cache_files[0].name

    again = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    assert again.details["from_cache"]
    assert again.memory_bandwidth == first.memory_bandwidth
    assert again.peak_flops == first.peak_flops and again.overlap == first.overlap

    assert not hardware.cpu_spec(**TINY_PROBE, reprobe=True, cache_dir=tmp_path).details[
        "from_cache"
    ]
    # other probe settings do not reuse a cached result
    other = hardware.cpu_spec(probe_bytes=2 << 20, matmul_size=64, cache_dir=tmp_path)
    assert not other.details["from_cache"]


def test_a_cache_from_an_older_probe_is_probed_again(tmp_path: Path) -> None:
    first = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    path = Path(first.details["cache_file"])
    cached = json.loads(path.read_text())
    del cached["settings"]["probe_version"], cached["measured"]["overlap"]
    path.write_text(json.dumps(cached))
    again = hardware.cpu_spec(**TINY_PROBE, cache_dir=tmp_path)
    assert not again.details["from_cache"] and sorted(again.overlap) == sorted(first.overlap)


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
    assert default["hardware"] == {"name": "auto"}
    assert hardware.validate_config(h200["hardware"])["name"] == "h200"
    assert hardware.spec_from_dict(h200["hardware"]).memory_bandwidth == 4.8e12
    assert hardware.validate_config(cpu["hardware"])["reprobe"] is True
