"""The engine's adapters: which are known (`lora_modules`, or loaded later by name), which are
read into host memory (up to `max_cpu_loras`, least recently used out first), and which sit in
the `max_loras` slots of the model's LoRA layers for the running batch.

Reading a folder takes milliseconds to seconds, so it runs in a thread of its own: a request
for an adapter not yet in host memory waits in the queue until it is (`ready`), and the step
loop never reads a disk. Writing an adapter into a slot is a copy of its tensors, done at the
start of the step that first runs it. Counted: loads from disk and their time, slot writes,
slot evictions (docs/lora.md).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.builtin.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from engines.builtin.lora.layer import LoRALayerSlots
from models.config import ModelConfig


@dataclass
class LoRAStats:
    disk_loads: int = 0
    disk_load_s: float = 0.0
    slot_writes: int = 0
    slot_evictions: int = 0
    cpu_evictions: int = 0

    def to_dict(self) -> dict[str, object]:
        return {
            "lora_disk_loads": self.disk_loads,
            "lora_disk_load_s": self.disk_load_s,
            "lora_slot_writes": self.slot_writes,
            "lora_slot_evictions": self.slot_evictions,
            "lora_cpu_evictions": self.cpu_evictions,
        }


class LoRAManager:
    def __init__(
        self,
        modules: dict[str, str],
        config: ModelConfig,
        layers: Iterable[LoRALayerSlots],
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
    ) -> None:
        for name in modules:
            check_adapter_name(name, f"lora_modules.{name}")
        self.paths = dict(modules)
        self._names = tuple(sorted(self.paths))
        # each adapter's K/V namespace: its name and which time it was added, so that an
        # adapter unloaded and loaded again under its name never finds the old one's cache
        self._added = itertools.count()
        self._namespaces = {name: f"{name}#{next(self._added)}" for name in self.paths}
        # each adapter's files as its first read found them: a later read of changed files
        # fails (its prefix cache and its running requests were computed with the old ones)
        self._fingerprints: dict[str, tuple[int, ...]] = {}
        self.config = config
        self.layers = list(layers)
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.stats = LoRAStats()
        self.failed: dict[str, str] = {}  # adapter -> why it could not be read again
        self._facts: dict[str, dict[str, Any]] = {}  # adapter -> what its last read found
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first
        self._loading: dict[str, Future[LoRAAdapter]] = {}
        self._slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self._lock = threading.Lock()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="inferlab-lora-load")

    # ---- names --------------------------------------------------------------------------------

    def namespace(self, name: str) -> str:
        """The prefix-cache namespace of the adapter now registered as `name`."""
        return self._namespaces[name]

    def check_known(self, name: str) -> None:
        if name not in self.paths:
            known = ", ".join(sorted(self.paths)) or "none (engine.lora_modules is empty)"
            raise ValueError(f"lora: {name!r} is not a loaded adapter; allowed: {known}")

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Adapter `name` read from `path` and checked against the model, not registered
        (safe off the engine thread: it reads only the model's config); LoRAError naming it."""
        return self._read(name, path)

    def add(self, adapter: LoRAAdapter) -> None:
        """Register an adapter `read` returned (vLLM's /v1/load_lora_adapter)."""
        check_adapter_name(adapter.name, "lora_name")
        if adapter.name in self.paths:
            raise ValueError(f"lora_name: {adapter.name!r} is already loaded")
        self.paths[adapter.name] = adapter.path
        self._namespaces[adapter.name] = f"{adapter.name}#{next(self._added)}"
        self._fingerprints.pop(adapter.name, None)
        self._names = tuple(sorted(self.paths))
        self._keep(adapter)

    def remove(self, name: str, in_use: bool) -> None:
        """Forget adapter `name` (its slot and host copy); refused while requests use it."""
        self.check_known(name)
        if in_use:
            raise ValueError(f"lora_name: {name!r} is in use by running or waiting requests")
        with self._lock:
            self._host.pop(name, None)
            stale = self._loading.pop(name, None)  # a read still going: its result is dropped
        if stale is not None:
            stale.cancel()
        self.failed.pop(name, None)
        slot = self._slots.pop(name, None)
        if slot is not None:
            for layer in self.layers:
                layer.clear(slot)
        del self.paths[name]
        del self._namespaces[name]
        self._fingerprints.pop(name, None)
        self._names = tuple(sorted(self.paths))
        self._facts.pop(name, None)

    def read_all(self) -> None:
        """Read every known adapter once, checking it against the model (LoRAError naming
        the first that cannot run); the last max_cpu_loras read stay in host memory."""
        for name, path in self.paths.items():
            self._keep(self._read(name, path))

    def mean_adapter_params(self) -> float:
        """The A and B parameters of an adapter, averaged over those read (0: none)."""
        counts = [facts["params"] for facts in self._facts.values() if "params" in facts]
        return sum(counts) / len(counts) if counts else 0.0

    def describe(self) -> dict[str, Any]:
        """The slots, the adapters known (rank, targets, bytes where read) and the counts
        so far."""
        return {
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_rank,
            "max_cpu_loras": self.max_cpu_loras,
            "slot_bytes": sum(layer.nbytes for layer in self.layers),
            "adapters": {
                name: self._facts.get(name, {"path": self.paths[name]}) for name in self.names
            },
            "resident": dict(self._slots),
            **self.stats.to_dict(),
        }

    @property
    def names(self) -> tuple[str, ...]:
        """The known adapters, sorted: a tuple replaced whole on a change, so that another
        thread (the server's) may read it while the engine's changes the set."""
        return self._names

    # ---- host memory --------------------------------------------------------------------------

    def prefetch(self, name: str) -> None:
        """Start reading `name` into host memory, unless it is there or on its way (a name
        whose read failed is tried again)."""
        self.check_known(name)
        self.failed.pop(name, None)
        with self._lock:
            if name in self._host or name in self._loading:
                return
            self._loading[name] = self._reader.submit(self._read, name, self.paths[name])

    def poll(self) -> None:
        """Take in the reads that have finished (the engine calls it once per step, so that
        what `ready` says holds for the whole step). A read that failed (the folder changed
        since the start) is kept in `failed`, naming the adapter, for the engine to fail the
        requests that wait for it."""
        with self._lock:
            done = {name: f for name, f in self._loading.items() if f.done()}
            for name in done:
                del self._loading[name]
        for name, future in done.items():
            try:
                self._keep(future.result())
            except (LoRAError, OSError) as exc:
                self.failed[name] = str(exc)

    def ready(self, name: str) -> bool:
        """Whether `name` is in host memory; if not, its read is started (unless it is on its
        way, or failed)."""
        with self._lock:
            if name in self._host:
                return True
            loading = name in self._loading
        if not loading and name not in self.failed:
            self.prefetch(name)
        return False

    def _read(self, name: str, path: str) -> LoRAAdapter:
        began = time.perf_counter()
        adapter = load_adapter(name, Path(path), self.config, self.max_rank)
        self.stats.disk_loads += 1
        self.stats.disk_load_s += time.perf_counter() - began
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        """Keep `adapter` in host memory (LoRAError if its files changed since its first
        read), and what it is in describe()."""
        first = self._fingerprints.setdefault(adapter.name, adapter.fingerprint)
        if adapter.fingerprint != first:
            raise LoRAError(
                f"lora_modules.{adapter.name}: {adapter.path} changed since it was loaded; "
                "unload it and load it again (or under another name)"
            )
        self._facts[adapter.name] = {
            "path": adapter.path,
            "rank": adapter.rank,
            "scaling": adapter.scaling,
            "target_modules": list(adapter.target_modules),
            "bytes": adapter.nbytes,
            "params": sum(a.numel() + b.numel() for a, b in adapter.weights.values()),
        }
        with self._lock:
            self._host[adapter.name] = adapter
            self._host.move_to_end(adapter.name)
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)  # a slot keeps its own copy
                self.stats.cpu_evictions += 1

    # ---- slots --------------------------------------------------------------------------------

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """The slot of each adapter a step runs, writing those not resident into the least
        recently used slots of adapters it does not run (the scheduler never runs more than
        max_loras adapters at once)."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step > max_loras={self.max_loras}")
        for name in wanted:
            if name in self._slots:
                self._slots.move_to_end(name)
                continue
            free = set(range(self.max_loras)) - set(self._slots.values())
            if free:
                slot = min(free)
            else:
                victim = next(n for n in self._slots if n not in wanted)
                slot = self._slots.pop(victim)
                self.stats.slot_evictions += 1
            adapter = self._host_copy(name)
            for layer in self.layers:
                layer.write(slot, adapter)
            self._slots[name] = slot
            self.stats.slot_writes += 1
        return {name: self._slots[name] for name in wanted}

    def _host_copy(self, name: str) -> LoRAAdapter:
        with self._lock:
            adapter = self._host.get(name)
            if adapter is not None:
                self._host.move_to_end(name)
                return adapter
        # evicted from host memory since it was admitted: read it again (counted)
        adapter = self._read(name, self.paths[name])
        self._keep(adapter)
        return adapter

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)


def check_adapter_name(name: object, field: str) -> None:
    """A name requests can give as their `model`: 1 to 256 printable characters."""
    if not isinstance(name, str) or not 1 <= len(name) <= 256 or not name.isprintable():
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:60] + "..."
        raise LoRAError(f"{field}: {shown} is invalid; allowed: 1 to 256 printable characters")


__all__ = ["LoRAError", "LoRAManager", "LoRAStats", "check_adapter_name"]
