"""Speculative decoding's speed-ups in a sweep: each speculating variant against the variant
without speculation that shares its other swept settings (workload, concurrency, ...).

A variant's speculation is read from its run's config (`engine.speculative_config`), not from
its name, so any sweep that has both kinds of runs is paired: `experiment=speculative`, a
`variant=` list, or `engine.speculative_config=` swept by hand.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from harness.reporting.results import Results

SPEC_KEY = "engine.speculative_config"
# the columns of a speed-up row that are measured, not settings
MEASURED = (
    "mean_batch_size",
    "output_tok_per_s",
    "baseline_tok_per_s",
    "speedup",
    "tpot_speedup",
    "spec_acceptance_rate",
    "spec_mean_accepted_length",
)


def speculation(config: dict[str, Any]) -> str:
    """ "off", or every setting a run speculated with: the method, k, the lookup's suffix
    lengths or the draft model and its dtype / quantization."""
    spec = (config.get("engine") or {}).get("speculative_config")
    if not spec:
        return "off"
    label = f"{spec.get('method')} k={spec.get('num_speculative_tokens')}"
    if spec.get("method") == "ngram":
        lookup = f"{spec.get('prompt_lookup_max', 4)}..{spec.get('prompt_lookup_min', 2)}"
        return f"{label} lookup {lookup}"
    model = str(spec.get("model")).rsplit("/", 1)[-1]  # a checkpoint folder: its name
    extra = [str(spec[key]) for key in ("dtype", "quantization") if spec.get(key)]
    return f"{label} ({', '.join([model, *extra])})"


def _without_speculation(config: dict[str, Any]) -> str:
    """What a run would be without speculation: its engine and model settings but
    speculative_config, so a speculating variant pairs only with a baseline that differs
    from it in nothing else (not an int8 run beside a float32 one)."""
    engine = {k: v for k, v in (config.get("engine") or {}).items() if k != "speculative_config"}
    return json.dumps({"engine": engine, "model": config.get("model")}, sort_keys=True, default=str)


def load_axis(res: Results) -> str:
    """What the speed-up is plotted against: the swept concurrency, else the batch size."""
    swept = [k for k in res.swept if "concurrency" in k]
    return swept[0] if swept else "mean_batch_size"


def speedups(res: Results) -> pd.DataFrame:
    """One row per speculating variant that has a baseline: its settings, tokens/s and TPOT
    beside the baseline's, the two speed-ups, and its acceptance. Empty when the runs do not
    hold both kinds."""
    variants = res.variants
    if variants.empty or "output_tok_per_s" not in variants:
        return pd.DataFrame()
    first_run = res.runs.groupby("variant", sort=False)["run_id"].first()
    configs = [res.config(first_run[v]) for v in variants["variant"]]
    variants = variants.assign(
        speculation=[speculation(c) for c in configs],
        without_speculation=[_without_speculation(c) for c in configs],
    )
    context = [k for k in res.swept if k != "variant" and not k.startswith(SPEC_KEY)]
    rows = []
    for _, group in variants.groupby([*context, "without_speculation"], sort=False, dropna=False):
        base = group[(group["speculation"] == "off") & (group["status"] == "complete")]
        if base.empty:
            continue
        base = base.iloc[0]
        for _, row in group[group["speculation"] != "off"].iterrows():
            rows.append(
                {
                    "speculation": row["speculation"],
                    **{k: row[k] for k in context},
                    "mean_batch_size": row.get("mean_batch_size"),
                    "output_tok_per_s": row["output_tok_per_s"],
                    "baseline_tok_per_s": base["output_tok_per_s"],
                    "speedup": _ratio(row["output_tok_per_s"], base["output_tok_per_s"]),
                    "tpot_speedup": _ratio(base.get("tpot_p50_s"), row.get("tpot_p50_s")),
                    "spec_acceptance_rate": row.get("spec_acceptance_rate"),
                    "spec_mean_accepted_length": row.get("spec_mean_accepted_length"),
                }
            )
    table = pd.DataFrame(rows)
    return table.dropna(subset=["speedup"]) if len(table) else table


def stops_paying(table: pd.DataFrame, axis: str) -> pd.DataFrame:
    """Per speculation and other setting: the lowest load at which the speed-up in tokens/s
    falls below 1 (None: it pays at every load measured)."""
    series = [c for c in table.columns if c not in MEASURED and c != axis]
    rows = []
    for key, group in table.groupby(series, sort=False, dropna=False):
        values = key if isinstance(key, tuple) else (key,)
        group = group.sort_values(axis)
        losing = group[group["speedup"] < 1]
        rows.append(
            {
                **dict(zip(series, values, strict=True)),
                "loads_measured": ", ".join(f"{v:g}" for v in group[axis]),
                "speedup_below_1_from": f"{losing[axis].iloc[0]:g}" if len(losing) else None,
            }
        )
    return pd.DataFrame(rows)


def _ratio(numerator: Any, denominator: Any) -> float | None:
    try:
        a, b = float(numerator), float(denominator)
    except (TypeError, ValueError):
        return None
    return a / b if np.isfinite(a) and np.isfinite(b) and b > 0 else None
