"""The Hydra config tree that `inferlab run`, `serve`, `kv-calc` and `ab` compose: `config.yaml`
and its groups. Each `engine` group extends its backend's schema, `<backend>_schema`, which
importing engines.registry puts in Hydra's ConfigStore (the backend's options dataclass: its
defaults and types live there once), and each `workload` group its type's, `<type>_schema`,
which importing workloads puts there (the workload dataclass); the YAML files hold presets."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent


def compose(overrides: Sequence[str], config_dir: Path = CONFIG_DIR) -> Any:
    """The composed config (a DictConfig) for these overrides, outside a Hydra app."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schemas()

    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
        return hydra_compose(config_name="config", overrides=list(overrides))


def register_schemas() -> None:
    """Put the groups' schemas in Hydra's ConfigStore: importing the modules that hold them
    registers them (imported here, not at the top, so that configs imports nothing of the
    project's; a Hydra app imports them itself, before Hydra composes)."""
    import engines.registry  # noqa: F401
    import workloads  # noqa: F401
