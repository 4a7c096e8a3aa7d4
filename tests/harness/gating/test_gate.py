"""The regression gate without timing: statistics on synthetic samples, rules validation,
folder reading and the markdown table on synthetic run folders, CLI argument checks, and the
planted-slowdown engine option."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from bounded_cli import run_inferlab

from engines.base import ConfigError
from engines.builtin.config import EngineConfig
from harness import cli
from harness.gating import cli as gate
from harness.gating.rules import RulesError, load_rules
from harness.gating.stats import BootstrapSettings, bootstrap_paired, bootstrap_ratio, decide

SETTINGS = BootstrapSettings(statistic="geomean", confidence=0.95, resamples=4000, seed=7)


def noisy(center: float, n: int, seed: int, cv: float = 0.02) -> list[float]:
    rng = np.random.default_rng(seed)
    return (center * np.exp(rng.normal(0.0, cv, n))).tolist()


# ---- statistics ----------------------------------------------------------------------------


def test_equal_distributions_pass() -> None:
    base, cand = noisy(100.0, 10, seed=1), noisy(100.0, 10, seed=2)
    estimate = bootstrap_ratio(base, cand, SETTINGS)
    assert 0.97 < estimate.ratio < 1.03
    assert estimate.low < estimate.ratio < estimate.high
    assert decide(estimate, "higher", 0.05, 5)[0] == "pass"
    assert decide(estimate, "lower", 0.05, 5)[0] == "pass"


@pytest.mark.parametrize("better, factor", [("higher", 0.8), ("lower", 1.2)])
def test_a_20_percent_shift_is_a_regression(better: str, factor: float) -> None:
    base, cand = noisy(100.0, 10, seed=3), noisy(100.0 * factor, 10, seed=4)
    estimate = bootstrap_ratio(base, cand, SETTINGS)
    assert estimate.ratio == pytest.approx(factor, rel=0.03)
    verdict, why = decide(estimate, better, 0.05, 5)  # type: ignore[arg-type]
    assert verdict == "regression", why
    # the same shift in the good direction is an improvement, never a regression
    mirrored = decide(estimate, "lower" if better == "higher" else "higher", 0.05, 5)
    assert mirrored[0] == "improved"


def test_paired_ratios() -> None:
    same = bootstrap_paired(noisy(1.0, 9, seed=5), SETTINGS)
    slower = bootstrap_paired(noisy(1.25, 9, seed=6), SETTINGS)
    assert same.paired and same.n_baseline == same.n_candidate == 9
    assert decide(same, "lower", 0.05, 5)[0] == "pass"
    assert decide(slower, "lower", 0.05, 5)[0] == "regression"
    # throughput falls by 1 / 1.25 when every step takes 25% longer
    fewer = bootstrap_paired([1 / r for r in noisy(1.25, 9, seed=6)], SETTINGS)
    assert decide(fewer, "higher", 0.05, 5)[0] == "regression"


def test_too_few_samples_are_inconclusive() -> None:
    # a 50% shift, but 3 runs per side under min_samples 5 cannot decide
    estimate = bootstrap_ratio(noisy(100, 3, seed=1), noisy(150, 3, seed=2), SETTINGS)
    verdict, why = decide(estimate, "lower", 0.05, 5)
    assert verdict == "inconclusive" and "min_samples 5" in why
    single = bootstrap_ratio([100.0], [150.0], SETTINGS)
    verdict, why = decide(single, "lower", 0.05, 2)
    assert verdict == "inconclusive" and "one run per side" in why


def test_noise_wider_than_the_effect_is_inconclusive() -> None:
    # 4% worse on average with 10% noise: the interval straddles the 5% threshold
    estimate = bootstrap_ratio(
        noisy(100, 8, seed=11, cv=0.10), noisy(104, 8, seed=12, cv=0.10), SETTINGS
    )
    assert estimate.low < 1.05 < estimate.high
    assert decide(estimate, "lower", 0.05, 5)[0] == "inconclusive"


def test_bootstrap_is_reproducible_with_a_seed() -> None:
    base, cand = noisy(100, 7, seed=1, cv=0.05), noisy(101, 7, seed=2, cv=0.05)
    first = bootstrap_ratio(base, cand, SETTINGS)
    assert bootstrap_ratio(base, cand, SETTINGS) == first
    other = bootstrap_ratio(base, cand, BootstrapSettings(resamples=4000, seed=8))
    assert other.ratio == first.ratio and (other.low, other.high) != (first.low, first.high)
    median = bootstrap_ratio(base, cand, BootstrapSettings(statistic="median", seed=7))
    assert median.ratio == pytest.approx(np.median(cand) / np.median(base))


def test_ratios_need_positive_values() -> None:
    with pytest.raises(ValueError, match="finite positive"):
        bootstrap_ratio([1.0, 0.0], [1.0, 1.0], SETTINGS)


# ---- rules ---------------------------------------------------------------------------------


def write_rules(tmp_path: Path, rules: Any) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return path


def test_default_rules() -> None:
    rules = load_rules()
    assert rules.min_effect == 0.10 and rules.min_samples == 5
    assert "output_tok_per_s" in rules.timing_metrics
    assert "prefill_tokens_total" in rules.deterministic_metrics
    assert rules.bootstrap.seed == 0 and rules.bootstrap.resamples == 10000


def test_a_rules_file_is_merged_over_the_defaults(tmp_path: Path) -> None:
    rules = load_rules(
        write_rules(
            tmp_path,
            {
                "timing": {"min_effect": 0.05},
                "metrics": {"timing": ["e2e_p99_s"], "exclude": ["num_steps"]},
                "per_metric": {"e2e_p99_s": {"min_effect": 0.2}},
            },
        )
    )
    assert rules.min_effect == 0.05 and rules.min_samples == 5
    assert rules.timing_metrics == ("e2e_p99_s",)
    assert "num_steps" not in rules.deterministic_metrics
    assert rules.min_effect_for("e2e_p99_s") == 0.2


@pytest.mark.parametrize(
    "rules, message",
    [
        ({"timing": {"min_efect": 0.1}}, r"rules\.timing: unknown key\(s\) \['min_efect'\]"),
        ({"colour": 1}, r"rules: unknown key\(s\) \['colour'\]"),
        ({"timing": {"min_effect": -0.1}}, r"rules\.timing\.min_effect: -0\.1 is invalid"),
        ({"timing": {"confidence": 1.5}}, r"rules\.timing\.confidence: 1\.5 is invalid"),
        ({"timing": {"statistic": "mean"}}, r"rules\.timing\.statistic: 'mean'.*geomean\|median"),
        ({"timing": {"min_samples": 1}}, r"rules\.timing\.min_samples: 1 is invalid"),
        ({"timing": {"resamples": "many"}}, r"rules\.timing\.resamples: 'many' is invalid"),
        ({"metrics": {"timing": ["tok_per_sec"]}}, r"rules\.metrics\.timing: unknown metric"),
        ({"metrics": {"timing": ["num_steps"]}}, r"'num_steps' is a deterministic metric"),
        ({"metrics": {"timing": ["duration_s"]}}, r"no better direction"),
        ({"deterministic": {"neutral_change": "ignore"}}, r"neutral_change.*regression\|warn"),
        ({"different_machine": "fail"}, r"rules\.different_machine: 'fail'.*warn\|inconclusive"),
        (
            {"per_metric": {"e2e_p99_s": {"min_effect": 0.2}}},
            r"per_metric\.e2e_p99_s.*does not gate",
        ),
        ({"per_metric": {"num_steps": {"min_effect": 0.2}}}, r"per_metric\.num_steps.*rel_tol"),
        ([1, 2], r"rules: .* must hold a mapping"),
    ],
)
def test_bad_rules_name_the_field(tmp_path: Path, rules: Any, message: str) -> None:
    with pytest.raises(RulesError, match=message):
        load_rules(write_rules(tmp_path, rules))


def test_a_missing_rules_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RulesError, match=r"--rules: .* is not a file"):
        load_rules(tmp_path / "nope.yaml")


def test_a_key_given_twice_in_the_rules_is_refused_naming_it(tmp_path: Path) -> None:
    """A rules file with `timing:` twice gated with the second block's min_effect (0.9: a
    90% slowdown passed), as YAML keeps the last; a CI rules file edited by two people is
    refused instead, naming the key and its line."""
    rules = tmp_path / "rules.yaml"
    rules.write_text("timing:\n  min_effect: 0.1\nper_metric: {}\ntiming:\n  min_effect: 0.9\n")
    with pytest.raises(RulesError) as exc:
        load_rules(rules)
    assert str(exc.value) == (
        f"--rules: {rules}: line 4: 'timing' is given twice; allowed: each key once"
    )
    rules.write_text("per_metric:\n  e2e_p99_s: {min_effect: 0.1, min_effect: 0.5}\n")
    with pytest.raises(RulesError, match=r"line 2: 'min_effect' is given twice"):
        load_rules(rules)
    # YAML's merge key is no key given twice: a block shared through an anchor still loads
    rules.write_text(
        "per_metric:\n  output_tok_per_s: &strict {min_effect: 0.02}\n  tpot_p50_s: {<<: *strict}\n"
    )
    assert load_rules(rules).per_metric["tpot_p50_s"] == {"min_effect": 0.02}


def test_a_rules_file_over_the_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rules file is read whole: one of gigabytes (a log given by mistake) was read into
    memory and parsed; it is refused by its size, naming the limit and how to raise it."""
    rules = write_rules(tmp_path, {"timing": {"min_effect": 0.05, "min_samples": 5}})
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "16")
    with pytest.raises(RulesError) as exc:
        load_rules(rules)
    assert str(exc.value) == (
        f"--rules: {rules}: {rules.stat().st_size} bytes is more than the 16 bytes allowed "
        "for a settings file; to read it, raise the limit with the environment variable "
        "INFERLAB_MAX_INPUT_BYTES (e.g. INFERLAB_MAX_INPUT_BYTES=8G)"
    )
    monkeypatch.delenv("INFERLAB_MAX_INPUT_BYTES")
    assert load_rules(rules).min_effect == 0.05


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda tmp: Path("/dev/zero"), "a character device"),
        (lambda tmp: (os.mkfifo(tmp / "rules.yaml"), tmp / "rules.yaml")[1], "a FIFO"),
    ],
    ids=["/dev/zero", "fifo"],
)
def test_a_device_or_fifo_as_rules_is_refused(
    tmp_path: Path, make: Callable[[Path], Path], kind: str
) -> None:
    run = make_run(tmp_path / "run", 100.0)
    rules = make(tmp_path)
    done = run_inferlab(
        "gate", "--baseline", str(run), "--candidate", str(run), "--rules", str(rules)
    )
    assert done.returncode == 2
    assert done.stderr == (
        f"inferlab gate: error: --rules: {rules}: is {kind}"
        + (" (named pipe)" if kind == "a FIFO" else "")
        + ", not a regular file\n"
    )


# ---- synthetic run folders -----------------------------------------------------------------

COUNTERS = {
    "num_steps": 40,
    "output_tokens_total": 320,
    "prefill_tokens_total": 768,
    "kv_bytes_reserved_peak": 4096,
    "num_failed": 0,
}


def make_run(
    path: Path, tok_per_s: float, status: str = "complete", host: str = "h1", **counters: Any
) -> Path:
    path.mkdir(parents=True)
    metrics = {
        **COUNTERS,
        **counters,
        "output_tok_per_s": tok_per_s,
        "tpot_p50_s": 1.0 / tok_per_s,
        "ttft_p50_s": 10.0 / tok_per_s,
    }
    (path / "summary.json").write_text(
        json.dumps(
            {
                "status": status,
                "error": "boom" if status == "failed" else None,
                "metrics": metrics if status != "failed" else {},
            }
        )
    )
    (path / "provenance.json").write_text(
        json.dumps(
            {
                "hostname_hash": host,
                "cpu": {"model": "cpu", "logical_cpus": 2},
                "gpu": None,
                "torch_num_threads": 1,
            }
        )
    )
    (path / "config.yaml").write_text(yaml.safe_dump({"engine": {"kv_cache": "contiguous"}}))
    return path


def make_repeats(path: Path, center: float, n: int, seed: int, **kwargs: Any) -> Path:
    for k, value in enumerate(noisy(center, n, seed)):
        make_run(path / f"repeat-{k}", value, **kwargs)
    (path / "summary.json").write_text(json.dumps({"status": "complete", "repeats": n}))
    return path


def run_gate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = gate.main(list(argv))
    return code, capsys.readouterr().out


def test_single_runs_gate_counters_but_not_timing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(tmp_path / "base", 100.0)
    make_run(tmp_path / "cand", 50.0)
    code, out = run_gate(
        capsys, "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")
    )
    assert code == 2  # halved throughput, but one run per side cannot be conclusive
    assert "INCONCLUSIVE (exit 2)" in out
    assert "| metric | baseline | candidate | ratio | CI | verdict |" in out
    assert "one run per side" in out and "| `output_tok_per_s` (tok/s) | 100 (n=1) |" in out
    assert "Equal on both sides (5 counters)" in out
    make_run(tmp_path / "worse", 100.0, prefill_tokens_total=900)
    code, out = run_gate(
        capsys,
        "--baseline",
        str(tmp_path / "base"),
        "--candidate",
        str(tmp_path / "worse"),
        "--all-rows",
    )
    assert code == 1
    assert "| `prefill_tokens_total` (tokens) | 768 | 900 | 1.172 | - | REGRESSION |" in out
    assert "| `num_steps` (count) | 40 | 40 | 1.000 | - | pass |" in out


def test_repeats_gate_timing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_repeats(tmp_path / "base", 100.0, 6, seed=1)
    make_repeats(tmp_path / "same", 100.0, 6, seed=2)
    make_repeats(tmp_path / "slow", 80.0, 6, seed=3)
    code, out = run_gate(
        capsys, "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "same")
    )
    assert code == 0, out
    json_path = tmp_path / "result.json"
    code, out = run_gate(
        capsys,
        "--baseline",
        str(tmp_path / "base"),
        "--candidate",
        str(tmp_path / "slow"),
        "--json",
        str(json_path),
    )
    assert code == 1
    result = json.loads(json_path.read_text())
    verdicts = {row["metric"]: row["verdict"] for row in result["rows"]}
    assert verdicts["output_tok_per_s"] == verdicts["tpot_p50_s"] == "regression"
    assert verdicts["num_steps"] == "pass"
    assert result["exit_code"] == 1 and not result["paired"]


def test_a_folder_of_runs_counts_as_repeats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for k, value in enumerate(noisy(100, 5, seed=1)):
        make_run(tmp_path / "base" / str(k), value)
    for k, value in enumerate(noisy(100, 5, seed=2)):
        make_run(tmp_path / "cand" / f"run-{k}", value)
    code, out = run_gate(
        capsys, "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")
    )
    assert code == 0, out
    assert "(n=5)" in out


def make_job(
    sweep: Path, num: int, overrides: list[str], tok_per_s: float, **counters: Any
) -> None:
    job = make_run(sweep / str(num), tok_per_s, **counters)
    (job / ".hydra").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))


def test_sweeps_match_jobs_by_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_job(tmp_path / "base", 0, ["engine.kv_cache=none"], 50.0, prefill_tokens_total=4000)
    make_job(tmp_path / "base", 1, ["engine.kv_cache=contiguous"], 100.0)
    make_job(tmp_path / "base", 2, ["engine.kv_cache=paged"], 100.0)
    # the candidate's jobs come in another order; its contiguous job got worse
    make_job(
        tmp_path / "cand", 0, ["engine.kv_cache=contiguous", "run.name=pr"], 100.0, num_steps=41
    )
    make_job(
        tmp_path / "cand",
        1,
        ["engine.kv_cache=none", "run.name=pr"],
        50.0,
        prefill_tokens_total=4000,
    )
    code, out = run_gate(
        capsys,
        "--baseline",
        str(tmp_path / "base"),
        "--candidate",
        str(tmp_path / "cand"),
        "--ignore-override",
        "run.name",
    )
    assert code == 1
    assert "| job | metric |" in out
    assert "| engine.kv_cache=contiguous | `num_steps` (count) | 40 | 41 |" in out
    assert "engine.kv_cache=none | `num_steps`" not in out  # equal, so collapsed
    assert "baseline job 2 (['engine.kv_cache=paged']) has no candidate job" in out
    code = gate.main(["--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")])
    assert code == 2  # without --ignore-override no job matches
    assert "no job of the baseline sweep matches" in capsys.readouterr().err


def test_sweeps_that_match_nowhere_name_the_overrides_that_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--ignore-override run.nmae` (a typo for run.name) ended in "no job of the baseline
    sweep matches a candidate job", naming neither the key that kept them apart nor the typo."""
    for side, name in (("base", "main"), ("cand", "pr")):
        for num, cache in enumerate(("none", "paged")):
            make_job(tmp_path / side, num, [f"engine.kv_cache={cache}", f"run.name={name}"], 50.0)
    argv = ["--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")]
    assert gate.main([*argv, "--ignore-override", "run.nmae"]) == 2
    err = capsys.readouterr().err
    assert "no job of the baseline sweep matches a candidate job by its overrides" in err
    assert "they differ in run.name (baseline main; candidate pr)" in err
    assert "--ignore-override run.nmae is no override of either sweep" in err
    assert err.count("\n") == 1


def test_a_resumed_sweep_matches_the_sweep_it_repeats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A job that `run.resume=true` ran again (a launcher lost it) records that override; the
    # job is still the same configuration, as sweep.csv and the report already treat it.
    make_job(tmp_path / "base", 0, ["engine.kv_cache=none"], 50.0)
    make_job(tmp_path / "base", 1, ["engine.kv_cache=paged"], 100.0)
    make_job(tmp_path / "cand", 0, ["engine.kv_cache=none"], 50.0)
    make_job(tmp_path / "cand", 1, ["engine.kv_cache=paged", "run.resume=True"], 100.0)
    make_job(tmp_path / "cand", 2, ["engine.kv_cache=contiguous", "run.progress=false"], 90.0)
    make_job(tmp_path / "base", 2, ["engine.kv_cache=contiguous"], 90.0)
    code, out = run_gate(
        capsys, "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")
    )
    assert code == 2, out  # matched; one run per side cannot decide timing
    assert "has no candidate job" not in out and "has no baseline job" not in out
    assert "one run per side" in out


def test_different_machines_are_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_repeats(tmp_path / "base", 100.0, 6, seed=1, host="h1")
    make_repeats(tmp_path / "cand", 100.0, 6, seed=2, host="h2")
    code, out = run_gate(
        capsys, "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")
    )
    assert code == 0
    assert "- warning: baseline and candidate ran on different machines" in out
    rules = write_rules(tmp_path, {"different_machine": "inconclusive"})
    code, out = run_gate(
        capsys,
        "--baseline",
        str(tmp_path / "base"),
        "--candidate",
        str(tmp_path / "cand"),
        "--rules",
        str(rules),
    )
    assert code == 2 and "different machines (rules.different_machine" in out


def test_a_failed_candidate_run_is_a_regression(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(tmp_path / "base", 100.0)
    make_run(tmp_path / "cand", 100.0, status="failed")
    code, out = run_gate(
        capsys, "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")
    )
    assert code == 1 and "candidate run(s) failed: boom" in out
    code, out = run_gate(
        capsys, "--baseline", str(tmp_path / "cand"), "--candidate", str(tmp_path / "base")
    )
    assert code == 2 and "no complete baseline run" in out


def test_a_neutral_counter_change_follows_the_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(tmp_path / "base", 100.0)
    make_run(tmp_path / "cand", 100.0, output_tokens_total=300)
    args = ["--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")]
    code, out = run_gate(capsys, *args)
    assert code == 1 and "CHANGED: the runs did different work" in out
    rules = write_rules(
        tmp_path, {"deterministic": {"neutral_change": "warn"}, "metrics": {"timing": []}}
    )
    code, out = run_gate(capsys, *args, "--rules", str(rules))
    assert code == 0 and "changed (not gating): warning only" in out


def test_bad_inputs_exit_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    make_run(tmp_path / "run", 100.0)
    code = gate.main(["--baseline", str(tmp_path / "empty"), "--candidate", str(tmp_path / "run")])
    assert code == 2 and "not a run folder" in capsys.readouterr().err
    rules = write_rules(tmp_path, {"timing": {"seed": -1}})
    code = gate.main(
        [
            "--baseline",
            str(tmp_path / "run"),
            "--candidate",
            str(tmp_path / "run"),
            "--rules",
            str(rules),
        ]
    )
    assert code == 2 and "rules.timing.seed: -1 is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        gate.main(["--baseline", str(tmp_path / "run")])
    assert exc.value.code == 2


def test_ab_refuses_few_rounds_and_a_used_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["gate", "ab", "--baseline", "", "--candidate", "engine.kv_cache=paged"]
    assert cli.main([*base, "--rounds", "3", "--out", str(tmp_path / "new")]) == 2
    assert "--rounds: 3 is fewer than 9" in capsys.readouterr().err
    make_run(tmp_path / "used", 1.0)
    assert cli.main([*base, "--out", str(tmp_path / "used")]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert (
        cli.main([*base, "--candidate", "engine.kv_cache=nope", "--out", str(tmp_path / "new")])
        == 2
    )
    assert "engine.kv_cache: 'nope' is invalid" in capsys.readouterr().err
    assert (
        cli.main([*base, "--candidate", "engine.colour=red", "--out", str(tmp_path / "new")]) == 2
    )
    assert "colour" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nothing is created before the checks pass


# ---- the planted slowdown ------------------------------------------------------------------


@pytest.mark.parametrize("value", [-0.1, "0.25", True])
def test_step_delay_is_validated(value: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"engine\.debug_step_delay_fraction: .* a finite number >= 0"
    ):
        EngineConfig(debug_step_delay_fraction=value)


def test_step_delay_spins_inside_the_step(make_tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import engines.builtin.planted_slowdown as slowdown_module
    from engines.sampling_params import SamplingParams

    real_wait = slowdown_module._busy_wait_until
    deadlines: list[float] = []

    def record(deadline_ns: float, now_ns: Any) -> int:
        deadlines.append(deadline_ns)
        return real_wait(deadline_ns, now_ns)

    monkeypatch.setattr(slowdown_module, "_busy_wait_until", record)
    llm = make_tiny(debug_step_delay_fraction=0.5)
    steps: list[Any] = []
    llm.engine.step_observers.append(steps.append)
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(deadlines) == len(steps) == 4
    for step, deadline in zip(steps, deadlines, strict=True):
        work_end = step.start_ns + (deadline - step.start_ns) / 1.5  # deadline: work + 0.5 work
        assert step.start_ns < work_end < deadline <= step.end_ns  # the wait is in the span
    deadlines.clear()
    make_tiny().generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert deadlines == []  # off by default


def test_a_variant_that_is_fast_but_wrong_fails_on_accuracy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """run.accuracy's score is a deterministic metric with direction higher: a candidate that
    loses an item of the task is a regression, one that gains one is not (issue 39)."""
    make_run(tmp_path / "base", 100.0, accuracy=0.4375, accuracy_items=16)
    make_run(tmp_path / "wrong", 100.0, accuracy=0.375, accuracy_items=16)
    make_run(tmp_path / "right", 100.0, accuracy=0.5, accuracy_items=16)
    code, out = run_gate(
        capsys, "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "wrong")
    )
    assert code == 1
    assert "| `accuracy` (fraction) | 0.4375 | 0.375 | 0.857 | - | REGRESSION |" in out
    code, out = run_gate(
        capsys, "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "right")
    )
    assert code != 1 and "REGRESSION" not in out
