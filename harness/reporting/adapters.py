"""Per-adapter figures of runs with LoRA traffic (workload.lora_adapters; docs/lora.md): for each
variant and each adapter (and the base model's requests beside them), the requests, their TTFT
and TPOT medians and their output tokens, from requests.parquet's `lora` column."""

from __future__ import annotations

import pandas as pd

from harness.measuring.metrics import per_request_latencies

BASE = "(base model)"


def adapter_table(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per (variant, adapter) of the completed requests in the measured window:
    requests, ttft_p50_s, tpot_p50_s, output_tokens. Empty when no request had an adapter."""
    if "lora" not in requests or not requests["lora"].notna().any():
        return pd.DataFrame()
    window = requests.get("in_window", pd.Series(True, index=requests.index))
    done = requests[(requests["status"] == "ok") & window.fillna(True).astype(bool)]
    latencies = per_request_latencies(done).set_index("request_id")
    frame = done.assign(
        adapter=done["lora"].fillna(BASE),
        ttft_s=done["request_id"].map(latencies["ttft_s"]).to_numpy(),
        tpot_s=done["request_id"].map(latencies["tpot_s"]).to_numpy(),
    )
    grouped = frame.groupby(["variant", "adapter"], sort=False)
    return pd.DataFrame(
        {
            "requests": grouped.size(),
            "ttft_p50_s": grouped["ttft_s"].median(),
            "tpot_p50_s": grouped["tpot_s"].median(),
            "output_tokens": grouped["output_tokens"].sum(),
        }
    ).reset_index()
