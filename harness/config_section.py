"""A section of the harness's config (`run`, `run.window`, ...) as an options dataclass:
each key one `option(...)` field, checked by the engine options' checker (engines/options.py),
its messages in the harness's form (`run.window: unknown key(s) [...]; allowed: [...]`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, ClassVar

from engines.options import Options, OptionsT


class ConfigSection(Options):
    """The base of a section (declare it `@dataclass(frozen=True)`, with its `section` name)."""

    error: ClassVar[type[ValueError]] = ValueError
    section: ClassVar[str] = "run"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.prefix = f"{cls.section}."

    @classmethod
    def from_dict(cls: type[OptionsT], values: Any) -> OptionsT:
        """The section from its mapping (None: every default), an unknown key named."""
        allowed = sorted(f.name for f in fields(cls))  # type: ignore[arg-type]
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise cls.error(
                f"{cls.section}: {values!r} is invalid; allowed: a mapping of {allowed}"
            )
        unknown = sorted(set(values) - set(allowed), key=str)
        if unknown:
            raise cls.error(f"{cls.section}: unknown key(s) {unknown}; allowed: {allowed}")
        return cls(**values)

    def _keep_floats(self, *names: str) -> None:
        """Numbers given as integers held as floats, as their users (and the hand-written checks
        this section replaced) have them."""
        for name in names:
            if getattr(self, name) is not None:
                self._set(name, float(getattr(self, name)))


def holds_a_float(value: Any) -> bool:
    """Whether float() takes `value` (an integer past its range does not)."""
    try:
        float(value)
    except OverflowError:
        return False
    return True
