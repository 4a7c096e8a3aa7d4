"""Options declared once, checked by one checker.

An options class is a frozen dataclass deriving from `Options`. Each option is one field: its
type hint says what kind of value it takes, `option(default, help=..., ...)` its default, help
and allowed values (`choices`, the `registry` of a plug point, bounds, `aliases`). Building one
normalises and checks it, once: `_normalise` (aliases, resolved locations), then every field by
its hint and metadata, then `_check_together` (the rules between fields, short named
functions). A bad value is a ValueError of the class's `error` type in the project's form:

    engine.kv_cache: 'x' is invalid; allowed: none|contiguous|paged
"""

from __future__ import annotations

import functools
import importlib
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, asdict, field, fields
from typing import Any, ClassVar, TypeVar

OptionsT = TypeVar("OptionsT", bound="Options")

#: The allowed values as the message says them, or how to say them from the whole config.
Allowed = str | Callable[[Any], str]


def option(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Any = MISSING,
    choices: Sequence[object] | None = None,
    registry: str | None = None,
    aliases: Mapping[str, str] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    unit: str | None = None,
    valid: Callable[[Any], bool] | None = None,
    allowed: Allowed | None = None,
    secret: bool = False,
    empty: bool = False,
) -> Any:
    """A dataclass field for one option. `registry` ("module:NAME") names the plug point's
    `Registry`, imported when first checked (its `names()`, extra values such as auto
    included, are the choices); `aliases` maps each accepted spelling (case-insensitive) to
    the value kept; ge/gt/le/lt bound a number (each item of a list); `valid` is a further
    test of a value of the right kind; `allowed` replaces the generated description; a
    `secret` is never shown (its messages leave the value out, and so does repr); `empty`: a
    list may have no items."""
    metadata = {
        "help": help,
        "choices": tuple(choices) if choices is not None else None,
        "registry": registry,
        "aliases": aliases,
        "bounds": {
            k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None
        },
        "unit": unit,
        "valid": valid,
        "allowed": allowed,
        "secret": secret,
        "empty": empty,
    }
    return field(
        default=default, default_factory=default_factory, metadata=metadata, repr=not secret
    )


def is_device(value: str) -> bool:
    """A device an in-process backend takes: auto | cpu | cuda | cuda:N."""
    return re.fullmatch(r"auto|cpu|cuda|cuda:\d+", value) is not None


class Options:
    """The base of an options dataclass (declare it `@dataclass(frozen=True)`)."""

    #: How a message names a field (`engine.` + name) and the exception it raises.
    prefix: ClassVar[str] = "engine."
    error: ClassVar[type[ValueError]] = ValueError
    #: How the unknown-keys message names the options (`engine: unknown option(s) ...`).
    section: ClassVar[str] = "engine"

    def __post_init__(self) -> None:
        self._normalise()
        for f in fields(self):  # type: ignore[arg-type]
            self._check_field(f)
        self._check_together()

    @classmethod
    def from_dict(cls: type[OptionsT], values: Mapping[str, Any]) -> OptionsT:
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(values) - known)
        if unknown:
            raise cls.error(
                f"{cls.section}: unknown option(s) {unknown}; known options: {sorted(known)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    def _normalise(self) -> None:
        """Values rewritten before the check (a resolved location, null for a default)."""

    def _check_together(self) -> None:
        """The rules between fields, after each field was checked on its own."""

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: only while the instance is built

    def invalid(self, name: str, allowed: str | None = None) -> ValueError:
        """The error for field `name`, with its declared allowed values unless `allowed`."""
        shown = "" if _field(self, name).metadata.get("secret") else f"{getattr(self, name)!r} is "
        return self.error(
            f"{self.prefix}{name}: {shown}invalid; allowed: "
            f"{allowed if allowed is not None else describe(self, name)}"
        )

    def plugged(self, name: str) -> Any:
        """The entry of its plug point's registry that option `name` picks."""
        return _registry(_field(self, name).metadata["registry"]).get(getattr(self, name))

    def _check_field(self, f: Field[Any]) -> None:
        value, meta = getattr(self, f.name), f.metadata
        if not meta:  # a plain dataclasses.field: not an option()
            return
        if meta["aliases"] is not None:
            spelling = str(value).lower()
            if spelling not in meta["aliases"]:
                raise self.invalid(f.name)
            self._set(f.name, meta["aliases"][spelling])
            return
        kind, optional = _kind(_hints(type(self))[f.name])
        if value is None and optional:
            return
        if _is_options(kind):  # a nested section: built (and so checked) from its mapping
            if not isinstance(value, kind):
                self._set(f.name, kind.from_dict(value))
            return
        if not _fits(value, kind, meta) or (meta["valid"] is not None and not meta["valid"](value)):
            raise self.invalid(f.name)
        if typing.get_origin(kind) in (list, tuple):  # a list from YAML or the command line
            self._set(f.name, typing.get_origin(kind)(value))


def describe(config: Any, name: str) -> str:
    """What field `name` of `config` allows, as its messages say it."""
    meta = _field(config, name).metadata
    allowed = meta["allowed"]
    if allowed is not None:
        return allowed if isinstance(allowed, str) else allowed(config)
    kind, optional = _kind(_hints(type(config))[name])
    names = _choices(meta) or tuple(meta["aliases"] or ())
    if names:
        return ("null|" if optional else "") + "|".join(str(n) for n in names)
    what = {bool: "true|false", int: "an integer", float: "a number", str: "a string"}
    if typing.get_origin(kind) in (list, tuple):
        items = {int: "integers", float: "numbers", str: "strings"}
        size = "" if meta["empty"] else "non-empty "
        text = f"a {size}list of {items.get(typing.get_args(kind)[0], 'values')}"
    else:
        plain = typing.get_origin(kind) or kind  # dict[str, Any] is a dict
        text = what.get(plain, "a mapping" if plain is dict else "a value")
    if kind is float and meta["unit"]:
        text += f" of {meta['unit']}"
    text += _bounds_text(meta["bounds"])
    return f"null or {text}" if optional else text


def _field(config: Any, name: str) -> Field[Any]:
    return next(f for f in fields(config) if f.name == name)


def _choices(meta: Mapping[str, Any]) -> tuple[object, ...]:
    if meta["registry"] is not None:
        return tuple(_registry(meta["registry"]).names())
    return meta["choices"] or ()


@functools.cache
def _registry(reference: str) -> Any:
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _kind(hint: Any) -> tuple[Any, bool]:
    """The kind of value a hint takes (int, list[int], dict, ...) and whether null is allowed."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return next(a for a in args if a is not type(None)), type(None) in args
    return hint, False


def _fits(value: Any, kind: Any, meta: Mapping[str, Any]) -> bool:
    """Whether `value` is of `kind` and within the field's bounds and choices (a list: not
    empty, and each item so)."""
    if typing.get_origin(kind) in (list, tuple):
        item = typing.get_args(kind)[0]
        return (
            isinstance(value, Sequence)
            and not isinstance(value, str | bytes)
            and (len(value) > 0 or meta["empty"])
            and all(_fits(v, item, meta) for v in value)
        )
    if typing.get_origin(kind) is dict or kind is dict:
        return isinstance(value, Mapping)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        fits = _is_int(value) and _within(value, meta["bounds"])
    elif kind is float:
        fits = (
            _is_number(value)
            and (_is_int(value) or math.isfinite(value))  # an int is finite, however large
            and _within(value, meta["bounds"])
        )  # NaN and inf are never a setting
    elif kind is str:
        fits = isinstance(value, str)
    else:
        return True
    names = _choices(meta)
    return fits and (not names or value in names)


def _is_options(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, Options)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is 1 to Python


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _within(value: float, bounds: Mapping[str, float]) -> bool:
    return (
        value >= bounds.get("ge", -math.inf)
        and value > bounds.get("gt", -math.inf)
        and value <= bounds.get("le", math.inf)
        and value < bounds.get("lt", math.inf)
    )


def _bounds_text(bounds: Mapping[str, float]) -> str:
    """The bounds as a message says them: ` >= 1`, ` > 0`, ` in (0, 1]`."""
    low = next(((b, bounds[b]) for b in ("ge", "gt") if b in bounds), None)
    high = next(((b, bounds[b]) for b in ("le", "lt") if b in bounds), None)
    if low and high:
        opening, closing = "[" if low[0] == "ge" else "(", "]" if high[0] == "le" else ")"
        return f" in {opening}{_number(low[1])}, {_number(high[1])}{closing}"
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    bound = low or high
    return f" {signs[bound[0]]} {_number(bound[1])}" if bound else ""


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)
