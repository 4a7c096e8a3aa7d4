"""The over-saturation detector on series made to order: a load the server sustains (noisy,
high, ramping up, with a burst, with TTFT drifting) never triggers; an overload triggers within
one window of the minimum duration, with its evidence."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from harness.running.saturation import SaturationConfig, SaturationDetector, fit

CONFIG = SaturationConfig()  # window 20 s, min duration 10 s
STEP = CONFIG.sample_interval_s


def first_verdict(
    in_flight: Callable[[float], float],
    ttft: Callable[[float], float],
    duration_s: float = 60.0,
    seed: int = 0,
    noise: float = 1.0,
    ttft_noise: float = 0.02,
    ttfts_per_s: float = 10.0,
) -> dict | None:
    """Feed the detector `duration_s` of samples (with Gaussian noise) and first tokens,
    asking after every sample as the driver does; the first evidence, else None."""
    rng = np.random.default_rng(seed)
    detector = SaturationDetector(CONFIG)
    next_ttft = 0.0
    for t in np.arange(STEP, duration_s, STEP):
        while next_ttft <= t:
            value = max(0.0, ttft(next_ttft) + rng.normal(0, ttft_noise))
            detector.first_token(next_ttft, value)
            next_ttft += 1 / ttfts_per_s
        level = max(0, round(in_flight(t) + rng.normal(0, noise)))
        detector.sample(float(t), level)
        evidence = detector.saturated(float(t))
        if evidence is not None:
            return evidence
    return None


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("name", "in_flight", "ttft"),
    [
        ("steady", lambda t: 6.0, lambda t: 0.2),
        ("high and noisy", lambda t: 60.0, lambda t: 1.0),
        # the load ramps up to a level the server sustains: in-flight rises, TTFT stays
        ("ramp at a sustainable load", lambda t: min(30.0, 1.0 + t), lambda t: 0.2),
        # longer prompts: TTFT drifts up, the queue does not grow
        ("TTFT drift alone", lambda t: 6.0, lambda t: 0.1 + 0.02 * t),
        # a burst queues for 2 s and drains
        (
            "a burst",
            lambda t: 6.0 + (20.0 if 30 <= t < 32 else 0.0),
            lambda t: 0.2 + (1.0 if 30 <= t < 33 else 0.0),
        ),
    ],
)
def test_a_load_the_server_sustains_never_triggers(
    name: str, in_flight: Callable, ttft: Callable, seed: int
) -> None:
    noise = 3.0 if name == "high and noisy" else 1.0
    assert first_verdict(in_flight, ttft, seed=seed, noise=noise) is None, name


@pytest.mark.parametrize("seed", range(5))
def test_an_overload_triggers_within_a_window_of_the_minimum_duration(seed: int) -> None:
    """Requests arrive 3/s faster than they finish: in-flight and TTFT grow without bound."""
    evidence = first_verdict(lambda t: 2.0 + 3.0 * t, lambda t: 0.1 + 0.3 * t, seed=seed)
    assert evidence is not None
    window = CONFIG.window_s
    # the first verdict may wait for the window to be three quarters full
    assert CONFIG.min_duration_s <= evidence["detected_at_s"] <= CONFIG.min_duration_s + window
    assert evidence["in_flight"]["slope"] == pytest.approx(3.0, rel=0.2)
    assert evidence["ttft_s"]["slope"] == pytest.approx(0.3, rel=0.2)
    halves = evidence["in_flight"]["halves"]
    assert all(half["t"] >= CONFIG.min_t for half in halves) and len(halves) == 2
    assert evidence["thresholds"]["min_t"] == CONFIG.min_t


def test_a_slow_overload_triggers_once_the_growth_is_large_enough() -> None:
    """0.5 request/s more than the server finishes, from a level of 10: the rise over a 20 s
    window (10) is more than a quarter of the level at the window's start."""
    evidence = first_verdict(lambda t: 10.0 + 0.5 * t, lambda t: 0.5 + 0.05 * t, noise=0.5)
    assert evidence is not None
    assert evidence["detected_at_s"] <= CONFIG.min_duration_s + CONFIG.window_s


def test_without_first_tokens_there_is_no_verdict() -> None:
    assert first_verdict(lambda t: 2.0 + 3.0 * t, lambda t: 0.1, ttfts_per_s=0.1) is None


def test_the_fit_and_its_t_statistic() -> None:
    line = fit([0.0, 1.0, 2.0, 3.0], [1.0, 3.0, 5.0, 7.0])
    assert line is not None
    assert (line.slope, line.start, line.end, line.t) == (2.0, 1.0, 7.0, float("inf"))
    assert fit([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None  # no spread in time
    assert fit([0.0, 1.0], [0.0, 1.0]) is None  # two points leave no error to judge by


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"window_s": 0}, r"^run\.saturation\.window_s: 0 is invalid; allowed: .*> 0"),
        ({"min_t": -1}, r"^run\.saturation\.min_t: -1 is invalid"),
        ({"bogus": 1}, r"^run\.saturation: unknown key\(s\) \['bogus'\]"),
    ],
)
def test_bad_thresholds_are_named(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SaturationConfig.from_dict(values)
