"""Tables an experiment's sweep writes beside sweep.csv, from sweep.csv's rows. The experiment's
preset names them (`hydra.callbacks.sweep_table.outputs`, e.g. configs/experiment/kv_speedup.yaml:
[kv_speedup]); each is registered here once, with the file it writes. The sweep writer
(harness/running/sweep.py) knows none of their columns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
from omegaconf import OmegaConf

from engines.builtin.kv_cache.sizing import KV_MANAGERS
from engines.registry import Registry
from harness.run_folder import KV_SPEEDUP_FILE

OUTPUTS_KEY = "hydra.callbacks.sweep_table.outputs"


@dataclass(frozen=True)
class SweepOutput:
    file: str  # beside sweep.csv
    make: Callable[[pd.DataFrame], pd.DataFrame | None]  # sweep.csv's rows -> it (None: none)


SWEEP_OUTPUTS = Registry[SweepOutput](OUTPUTS_KEY, listed=False)


def named_outputs(hydra_cfg: Any) -> list[str]:
    """The outputs the sweep's `hydra` config names (its sweep_table callback's `outputs`),
    each checked against the registry."""
    names = OmegaConf.select(hydra_cfg, "callbacks.sweep_table.outputs", default=None) or []
    return checked_outputs(names)


def checked_outputs(names: Sequence[str] | str) -> list[str]:
    """The names as a list: one name given without a list (`outputs=kv_speedup`) is that one,
    not its letters."""
    names = [names] if isinstance(names, str) else list(names)
    for name in names:
        SWEEP_OUTPUTS.get(name)  # an unknown name: a ValueError naming the key and the allowed
    return names


def _recomputes(kv_cache: object) -> bool:
    """Whether this engine.kv_cache value keeps no K/V (recomputes the context every step):
    the curve's baseline."""
    return kv_cache in KV_MANAGERS and not KV_MANAGERS.get(str(kv_cache)).manager.retains_kv


def kv_speedup_curve(frame: pd.DataFrame) -> pd.DataFrame | None:
    """experiment=kv_speedup: decode speed-up of a KV cache over recomputation, per context
    length: the TPOT of kv_cache=none over that of each cached variant, when the sweep varies
    both."""
    needed = {"engine.kv_cache", "workload.input_len", "tpot_p50_s"}
    if not needed <= set(frame.columns):
        return None
    baselines = [v for v in set(frame["engine.kv_cache"]) if _recomputes(v)]
    if len(baselines) != 1:
        return None
    (baseline,) = baselines
    done = frame[frame["status"] == "complete"]
    # a curve needs one context length per job; a swept range or distribution has none
    if not all(isinstance(v, int | float) for v in done["workload.input_len"]):
        return None
    table = done.pivot_table(
        index="workload.input_len", columns="engine.kv_cache", values="tpot_p50_s"
    )
    curve = pd.DataFrame({"context_len": table.index})
    for variant in table.columns:
        curve[f"tpot_p50_s_{variant}"] = table[variant].to_numpy()
        if variant != baseline:
            curve[f"speedup_{variant}"] = (table[baseline] / table[variant]).to_numpy()
    return curve


SWEEP_OUTPUTS.add("kv_speedup", SweepOutput(KV_SPEEDUP_FILE, kv_speedup_curve))
