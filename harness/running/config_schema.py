"""The schema of the primary config (configs/config.yaml) besides its groups: `repeats`,
`profile`, `profiling` and the `run` section, made of the dataclasses that validate them. Stored
in Hydra's ConfigStore as `schema/experiment`, which config.yaml loads first (`optional`: a
composer that does not run experiments, `inferlab serve`, composes without it), so that their
defaults live once, in the dataclasses, and OmegaConf checks types at composition, naming the
key. The dataclasses' from_dict still check values and ranges, for callers without Hydra."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from configs.schema import schema_of
from harness.measuring.profiling import ProfileConfig
from harness.running.run_config import RunConfig

RunSchema = schema_of(RunConfig)
ProfileSchema = schema_of(ProfileConfig)


@dataclass
class ExperimentSchema:
    # filled by the config groups (each with a schema of its own)
    engine: Any = None
    model: Any = None
    workload: Any = None
    hardware: Any = None
    # N > 1: run this configuration N times, each in a fresh process, into repeat-0/ ...
    # repeat-<N-1>/; the folder's summary.json holds the median and spread (docs/run_folder.md)
    repeats: int = 1
    # torch.profiler over a window of engine steps -> profile/ (trace, top operators per
    # phase; docs/monitoring.md)
    profile: bool = False
    profiling: Any = field(default_factory=ProfileSchema)
    run: Any = field(default_factory=RunSchema)


def register_config_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="schema", name="experiment", node=ExperimentSchema)


register_config_schema()
