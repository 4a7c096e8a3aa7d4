"""Hydra schemas made from the dataclasses that validate a config section: the same fields,
types and defaults, written once in the dataclass, as a plain (mutable) dataclass that OmegaConf
can hold; a frozen dataclass would make its nodes read-only, so that no override could set them.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


def schema_of(cls: type[Any]) -> type[Any]:
    """`cls`'s fields as a mutable dataclass `<cls>Schema`; a field that is itself a dataclass
    becomes that dataclass's schema, defaulting to its defaults."""
    hints = typing.get_type_hints(cls)
    entries: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            nested = schema_of(hint)
            entries.append((f.name, nested, dataclasses.field(default_factory=nested)))
        elif f.default is dataclasses.MISSING:
            entries.append((f.name, hint, dataclasses.field(default_factory=f.default_factory)))
        else:
            entries.append((f.name, hint, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", entries)
