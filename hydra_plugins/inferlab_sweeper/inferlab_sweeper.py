"""inferlab's Hydra sweeper (`hydra/sweeper=inferlab`, config.yaml's default): Hydra's basic
sweeper (the same grid, batches and job numbers) that keeps every job of a sweep whatever the
launcher does:

- before launching it writes the sweep folder's launch record (harness/running/launching.py);
- a job that ran where the sweep folder is not returns its run folder, written here;
- when the launcher gives up on a batch (a worker killed, out of memory, a node lost: joblib,
  Ray and submitit raise for the whole batch), the jobs still running on this host are waited
  for and every job without a final summary gets a failed one with the launcher's error, so it
  is a row of sweep.csv and resume (`run.resume=true`) runs it again. The other batches go on.
"""

# no `from __future__ import annotations`: Hydra imports plugins without registering them in
# sys.modules, where dataclasses look string annotations up
import logging
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf, open_dict

from harness.running import launching

log = logging.getLogger(__name__)


@dataclass
class InferlabSweeperConf:
    _target_: str = "hydra_plugins.inferlab_sweeper.inferlab_sweeper.InferlabSweeper"
    max_batch_size: Optional[int] = None  # noqa: UP045 (OmegaConf reads typing's Optional)
    params: Optional[dict[str, str]] = None  # noqa: UP045


ConfigStore.instance().store(
    group="hydra/sweeper", name="inferlab", node=InferlabSweeperConf, provider="inferlab"
)


class InferlabSweeper(BasicSweeper):
    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(
            parser.parse_overrides(params_conf), self.max_batch_size
        )
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        launching.write_launch_record(
            sweep_dir,
            launching.launcher_name(self.config.hydra.launcher),
            sum(len(batch) for batch in self.overrides),
        )
        returns: list[Any] = []
        initial_job_idx = 0
        while not self.is_done():
            batch = self.get_job_batch()
            self.validate_batch_is_legal(batch)
            try:
                results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            except Exception as exc:  # the launcher lost a job: record the batch's, go on
                error = " ".join("".join(traceback.format_exception_only(exc)).split())
                error = error if len(error) <= 400 else error[:400] + " ..."
                log.error(f"the launcher stopped on a batch: {error}")
                self._settle(batch, initial_job_idx, sweep_dir, error)
                results = []
            for result in results:
                self._gather(result, sweep_dir)
                if result.status == JobStatus.FAILED:  # the task raised: Hydra's behaviour
                    _ = result.return_value
            initial_job_idx += len(batch)
            returns.append(results)
        return returns

    def _job_dir(self, overrides: list[str], num: int, sweep_dir: Path) -> Path:
        assert self.hydra_context is not None and self.config is not None
        job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.num = num
        return sweep_dir / str(job_cfg.hydra.sweep.subdir)

    def _settle(self, batch: list[list[str]], first: int, sweep_dir: Path, error: str) -> None:
        dirs = [self._job_dir(o, first + i, sweep_dir) for i, o in enumerate(batch)]
        time.sleep(0.5)  # let a job that was ending finish its summary
        failed = launching.settle_jobs(dirs, error)
        for job_dir, overrides in zip(dirs, batch, strict=True):
            launching.write_job_overrides(job_dir, overrides)
        for job_dir in failed:
            log.error(f"job {job_dir.name}: failed ({error})")

    def _gather(self, result: JobReturn, sweep_dir: Path) -> None:
        if result.status != JobStatus.COMPLETED or not isinstance(result.return_value, dict):
            return
        archive = result.return_value.pop(launching.ARCHIVE_KEY, None)
        if archive is None:
            return
        if result.hydra_cfg is None:
            return
        subdir = str(result.hydra_cfg.hydra.sweep.subdir)
        launching.unpack_folder(archive, sweep_dir / subdir)
        log.info(f"job {subdir}: run folder gathered from its host")
