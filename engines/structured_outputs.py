"""What a request's output must match (vLLM's `StructuredOutputsParams`): a JSON schema, any
JSON object, a regular expression, one of a list of choices, or an EBNF grammar. Shared by
every backend; the built-in engine enforces it with a grammar backend
(engines/builtin/structured/), other backends pass it on or refuse it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: The kinds, in the order a request's fields are read; exactly one is set
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: Deeper schemas are refused: compiling a 700-deep one took xgrammar 13 s, and Python's
#: recursion limit ends reading one of ~1000
MAX_SCHEMA_DEPTH = 64


def _depth(value: object) -> int:
    """How deeply lists and objects nest in `value` (iteratively: any depth is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or its text), `json_object` (true: any
    JSON object), `regex`, `choice` (the output is one of these strings), `grammar` (EBNF, as
    xgrammar and vLLM read it)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's JSON (its keys in their order, which is the
        order a generated object follows), the regex, the choices as a JSON list, the grammar;
        "" for json_object. With `kind`, the compile cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if self.kind == "choice":
            return json.dumps(list(value), ensure_ascii=False)
        return "" if self.kind == "json_object" else str(value)

    def matches(self, text: str) -> bool | None:
        """Whether `text` satisfies the constraint (a JSON schema through jsonschema, the
        reference validator, where installed; else the JSON must parse); None for a grammar,
        which only a grammar engine can judge."""
        kind = self.kind
        if kind == "regex":
            return re.fullmatch(str(self.regex), text) is not None
        if kind == "choice":
            return text in (self.choice or ())
        if kind == "grammar":
            return None
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        try:
            import jsonschema
        except ImportError:
            return True  # it parses; the schema is not checked without jsonschema
        return jsonschema.Draft202012Validator(json.loads(self.spec)).is_valid(value)

    def validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            text = repr(getattr(self, name))
            text = text if len(text) <= 80 else text[:77] + "..."
            return ValueError(
                f"SamplingParams.structured_outputs.{name}: {text} is invalid; allowed: {allowed}"
            )

        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"SamplingParams.structured_outputs: {len(given)} constraints given "
                f"({', '.join(given) or 'none'}); allowed: exactly one of {', '.join(KINDS)}"
            )
        if not isinstance(self.json_object, bool):
            raise bad("json_object", "true or false")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except (ValueError, RecursionError):
                    raise bad(
                        "json", f"a JSON schema nested at most {MAX_SCHEMA_DEPTH} levels deep"
                    ) from None
            else:
                schema = self.json
            if not isinstance(schema, dict | bool):
                raise bad("json", "a JSON schema (an object, or its JSON text)")
            if _depth(schema) > MAX_SCHEMA_DEPTH:
                raise bad("json", f"a JSON schema nested at most {MAX_SCHEMA_DEPTH} levels deep")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(name, "a non-empty string")
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, list | tuple)
            or not choice
            or not all(isinstance(c, str) and c for c in choice)
        ):
            raise bad("choice", "a non-empty list of non-empty strings")
