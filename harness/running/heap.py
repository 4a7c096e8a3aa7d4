"""The garbage collector while a run is measured.

A harness process holds about a million objects from its imports (torch, hydra, pandas) and
its load, and a full (generation 2) collection walks them all: mid-run such collections
stalled the driver's event loop 170-270 ms at a time (engine=openai at 200 requests/s,
scripts/client_ceiling.py), each pause charged to the TTFT, ITL and lateness of whatever was
in flight. `frozen()` collects once and freezes what is alive (`gc.freeze`), so that the
collections during the run walk only the run's own objects; it unfreezes afterwards, so that
what the run leaves behind is collected as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen() -> Iterator[None]:
    """Everything alive now is left out of the collections while the block runs."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
