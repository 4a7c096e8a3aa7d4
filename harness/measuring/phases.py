"""ITL spikes, attributed: which engine step made each inter-token gap long.

Each gap between consecutive output tokens of a request ends at the step that produced the
later token and spans the steps after the one that produced the earlier token. Its cause, in
this order (the first that holds):

- `preemption`: a step in the span preempted a sequence (the request itself, dropped and
  recomputed, or another one, when the KV cache was full);
- `prefill_in_step`: a step in the span computed prefill tokens (another request's prompt or
  chunk sharing the step, or recomputation: a no-cache engine recomputes every step);
- `decode`: only decodes ran.

For consecutive steps the span is just the producing step. The per-request phase columns
(tokenize_s, queue_s, prefill_s, decode_s, detokenize_s) are built by the driver
(harness/running/driver.py); this module explains the decode phase's outliers.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

CAUSES = ("decode", "prefill_in_step", "preemption")
SPIKE_QUANTILE = 99.0  # a spike: a gap at or above the pooled p99


def label_gaps(
    tokens: pd.DataFrame, steps: pd.DataFrame, request_ids: Iterable[str] | None = None
) -> pd.DataFrame:
    """One row per inter-token gap: request_id, index (the later token), prev_step, step,
    gap_s and cause (one of CAUSES, or `unknown` when a step of the span is not recorded)."""
    columns = ["request_id", "index", "prev_step", "step", "gap_s", "cause"]
    if request_ids is not None:
        tokens = tokens[tokens["request_id"].isin(set(request_ids))]
    if tokens.empty:
        return pd.DataFrame(columns=columns)
    ordered = tokens.sort_values(["request_id", "index"])
    by_request = ordered.groupby("request_id", sort=False)
    gaps = pd.DataFrame(
        {
            "request_id": ordered["request_id"],
            "index": ordered["index"],
            "prev_step": by_request["step"].shift(),
            "step": ordered["step"],
            "gap_s": by_request["time_s"].diff(),
        }
    ).dropna(subset=["gap_s"])
    gaps["prev_step"] = gaps["prev_step"].astype(int)
    # cumulative counts per step: a span (prev, step] holds cum[step] - cum[prev]
    table = steps.sort_values("step").set_index("step")
    preempted = table["num_preempted"].fillna(0).cumsum()
    prefilled = table["prefill_tokens"].fillna(0).cumsum()

    def in_span(cumulative: pd.Series) -> np.ndarray:
        end = cumulative.reindex(gaps["step"]).to_numpy(float)
        start = cumulative.reindex(gaps["prev_step"]).to_numpy(float)
        return end - start

    preempted_in, prefilled_in = in_span(preempted), in_span(prefilled)
    cause = np.where(
        preempted_in > 0, "preemption", np.where(prefilled_in > 0, "prefill_in_step", "decode")
    )
    cause = np.where(np.isnan(preempted_in) | np.isnan(prefilled_in), "unknown", cause)
    gaps["cause"] = cause
    return gaps[columns].reset_index(drop=True)


def itl_by_cause(
    tokens: pd.DataFrame, steps: pd.DataFrame, request_ids: Iterable[str]
) -> dict[str, float | None]:
    """Per cause: the ITL p99 of its gaps (`itl_p99_<cause>_s`) and its share of the spikes,
    the gaps at or above the pooled p99 (`itl_spike_share_<cause>`). Empty without steps."""
    needed = {"step", "prefill_tokens", "num_preempted"}
    if steps.empty or not needed <= set(steps.columns) or "step" not in tokens:
        return {}
    gaps = label_gaps(tokens, steps, request_ids)
    if gaps.empty:
        return {}
    values = gaps["gap_s"].to_numpy(float)
    spikes = gaps[values >= np.percentile(values, SPIKE_QUANTILE)]
    out: dict[str, float | None] = {}
    for cause in CAUSES:
        own = gaps.loc[gaps["cause"] == cause, "gap_s"].to_numpy(float)
        out[f"itl_p99_{cause}_s"] = float(np.percentile(own, 99)) if len(own) else None
        out[f"itl_spike_share_{cause}"] = float((spikes["cause"] == cause).mean())
    return out
