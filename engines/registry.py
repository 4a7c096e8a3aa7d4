"""One way to register a plug point's implementations: backends, attention backends, linear
(quantization) methods, KV-cache managers, workload types. Each plug point is a `Registry`
named by the config key that picks from it; an implementation registers under its value:

    LINEAR_METHODS = Registry[type[LinearMethod]]("engine.quantization")

    @LINEAR_METHODS.register("int8")
    class Int8Method(LinearMethod): ...

`get` of an unknown name is a ValueError naming the key and the values registered, and
`inferlab list` prints every registry (`REGISTRIES`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

#: Every registry, by the config key it serves (for `inferlab list`).
REGISTRIES: dict[str, Registry[object]] = {}


class Registry(Generic[T]):
    def __init__(self, key: str, extra_values: tuple[str, ...] = (), listed: bool = True) -> None:
        self.key = key  # the config key whose values name the entries
        self.extra_values = extra_values  # values handled before the registry (e.g. auto)
        self._entries: dict[str, T] = {}
        if listed:  # in REGISTRIES, for `inferlab list`
            REGISTRIES[key] = self  # type: ignore[assignment]

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            self.add(name, entry)
            return entry

        return add

    def add(self, name: str, entry: T) -> None:
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"{self.key}: {name!r} is registered twice")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"{self.key}: {name!r} is invalid; allowed: {'|'.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return [*self.extra_values, *self._entries]

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def values(self) -> list[T]:
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())
