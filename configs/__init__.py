"""The Hydra config tree that `inferlab run`, `serve`, `kv-calc` and `ab` compose: `config.yaml`
and its groups. Each `engine` group extends its backend's schema, `<backend>_schema`, and each
`workload` group its type's, `<type>_schema`: the options dataclasses, where defaults and types
live once; the YAML files hold presets. Importing `engines.backends` and `workloads` puts the
schemas in Hydra's ConfigStore; a composer imports them first (this package imports nothing
of the project's: the engines and workloads sit above it)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent

#: the words a flag may be given as (any case): OmegaConf also reads yes/y/on and any
#: integer as true, so `run.allow_failed_jobs=2` passed a sweep whose job failed
FLAG_WORDS = ("true", "false")


def _refuse_loose_flags() -> None:
    """Make OmegaConf's bool nodes accept only true and false (a bool, or the word in any
    case): the project's form for a flag is `allowed: true|false`, and a typo or a number must
    not silently turn a flag on. Installed once, by importing this package, for every config
    OmegaConf checks in the process."""
    # Global, at import, not around `compose`: most configs are composed by Hydra itself, out
    # of our reach: `inferlab run`'s hydra.main, the sweeper's job configs, and a launcher
    # plugin's (joblib, ray, submitit) in its own worker process, whose only code of ours is
    # the task function it unpickles (harness.running.app, which imports this package). A
    # patch put on and taken off around a call would also race the server's threads.
    from omegaconf import nodes
    from omegaconf.errors import ValidationError

    # a private method: an OmegaConf without it runs loose, and the test of this rule fails
    loose = getattr(nodes.BooleanNode, "_validate_and_convert_impl", None)
    if loose is None or getattr(loose, "strict", False):
        return

    def strict(self: nodes.BooleanNode, value: Any) -> bool:
        if isinstance(value, bool) or (isinstance(value, str) and value.lower() in FLAG_WORDS):
            return loose(self, value)
        raise ValidationError("Value '$VALUE' is not a valid bool (type $VALUE_TYPE)")

    strict.strict = True  # type: ignore[attr-defined]
    nodes.BooleanNode._validate_and_convert_impl = strict  # type: ignore[method-assign]


_refuse_loose_flags()


class ComposeError(ValueError):
    """Overrides that do not compose: the message names the key (or group) and why."""


def compose(overrides: Sequence[str], config_dir: Path = CONFIG_DIR) -> Any:
    """The composed config (a DictConfig) for these overrides, outside a Hydra app. Raises
    ComposeError for an unknown key or group option, or a value of the wrong type."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
            return hydra_compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ComposeError(reason(exc)) from exc


def reason(exc: BaseException) -> str:
    """One line: `full_key: what is wrong` from OmegaConf's cause (an unknown key of a schema
    with the schema's keys; a value of the wrong type with what the schema's field allows),
    else Hydra's own words."""
    import dataclasses

    from hydra.errors import OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = exc.__cause__ or exc
    if isinstance(cause, OverrideParseException):
        return _unparsed(cause.override)
    schema = getattr(cause, "object_type", None)
    full_key = getattr(cause, "full_key", None)
    unknown = isinstance(cause, ConfigAttributeError | ConfigKeyError)
    if unknown and dataclasses.is_dataclass(schema) and full_key:
        allowed = "|".join(sorted(f.name for f in dataclasses.fields(schema)))
        return f"{full_key}: unknown key; allowed: {allowed}"
    if isinstance(cause, ValidationError) and dataclasses.is_dataclass(schema) and full_key:
        wrong_type = _wrong_type(str(cause), schema, str(full_key).rsplit(".", 1)[-1])
        if wrong_type is not None:
            return f"{full_key}: {wrong_type}"
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    key = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None
    )
    if key and lines:
        return f"{key}: {lines[0]}"
    if "Available options" in str(exc):  # an unknown group option: list the known ones
        head, _, rest = str(exc).partition("Available options in")
        group, _, options = rest.partition(":")
        listed = options.split("Config search path")[0].split()
        # `<name>_schema` entries are the ConfigStore's typed schemas, not choices
        known = [o for o in listed if not o.endswith("_schema")]
        return f"{' '.join(head.split())} (allowed {group.strip()}: {'|'.join(known)})"
    return " ".join(str(exc).split())


def _unparsed(override: str) -> str:
    """Hydra's grammar takes an unquoted value of ASCII letters, digits and a few symbols
    (a path with ü or a bracket in it needs quotes), and its own message is a parser's."""
    key, sep, value = override.partition("=")
    if not sep:
        return f"{override!r}: not an override; allowed: KEY=VALUE"
    if value.lstrip()[:1] in ("[", "{"):  # a list or dict typed wrong: quotes make it a string
        return (
            f"{key}: {value!r} cannot be read (Hydra's override grammar); allowed: a value, "
            "a [list] or a {dict} with matching brackets, or a quoted string"
        )
    return (
        f"{key}: {value!r} cannot be read unquoted (Hydra's override grammar); quote it: "
        f"'{key}=\"{value}\"'"
    )


# OmegaConf's words for a value its node's type refuses: "Value 'abc' of type 'str' could not
# be converted to Float", "Value 'maybe' is not a valid bool (type str)", "Invalid value 'x',
# expected one of [A, B]", "Cannot convert 'list' to string: '[1]'"
_REFUSED_VALUE = re.compile(
    r"[Vv]alue '(.*?)'(?: of type '| is not a valid |, expected one of )"
    r"|Cannot convert '\w+' to string: '(.*)'"
)


def _wrong_type(message: str, schema: Any, field_name: str) -> str | None:
    """`'abc' is invalid; allowed: a number`, the project's words for a value of the wrong
    type, from the schema's type of the field; None when the message or the type is not one
    this knows (Hydra's own words are said then)."""
    import typing

    found = _REFUSED_VALUE.search(message)
    try:
        hint = typing.get_type_hints(schema).get(field_name)
    except Exception:  # a schema whose annotations do not resolve (another package's)
        return None
    allowed = _allowed_values(hint)
    if found is None or allowed is None:
        return None
    value = found.group(1) if found.group(1) is not None else found.group(2)
    return f"{value!r} is invalid; allowed: {allowed}"


def _allowed_values(hint: Any) -> str | None:
    """What a value of type `hint` may be, in a config error's words."""
    import enum
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [_allowed_values(a) for a in args if a is not type(None)]
        if not kinds or None in kinds:
            return None
        either = " or ".join(typing.cast(list[str], kinds))
        return f"null or {either}" if type(None) in args else either
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "|".join(member.name for member in hint)
    return {bool: "true|false", int: "an integer", float: "a number", str: "a string"}.get(hint)
