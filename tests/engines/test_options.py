"""The one checker behind every options dataclass (engines/options.py): each field checked by
its type hint and metadata, in the project's message form."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from engines.options import Options, option


class ToyError(ValueError):
    pass


@dataclass(frozen=True)
class Toy(Options):
    prefix = "toy."
    error = ToyError
    section = "toy"

    flag: bool = option(False, help="a switch")
    count: int = option(1, ge=1, help="at least one")
    limit: int | None = option(None, ge=2, help="optional")
    share: float = option(0.5, gt=0, le=1, help="a fraction")
    wait_s: float = option(1.0, ge=0, unit="seconds", help="a wait")
    mode: str = option("a", choices=("a", "b"), help="a choice")
    sizes: list[int] | None = option(None, ge=1, help="a list")
    names: tuple[str, ...] = option(("x",), choices=("x", "y"), help="names")
    spelling: str = option("one", aliases={"one": "one", "1": "one"}, help="aliased")
    key: str | None = option(None, secret=True, valid=bool, help="a secret")
    extra: dict[str, Any] = option(default_factory=dict, help="a mapping")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"flag": 1}, "toy.flag: 1 is invalid; allowed: true|false"),
        ({"count": True}, "toy.count: True is invalid; allowed: an integer >= 1"),
        ({"count": 0}, "toy.count: 0 is invalid; allowed: an integer >= 1"),
        ({"count": "2"}, "toy.count: '2' is invalid; allowed: an integer >= 1"),
        ({"limit": 1}, "toy.limit: 1 is invalid; allowed: null or an integer >= 2"),
        ({"share": math.nan}, "toy.share: nan is invalid; allowed: a number in (0, 1]"),
        ({"share": False}, "toy.share: False is invalid; allowed: a number in (0, 1]"),
        ({"wait_s": math.inf}, "toy.wait_s: inf is invalid; allowed: a number of seconds >= 0"),
        ({"mode": "c"}, "toy.mode: 'c' is invalid; allowed: a|b"),
        ({"sizes": []}, "toy.sizes: [] is invalid; allowed: null or a non-empty list of integers"),
        ({"sizes": [1, True]}, "toy.sizes: [1, True] is invalid"),
        ({"sizes": "12"}, "toy.sizes: '12' is invalid"),
        ({"names": ["z"]}, "toy.names: ['z'] is invalid; allowed: x|y"),
        ({"spelling": "two"}, "toy.spelling: 'two' is invalid; allowed: one|1"),
        ({"key": ""}, "toy.key: invalid; allowed: null or a string"),
        ({"extra": [1]}, "toy.extra: [1] is invalid; allowed: a mapping"),  # was "a value"
    ],
)
def test_a_bad_value_names_the_field_and_what_it_allows(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ToyError) as refused:
        Toy(**values)  # type: ignore[arg-type]
    assert str(refused.value).startswith(message)


def test_good_values_are_kept_normalised_and_frozen() -> None:
    toy = Toy.from_dict({"limit": None, "wait_s": 3, "names": ["y", "x"], "spelling": "1"})
    assert (toy.limit, toy.wait_s, toy.names, toy.spelling) == (None, 3, ("y", "x"), "one")
    with pytest.raises(AttributeError):
        toy.count = 2  # type: ignore[misc]
    assert "key" not in repr(Toy(key="hunter2"))


def test_unknown_keys_are_named_with_the_known_ones() -> None:
    with pytest.raises(ToyError, match=r"toy: unknown option\(s\) \['cuont'\]; known options: "):
        Toy.from_dict({"cuont": 2})


@dataclass(frozen=True)
class Inner(Options):
    prefix = "toy.inner."
    error = ToyError
    section = "toy.inner"

    depth: int = option(1, ge=0, help="how deep")
    tags: list[str] = option(default_factory=list, empty=True, help="may be empty")


@dataclass(frozen=True)
class Outer(Options):
    prefix = "toy."
    error = ToyError
    section = "toy"

    inner: Inner = option(default_factory=Inner, help="a nested section")


def test_a_nested_section_is_built_from_its_mapping_and_checked_by_its_own_fields() -> None:
    outer = Outer.from_dict({"inner": {"depth": 3, "tags": ("a",)}})
    assert outer.inner == Inner(depth=3, tags=["a"])  # a list from YAML's tuple too
    assert Outer().inner == Inner() and Inner().tags == []  # an empty list where allowed
    with pytest.raises(
        ToyError, match=r"^toy.inner.depth: -1 is invalid; allowed: an integer >= 0"
    ):
        Outer.from_dict({"inner": {"depth": -1}})
    with pytest.raises(ToyError, match=r"^toy.inner: unknown option\(s\) \['deep'\]"):
        Outer.from_dict({"inner": {"deep": 1}})
    with pytest.raises(ToyError, match=r"^toy.inner.tags: \[1\] is invalid; allowed: a list of"):
        Inner(tags=[1])  # type: ignore[list-item]


def test_an_integer_past_floats_range_is_a_number_not_a_traceback() -> None:
    with pytest.raises(ToyError, match=r"^toy.share: 1000.* is invalid; allowed: a number in"):
        Toy(share=10**400)
    assert Toy(wait_s=10**400).wait_s == 10**400  # no bound above: kept, as an integer
