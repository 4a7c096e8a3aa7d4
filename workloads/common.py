"""Validation and small helpers shared by every workload type.

Every config error names the field the way the user wrote it on the command line
(`workload.<field>`, `workload.arrival.<field>`), says what was given and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import GenerationRequest, Prompt
from engines.sampling_params import SamplingParams
from models.files import check_regular_file
from workloads.request import WorkloadRequest

REPO_ROOT = Path(__file__).resolve().parents[1]


#: The latest a request may arrive, in seconds after the first: the driver schedules arrivals in
#: int64 nanoseconds, and a run decades long is a mistaken timestamp, rate or time_scale.
MAX_ARRIVAL_S = 1e9


def arrivals_too_late(arrivals: np.ndarray) -> int | None:
    """The index of the first arrival later than MAX_ARRIVAL_S (or not finite), else None."""
    late = np.flatnonzero(~(np.asarray(arrivals) <= MAX_ARRIVAL_S))
    return int(late[0]) if len(late) else None


def invalid(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"workload.{field}: {value!r} is invalid; allowed: {allowed}")


def is_int(value: Any) -> bool:
    # bool is an int subclass, but `true` as a length is always a config mistake.
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite number that float arithmetic can hold (an integer past float's range made
    float() raise OverflowError)."""
    if not (is_int(value) or isinstance(value, (float, np.floating))) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def check_int(field: str, value: Any, minimum: int = 0, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if not is_int(value) or value < minimum:
        extra = " or null" if allow_none else ""
        raise invalid(field, value, f"an integer >= {minimum}{extra}")
    return int(value)


def check_number(
    field: str, value: Any, minimum: float = 0.0, *, strict: bool = False, allow_none: bool = False
) -> float | None:
    """A finite number >= minimum (> minimum when strict)."""
    if value is None and allow_none:
        return None
    ok = is_number(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        extra = " or null" if allow_none else ""
        raise invalid(field, value, f"a number {'>' if strict else '>='} {minimum}{extra}")
    return float(value)


def check_bool(field: str, value: Any, allow_none: bool = False) -> bool | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise invalid(field, value, "true|false" + ("|null" if allow_none else ""))
    return value


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise invalid(field, value, "|".join(choices))
    return str(value)


def check_mapping(field: str, value: Any, allowed: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise invalid(field, value, allowed)
    return dict(value)


def check_keys(field: str, spec: Mapping[str, Any], known: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise ValueError(
            f"workload.{field}: unknown key(s) {unknown} for {what}; allowed: {sorted(known)}"
        )


def resolve_path(field: str, path: Any, section: str = "workload") -> Path:
    """A file path as given (relative to the working directory), else relative to the repo root;
    errors name `section.field`.

    The fallback lets configs name shipped files (`models/data/sonnets.txt`) whatever
    directory `inferlab run` was started from.
    """
    key = f"{section}.{field}"
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"{key}: {path!r} is invalid; allowed: a file path")
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if not p.is_absolute() and (REPO_ROOT / p).is_file():
        return REPO_ROOT / p
    if p.exists():  # a directory, a FIFO or a device: named, and never opened
        try:
            check_regular_file(p)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    raise FileNotFoundError(
        f"{key}: no file at {path} (looked in the working "
        f"directory {Path.cwd()} and the repository root {REPO_ROOT})"
    )


def make_sampling(
    max_tokens: int, temperature: float, ignore_eos: bool, extra: Mapping[str, Any]
) -> SamplingParams:
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(temperature),
        ignore_eos=ignore_eos,
        **dict(extra),
    )


def make_request(
    workload: Any,
    request_id: str,
    prompt: Prompt,
    prompt_tokens: int,
    output_len: int,
    arrival_s: float,
    *,
    prefix_group: str | None = None,
    session_id: str | None = None,
    turn: int = 0,
    follows: str | None = None,
) -> WorkloadRequest:
    """One WorkloadRequest with the workload's sampling settings and max_tokens=output_len."""
    sampling = make_sampling(
        output_len, workload.temperature, workload.ignore_eos, workload.sampling
    )
    request = GenerationRequest(
        request_id, prompt, sampling, prefix_group=prefix_group, session_id=session_id, turn=turn
    )
    return WorkloadRequest(request, float(arrival_s), int(prompt_tokens), follows)


def check_sampling_options(temperature: Any, ignore_eos: Any, sampling: Any) -> None:
    check_number("temperature", temperature)
    check_bool("ignore_eos", ignore_eos)
    extra = check_mapping("sampling", sampling, "a mapping of SamplingParams fields")
    clash = sorted({"max_tokens", "temperature", "ignore_eos"} & set(extra))
    if clash:
        raise invalid(
            "sampling", extra, f"SamplingParams fields other than {clash} (the workload sets those)"
        )
    try:  # let SamplingParams judge the rest, but report it under the workload's name
        make_sampling(1, float(temperature), bool(ignore_eos), extra)
    except (TypeError, ValueError) as exc:
        raise invalid("sampling", extra, f"valid SamplingParams fields ({exc})") from exc


def rng_streams(seed: int, n: int) -> list[np.random.Generator]:
    """Independent generators from one seed, one per purpose (lengths, prompts, arrivals).

    Separate streams keep, e.g., the prompts unchanged when only the arrival process changes.
    """
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(n)]


def span_info(arrivals: np.ndarray) -> dict[str, Any]:
    """Arrival span and offered rate: (n - 1) gaps over the span (the first arrives at 0)."""
    if len(arrivals) == 0:
        return {"arrival_span_s": 0.0, "offered_rate_rps": None}
    span = float(np.max(arrivals) - np.min(arrivals))
    rate = (len(arrivals) - 1) / span if span > 0 else None
    return {"arrival_span_s": span, "offered_rate_rps": rate}


def check_common(workload: Any) -> None:
    """The keys every workload type shares: seed, id_prefix, the sampling settings and
    cancellation."""
    check_int("seed", workload.seed, 0)
    if not isinstance(workload.id_prefix, str) or not workload.id_prefix:
        raise invalid("id_prefix", workload.id_prefix, "a non-empty string")
    check_sampling_options(workload.temperature, workload.ignore_eos, workload.sampling)
    check_cancellation(workload.cancel_fraction, workload.cancel_after_s)
    check_structured(workload.structured_fraction, workload.structured_kinds)
    check_bool("structured_enforce", workload.structured_enforce)
    check_lora(
        workload.lora_adapters,
        workload.lora_assignment,
        workload.lora_fraction,
        workload.lora_zipf_exponent,
    )


#: The constraint kinds a workload's structured requests draw from (data/structured/)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice")


def check_structured(fraction: Any, kinds: Any) -> None:
    if not is_number(fraction) or not 0 <= fraction <= 1:
        raise invalid(
            "structured_fraction", fraction, "a number in [0, 1] (0: no structured requests)"
        )
    if (
        not isinstance(kinds, list | tuple)
        or not kinds
        or not all(k in STRUCTURED_KINDS for k in kinds)
        or len(set(kinds)) != len(kinds)
    ):
        allowed = "|".join(STRUCTURED_KINDS)
        raise invalid("structured_kinds", kinds, f"a non-empty list of distinct {allowed}")


#: How a workload's LoRA adapters go to its requests (workloads/lora.py)
LORA_ASSIGNMENTS = ("round_robin", "random", "zipf")


def check_lora(adapters: Any, assignment: Any, fraction: Any, zipf_exponent: Any) -> None:
    if not isinstance(adapters, list | tuple) or not all(
        isinstance(a, str) and a for a in adapters
    ) or len(set(adapters)) != len(adapters):  # fmt: skip
        raise invalid("lora_adapters", adapters, "a list of distinct adapter names ([]: none)")
    if assignment not in LORA_ASSIGNMENTS:
        raise invalid("lora_assignment", assignment, "|".join(LORA_ASSIGNMENTS))
    if not is_number(fraction) or not 0 <= fraction <= 1:
        raise invalid("lora_fraction", fraction, "a number in [0, 1] (the rest: the base model)")
    if not is_number(zipf_exponent) or zipf_exponent <= 0:
        raise invalid("lora_zipf_exponent", zipf_exponent, "a number > 0")


def check_cancellation(fraction: Any, after_s: Any) -> None:
    if not is_number(fraction) or not 0 <= fraction <= 1:
        raise invalid("cancel_fraction", fraction, "a number in [0, 1] (0: none cancelled)")
    if after_s is None:
        if fraction > 0:
            raise invalid(
                "cancel_after_s",
                after_s,
                f"a number >= 0 (seconds after sending) when cancel_fraction={fraction} > 0",
            )
        return
    if not is_number(after_s) or after_s < 0:
        raise invalid("cancel_after_s", after_s, "a number >= 0 (seconds after sending) or null")


#: The seed stream that picks the cancelled requests: after the lengths, prompts and arrivals
#: streams (rng_streams(seed, 3)), so that cancelling changes none of those.
CANCEL_STREAM = 3


def plan_cancellation(
    requests: list[WorkloadRequest], fraction: float, after_s: float | None, seed: int
) -> dict[str, Any]:
    """Mark exactly round(fraction * n) of `requests`, drawn with `seed`, to be cancelled
    `after_s` seconds after each is sent (in place); the plan for the workload's `info`."""
    count = round(fraction * len(requests))
    if count and after_s is not None:
        rng = rng_streams(seed, CANCEL_STREAM + 1)[CANCEL_STREAM]
        for index in rng.choice(len(requests), size=count, replace=False):
            requests[int(index)].cancel_after_s = float(after_s)
    return {"cancel_planned": count, "cancel_after_s": after_s if count else None}


def length_totals(inputs: np.ndarray, outputs: np.ndarray) -> dict[str, Any]:
    n = len(inputs)
    return {
        "input_tokens_total": int(np.sum(inputs)),
        "output_tokens_total": int(np.sum(outputs)),
        "input_len_mean": float(np.mean(inputs)) if n else None,
        "output_len_mean": float(np.mean(outputs)) if n else None,
    }
