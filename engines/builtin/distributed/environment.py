"""torchrun's environment: the variables that make this process one tensor-parallel rank of
several, read and checked in one place.

torchrun (or any launcher like it) sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every
process it starts, and LOCAL_RANK / LOCAL_WORLD_SIZE for the ranks on each host. With the four
set, a process is a launched rank; a value that is not what the variable allows is a
ConfigError naming it and what is allowed, at once, rather than a Python traceback from deep in
torch.distributed or a silent wait for a world that never forms.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engines.base import ConfigError

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_UNSET = "or unset the four variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in the world torchrun started."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int | None = None  # the rank's GPU on its host (LOCAL_RANK), if set
    local_world_size: int | None = None  # the ranks on this host (LOCAL_WORLD_SIZE), if set

    @property
    def where(self) -> str:
        """Rank 0's store, as the messages name it."""
        return f"MASTER_ADDR:MASTER_PORT={self.master_addr}:{self.master_port}"


def launched() -> LaunchedRank | None:
    """This process's rank as torchrun set it, None when the four variables are not all set.
    Raises ConfigError for a variable with a value it does not allow."""
    if not all(key in os.environ for key in TORCHRUN_KEYS):
        return None
    world = _integer("WORLD_SIZE", 1)
    rank = _integer("RANK")
    if not 0 <= rank < world:
        raise ConfigError(
            f"RANK={rank} is outside WORLD_SIZE={world} (with MASTER_ADDR and MASTER_PORT they "
            "make this process a tensor-parallel rank started by torchrun); allowed: RANK "
            f"0..{world - 1} with WORLD_SIZE >= 1, {_UNSET}"
        )
    address = os.environ["MASTER_ADDR"].strip()
    if not address:
        raise ConfigError(
            f"MASTER_ADDR: {os.environ['MASTER_ADDR']!r} is invalid; allowed: the host name or "
            f"IP address of rank 0's machine, {_UNSET}"
        )
    port = _integer("MASTER_PORT", 1, 65535)
    local = _integer("LOCAL_RANK", 0) if "LOCAL_RANK" in os.environ else None
    on_host = _integer("LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in os.environ else None
    return LaunchedRank(rank, world, address, port, local, on_host)


def _integer(key: str, least: int | None = None, most: int | None = None) -> int:
    text = os.environ[key]
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is not None and (least is None or value >= least) and (most is None or value <= most):
        return value
    if least is None:
        allowed = "an integer"
    elif most is None:
        allowed = f"an integer >= {least}"
    else:
        allowed = f"an integer {least}..{most}"
    raise ConfigError(
        f"{key}: {text!r} is invalid; allowed: {allowed} (a torchrun variable), {_UNSET}"
    )
