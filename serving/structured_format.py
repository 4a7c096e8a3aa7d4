"""The request fields that ask for structured output, in the three spellings clients send:
OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
extension (`json`, `regex`, `choice`, `grammar`, `json_object`), and vLLM's older `guided_*`
fields; each read into the engine's StructuredOutputsParams (docs/structured_output.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engines.structured_outputs import StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JSONSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs` object (exactly one constraint)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StructuredFields(_Strict):
    """The fields a completions or chat request may carry; mixed into both."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint and the field it came from (None, None: none asked). ValueError
        naming the field for a request that asks twice or asks nothing valid."""
        found: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError(
                    "response_format.json_schema.schema: required when type is json_schema; "
                    'allowed: {"type": "json_schema", "json_schema": {"name": ..., "schema": '
                    "{...}}}"
                )
            found.append(("response_format", {"json": fmt.json_schema.schema_}))
        if self.structured_outputs is not None:
            body = self.structured_outputs
            fields: dict[str, Any] = {
                "json": body.json_,
                "json_object": bool(body.json_object),
                "regex": body.regex,
                "choice": body.choice,
                "grammar": body.grammar,
            }
            found.append(("structured_outputs", fields))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((f"guided_{kind}", {kind: value}))
        if not found:
            return None, None
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise ValueError(
                f"{found[1][0]}: a second structured-output constraint ({names}); allowed: one "
                "of response_format, structured_outputs, guided_*"
            )
        source, asked = found[0]
        try:
            return StructuredOutputsParams(**asked), source
        except ValueError as exc:
            # "SamplingParams.structured_outputs.regex: ..." -> the field the client sent
            message = str(exc).removeprefix("SamplingParams.")
            if source != "structured_outputs":
                message = f"{source}: {message.split(': ', 1)[1]}"
            raise ValueError(message) from None
