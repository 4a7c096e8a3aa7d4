"""OpenMP's wait policy, chosen before torch loads its OpenMP runtime.

torch's operators, MKL, oneDNN and the engine's C kernels share one OpenMP pool (torch's
libgomp). By default libgomp's threads spin for a while (GOMP_SPINCOUNT, 300,000 turns) at
the end of every parallel region before they sleep. On a busy machine a spinning thread holds
a core that the thread it waits for needs, and a decode step runs hundreds of regions: there
a 16-token request took 2.1-3.3x as long with the default as with OMP_WAIT_POLICY=PASSIVE
(threads sleep at once), which on an idle machine costs 4-17% at 8 requests at once and
nothing measurable at one (docs/engine_options.md, "Threads"). So inferlab sets PASSIVE
unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT.

libgomp reads the variable once, when it is loaded; this module must run before anything
imports torch (engines/__init__.py runs it). If torch came first, it is too late, and
`wait_policy()` says so for provenance.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_WAIT_POLICY = "PASSIVE"
_decision: dict[str, str | None] = {}


def _libgomp_loaded() -> bool:
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return "torch" in sys.modules


def choose_wait_policy() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE for this process and its children, unless the user chose a
    policy or it is too late to matter; remember which (once per process)."""
    if _decision:
        return
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        source = "environment"
    elif _libgomp_loaded():
        source = (
            "not set: libgomp was loaded before inferlab (torch imported first), so its "
            "default applies (spin, then sleep)"
        )
    else:
        os.environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
        source = "inferlab default"
    _decision.update(
        {
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
            "source": source,
        }
    )


def wait_policy() -> dict[str, str | None]:
    """The wait policy OpenMP's threads run with in this process, and who chose it."""
    choose_wait_policy()
    return dict(_decision)
