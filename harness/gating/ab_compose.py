"""Compose one side's run configuration in that side's checkout: `python -c <this file's
source> CODE_DIR OVERRIDES_JSON` prints the composed configuration as one JSON object, or
{"error": "..."} (exit 0 either way; another exit status is a crash).

The `engine`, `model` and `workload` groups' schemas are the checkout's own dataclasses
(registered in Hydra's ConfigStore when its modules are imported), so a checkout whose engine
has another set of options must compose in a process of its own: composed with the gate's
schemas, a baseline from before an option was added would get that option and refuse it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

#: Modules whose import registers the groups' schemas, under their names in any checkout
#: (engines/registry.py held the backends before engines/backends.py did).
SCHEMA_MODULES = (
    ("engines.backends", "engines.registry"),
    ("workloads",),
    ("harness.running.config_schema",),
)


def main(argv: list[str]) -> int:
    code, overrides = os.path.abspath(argv[0]), json.loads(argv[1])
    sys.path[:] = [code, *(p for p in sys.path if p not in ("", os.getcwd(), code))]
    for names in SCHEMA_MODULES:
        name = next((n for n in names if _in_checkout(code, n)), None)
        if name is not None:
            importlib.import_module(name)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import configs

    try:
        cfg = configs.compose(overrides, Path(code) / "configs")
        reply = {"config": OmegaConf.to_container(cfg, resolve=True)}
    except (configs.ComposeError, OmegaConfBaseException) as exc:
        reply = {"error": str(exc)}
    sys.stdout.write(json.dumps(reply) + "\n")
    return 0


def _in_checkout(code: str, module: str) -> bool:
    """Decided by the checkout's files, not by trying the import (an installed inferlab's
    finder would serve a module the checkout lacks)."""
    path = os.path.join(code, *module.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
