"""`inferlab run`: the Hydra application. Composes engine / model / workload config groups,
runs one experiment per job, and (with -m) writes sweep.csv at the sweep root."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from harness.experiment import run_experiment
from harness.sweep import write_sweep_csv
from harness.table import summary_table

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def _run(cfg: DictConfig) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    progress = cfg.run.get("progress", True) and sys.stderr.isatty()
    summary = run_experiment(config, run_dir, progress=progress)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    label = f"job {hydra_cfg.job.num}: " if multirun else ""
    print(f"{label}{summary['status']} -> {run_dir}")
    if summary["metrics"]:
        print(summary_table(summary["metrics"]))
    if summary["status"] == "failed":
        print(f"error: {summary['error']}", file=sys.stderr)
        if not multirun:  # a sweep records the failed job and goes on
            raise SystemExit(1)
    if summary["status"] == "incomplete":  # Ctrl-C or SIGTERM stops a sweep too
        if multirun:
            write_sweep_csv(Path(hydra_cfg.sweep.dir))
        raise SystemExit(130)
    return summary


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    _run(cfg)


if __name__ == "__main__":
    main()
