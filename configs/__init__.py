"""The Hydra config tree that `inferlab run`, `serve`, `kv-calc` and `ab` compose: `config.yaml`
and its groups. Each `engine` group extends its backend's schema, `<backend>_schema`, and each
`workload` group its type's, `<type>_schema`: the options dataclasses, where defaults and types
live once; the YAML files hold presets. Importing `engines.registry` and `workloads` puts the
schemas in Hydra's ConfigStore; a composer imports them first (this package imports nothing
of the project's: the engines and workloads sit above it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent


class ComposeError(ValueError):
    """Overrides that do not compose: the message names the key (or group) and why."""


def compose(overrides: Sequence[str], config_dir: Path = CONFIG_DIR) -> Any:
    """The composed config (a DictConfig) for these overrides, outside a Hydra app. Raises
    ComposeError for an unknown key or group option, or a value of the wrong type."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
            return hydra_compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ComposeError(_reason(exc)) from exc


def _reason(exc: BaseException) -> str:
    """One line: `full_key: what is wrong` from OmegaConf's cause (an unknown key of a schema
    with the schema's keys), else Hydra's own words."""
    import dataclasses

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = exc.__cause__ or exc
    schema = getattr(cause, "object_type", None)
    unknown = isinstance(cause, ConfigAttributeError | ConfigKeyError)
    if unknown and dataclasses.is_dataclass(schema) and getattr(cause, "full_key", None):
        allowed = "|".join(sorted(f.name for f in dataclasses.fields(schema)))
        return f"{cause.full_key}: unknown key; allowed: {allowed}"  # type: ignore[attr-defined]
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    key = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None
    )
    if key and lines:
        return f"{key}: {lines[0]}"
    if "Available options" in str(exc):  # an unknown group option: list the known ones
        head, _, rest = str(exc).partition("Available options in")
        group, _, options = rest.partition(":")
        known = [o.strip() for o in options.split("Config search path")[0].split() if o.strip()]
        return f"{' '.join(head.split())} (allowed {group.strip()}: {'|'.join(known)})"
    return " ".join(str(exc).split())
