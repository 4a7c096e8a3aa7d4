"""Arrival processes: when each of n requests (or sessions) arrives, in seconds from the start.

  {process: offline}                          all at 0 (the default)
  {process: poisson, rate: R}                 exponential gaps with mean 1/R
  {process: gamma, rate: R, burstiness: B}    gamma gaps, shape B, scale 1/(R*B) (vLLM's
                                              definition): mean gap 1/R, CV 1/sqrt(B);
                                              B = 1 is Poisson, B < 1 burstier, B > 1 smoother
  {process: constant, rate: R}                gaps of exactly 1/R
  {process: ramp, start_rate: A, end_rate: Z} deterministic gaps whose rate moves linearly
                                              from A (first gap) to Z (last gap)
  {process: closed, concurrency: C}           all at 0; the driver keeps C requests in flight

Every open-loop process (all but closed) also takes `max_concurrency: M` (default null, no
cap), as vLLM's `bench serve --request-rate R --max-concurrency M`: the times stay as drawn,
and the driver sends a request that arrives while M are in flight once one of them finishes
(harness/running/driver.py); the wait shows as its lateness (sent - arrival). A closed loop
refuses it: its concurrency already is the number in flight.

The first request always arrives at 0 and request i at the sum of the first i gaps, so n
requests span n - 1 gaps (vLLM's benchmark also sends its first request at once). For ramp,
gap i (i = 1 .. n-1, between requests i-1 and i) is 1 / r_i with
r_i = A + (Z - A) * (i - 1) / (n - 2), so the first gap is at A and the last at Z.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from workloads.common import (
    MAX_ARRIVAL_S,
    arrivals_too_late,
    check_choice,
    check_int,
    check_keys,
    check_number,
    invalid,
)

PROCESSES = ("offline", "poisson", "gamma", "constant", "ramp", "closed")
_CAP = "max_concurrency"
# each process's keys: `process`, then the ones it needs, then the optional cap
_KEYS = {
    "offline": ("process", _CAP),
    "poisson": ("process", "rate", _CAP),
    "gamma": ("process", "rate", "burstiness", _CAP),
    "constant": ("process", "rate", _CAP),
    "ramp": ("process", "start_rate", "end_rate", _CAP),
    "closed": ("process", "concurrency"),
}


@dataclass
class Arrival:
    """The `workload.arrival` config block: every process's keys, None where the process does
    not use them, so that `workload.arrival={process: poisson, rate: 8}` (a mapping merged
    into this block may not add keys) and `workload.arrival.rate=8` both work. Its defaults
    are the arrival default of every workload type (offline)."""

    process: str = "offline"
    rate: float | None = None
    burstiness: float | None = None
    start_rate: float | None = None
    end_rate: float | None = None
    concurrency: int | None = None
    max_concurrency: int | None = None


def default_arrival() -> dict[str, Any]:
    """A workload dataclass's default `arrival`: Arrival()'s keys as a mapping (Python callers
    pass the keys they use). The field's metadata names Arrival as its config schema:

        arrival: dict[str, Any] | None = field(
            default_factory=default_arrival, metadata={"schema": Arrival}
        )
    """
    return dataclasses.asdict(Arrival())


def parse_arrival(spec: Any) -> dict[str, Any]:
    """Validate an arrival spec (None means offline); return it with numbers normalized."""
    if spec is None:
        return {"process": "offline"}
    if not isinstance(spec, Mapping):
        raise invalid("arrival", spec, "a mapping with process: " + "|".join(PROCESSES))
    # unset keys: the config block (Arrival) lists every process's keys, None where unused
    spec = {key: value for key, value in spec.items() if value is not None}
    process = check_choice("arrival.process", spec.get("process", "offline"), PROCESSES)
    if process == "closed" and _CAP in spec:
        open_loops = "|".join(p for p in PROCESSES if p != "closed")
        raise invalid(
            f"arrival.{_CAP}",
            spec[_CAP],
            f"null with process closed (its concurrency already is the number in flight; "
            f"{_CAP} caps an open loop: process {open_loops})",
        )
    check_keys("arrival", spec, _KEYS[process], f"process {process}")
    out: dict[str, Any] = {"process": process}
    needed = [key for key in _KEYS[process][1:] if key != _CAP]
    for key in needed:
        if key not in spec:
            raise invalid(f"arrival.{key}", None, f"a value (process {process} needs {needed})")
        if key == "concurrency":
            out[key] = check_int("arrival.concurrency", spec[key], 1)
        else:  # rates and burstiness: positive, finite
            out[key] = check_number(f"arrival.{key}", spec[key], 0.0, strict=True)
    if _CAP in spec:  # optional: unset is no cap
        out[_CAP] = check_int(f"arrival.{_CAP}", spec[_CAP], 1)
    return out


def concurrency_of(spec: Any) -> int | None:
    """C for a closed loop, None for every open-loop process."""
    parsed = parse_arrival(spec)
    return parsed["concurrency"] if parsed["process"] == "closed" else None


def max_concurrency_of(spec: Any) -> int | None:
    """An open loop's cap on the requests in flight (None: no cap, or a closed loop)."""
    return parse_arrival(spec).get(_CAP)


def arrival_times(spec: Any, n: int, rng: np.random.Generator) -> np.ndarray:
    """n arrival times in seconds (ascending, the first at 0) for `spec`, drawn from `rng`."""
    s = parse_arrival(spec)
    process = s["process"]
    if n <= 0:
        return np.zeros(0)
    gaps = np.zeros(n - 1)
    if process == "poisson":
        gaps = rng.exponential(1.0 / s["rate"], size=n - 1)
    elif process == "gamma":
        shape = s["burstiness"]
        gaps = rng.gamma(shape, 1.0 / (s["rate"] * shape), size=n - 1)
    elif process == "constant":
        gaps = np.full(n - 1, 1.0 / s["rate"])
    elif process == "ramp":
        frac = np.arange(n - 1) / max(1, n - 2)
        gaps = 1.0 / (s["start_rate"] + (s["end_rate"] - s["start_rate"]) * frac)
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    late = arrivals_too_late(times)
    if late is not None:
        raise invalid(
            "arrival",
            spec,
            f"rates that bring all {n} requests within {MAX_ARRIVAL_S:.0e} s of the first "
            f"(request {late} would arrive {times[late]:.3g} s after it)",
        )
    return times
