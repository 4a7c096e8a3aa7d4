"""`inferlab pd-plan`: each phase's predicted time from the roofline, the hand-off over each
link the preset states, and the xP+yD capacities, checked against the formulas by hand."""

from __future__ import annotations

import pytest

from harness.measuring import hardware, kv_calc
from harness.measuring.pd_plan import main, pd_plan
from models.location import resolve_model

H100 = hardware.spec_from_dict(hardware.load_spec_file("h100"))


def plan_for(prompt_len: int, output_len: int, gpus: int = 8) -> dict:
    context = prompt_len + output_len // 2
    report = kv_calc.kv_calc("llama3-8b", None, 8192, "bfloat16", spec=H100, context_len=context)
    return pd_plan(resolve_model("llama3-8b"), report, H100, prompt_len, output_len, gpus)


def test_phases_and_handoff_follow_the_roofline() -> None:
    plan = plan_for(2048, 256)
    cfg = resolve_model("llama3-8b")
    # a 2,048-token prefill of an 8B model is compute-bound: ~2 x params x tokens FLOPs
    flops = 2 * cfg.num_parameters() * 2048
    assert plan["prefill_s"] == pytest.approx(flops / H100.peak_flops["bfloat16"], rel=0.15)
    assert plan["prefill_compute_s"] > 3 * plan["prefill_memory_s"]
    # K/V: 2 x 32 layers x 8 heads x 128 x 2 B = 128 KiB a token
    assert plan["kv_bytes_per_prompt"] == 2048 * 128 * 1024
    assert H100.link_bandwidth and H100.pcie_bandwidth and H100.network_bandwidth
    for link, bandwidth in (
        ("nvlink", H100.link_bandwidth),
        ("pcie", H100.pcie_bandwidth),
        ("network", H100.network_bandwidth),
    ):
        assert plan["handoff_s"][link] == pytest.approx(plan["kv_bytes_per_prompt"] / bandwidth)
    assert plan["handoff_s"]["nvlink"] < plan["handoff_s"]["pcie"] < plan["handoff_s"]["network"]


def test_splits_take_the_slower_phase_and_follow_the_load() -> None:
    plan = plan_for(2048, 256)
    prefill, decode = plan["prefill_req_per_s"], plan["decode_req_per_s"]
    assert decode == pytest.approx(plan["decode_batch"] / (256 * plan["decode_step_s"]))
    for split in plan["splits"]:
        x, y = split["prefill_instances"], split["decode_instances"]
        assert x + y == 8
        assert split["req_per_s"] == pytest.approx(min(x * prefill, y * decode))
        ttft = plan["prefill_s"] + plan["handoff_s"]["nvlink"] + plan["decode_step_s"]
        assert split["ttft_s"]["nvlink"] == pytest.approx(ttft)
    colocated = 8 / (plan["prefill_s"] + 256 * plan["decode_step_s"] / plan["decode_batch"])
    assert plan["colocated_req_per_s"] == pytest.approx(colocated)
    # ITL: no prompt ever joins a decode step, where a colocated step may take in a whole one
    assert plan["colocated_itl_max_s"] > plan["decode_step_s"] + plan["prefill_s"] * 0.99

    def best(p: dict) -> int:
        return max(p["splits"], key=lambda s: s["req_per_s"])["prefill_instances"]

    # long prompts and short answers want prefill instances; short prompts and long answers
    # want decode instances
    assert best(plan_for(7680, 64)) > best(plan_for(256, 2048))


def test_the_cli_prints_the_table_and_refuses_bad_values(capsys: pytest.CaptureFixture) -> None:
    args = ["model=llama3-8b", "hardware=h100", "engine.dtype=bf16"]
    assert main([*args, "prompt_len=1024", "output_len=128", "gpus=4"]) == 0
    out = capsys.readouterr().out
    assert "3P+1D" in out and "colocated x4" in out and "nvlink" in out
    for bad, key in (
        ("gpus=1", "gpus"),
        ("prompt_len=0", "prompt_len"),
        ("output_len=lots", "output_len"),
        ("hardware=auto", "hardware"),
    ):
        assert main([*args, bad]) == 2
        assert f"error: {key}" in capsys.readouterr().err
    assert main(["model=llama3-70b", "hardware=h100", "engine.dtype=bf16"]) == 2
    assert "error: engine.tensor_parallel_size: 1 GPU(s)" in capsys.readouterr().err


def test_hardware_links_are_checked_by_name() -> None:
    values = {**hardware.load_spec_file("h100"), "pcie_bandwidth": -1}
    with pytest.raises(ValueError, match=r"hardware\.pcie_bandwidth: -1 is invalid"):
        hardware.spec_from_dict(values)
    cpu_like = {k: v for k, v in hardware.load_spec_file("l4").items() if "network" not in k}
    assert hardware.spec_from_dict(cpu_like).network_bandwidth is None
