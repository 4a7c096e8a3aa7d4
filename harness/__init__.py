"""The harness: runs workloads against a backend, measures, gates and reports.

Sub-packages, lowest first: `run_folder` (the one module that knows a run folder's layout),
`measuring`, `running`, then `gating` and `reporting`; `cli` dispatches the `inferlab`
commands."""

import os
from pathlib import Path

# The checkout this harness is imported from: provenance asks git here, repeats and A/B
# workers import from here.
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def source_env() -> dict[str, str]:
    """This process's environment with SOURCE_ROOT first on PYTHONPATH: a child process
    imports this checkout, whatever else is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH")) if p)
    return env
