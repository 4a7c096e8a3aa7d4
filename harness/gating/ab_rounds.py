"""A/B rounds on a Hydra launcher: `inferlab gate ab --launcher NAME` (docs/gate.md,
docs/scaling.md).

The gate writes its plan (ab_plan.json) and runs this Hydra app as a multirun, one job per
round (`round=0,...,R-1`), on the launcher named (joblib, ray, submitit_local, submitit_slurm),
with the launcher's own options. A round job claims one device slot (its cores, its GPUs;
harness/running/placement.py), starts its own worker process per side there, runs its
warm-up runs and then the round in the round's order, both sides on the same slot, so each
round stays paired; it writes round-<k>.json beside the run folders. The gate reads them all
and decides as it does for rounds run in turn. The A/B folder must be on a filesystem the
workers share (the run folders are written in place).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from harness.gating.ab import ABPlan, ABRunner, round_file
from harness.gating.rules import load_rules
from harness.run_folder import write_json_atomic
from harness.running import launching, placement


@dataclass
class RoundJobConfig:
    plan: str = MISSING  # the A/B folder's ab_plan.json
    round: int = 0


ConfigStore.instance().store(name="ab_round", node=RoundJobConfig)


def run_round(
    plan: ABPlan, configs: dict[str, dict[str, Any]], k: int, launcher_cfg: Any
) -> dict[str, Any]:
    """Round k in this job: its device slot, fresh workers, warm-ups, the round."""
    runner = ABRunner(plan, load_rules(), configs=configs)
    cores = launching.cores_per_job(launcher_cfg, len(placement.allowed_cores()), plan.rounds)
    gpus = launching.gpus_per_job(runner.configs["a"], placement.visible_gpus())
    name = launching.launcher_name(launcher_cfg)
    start = time.perf_counter()
    with placement.job_placement(name, cores, gpus) as where:
        result = {"placement": where.as_record(), **runner.run_one_round(k)}
    result["wall_s"] = time.perf_counter() - start
    write_json_atomic(round_file(plan.out, k), result)
    return result


@hydra.main(version_base="1.3", config_path=None, config_name="ab_round")
def main(cfg: DictConfig) -> None:
    written = json.loads(Path(cfg.plan).read_text())
    plan = ABPlan.from_json(written["plan"])
    run_round(plan, written["configs"], int(cfg.round), HydraConfig.get().launcher)


if __name__ == "__main__":
    sys.exit(main())
