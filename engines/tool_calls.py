"""Tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, how the tools reach
the prompt, what constrains the output, and how the output becomes `tool_calls`
(docs/structured_output.md, Tool calls). Below the server and the harness alike: `inferlab
serve` reads them off a chat request, a tool-call workload puts them on a GenerationRequest,
and the built-in backend renders, constrains and parses them the same way.

    tool_choice   the prompt                 the output                     the answer
    none          no tools                   free                           content
    auto          the tools                  free; <tool_call>{...}</...>   calls parsed out of it
    required      the tools                  a JSON array of calls          tool_calls
    {function}    the tools                  that function's arguments      one tool_call

`required` and a named function are enforced with a grammar (the engine's structured output),
as vLLM does: a JSON array of {"name", "parameters"} objects (one per call, at most one unless
parallel_tool_calls), or the named function's parameter object. `auto` leaves the model free
and parses Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, the
format of Qwen2's template and the one a template without tools is told to use.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from engines.sampling_params import SamplingParams
from engines.structured_outputs import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
#: a function without `parameters` takes none (OpenAI's meaning)
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError(
                f"parameters: a schema of type {value.get('type')!r}; allowed: an object "
                'schema ({"type": "object", "properties": ...}), as OpenAI requires'
            )
        return value

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                f"name: {value[:80]!r} is invalid; allowed: 1 to 64 letters, digits, _ or - "
                "(OpenAI's rule)"
            )
        return value


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class CalledFunction(BaseModel):
    """A call in a conversation's history (an SDK may add fields of its own: ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_choice_value(value: Any) -> Any:
    """A request's tool_choice checked: a mode, or a named function (ValueError otherwise)."""
    if value is None or isinstance(value, NamedToolChoice):
        return value
    if isinstance(value, str) and value in ("none", "auto", "required"):
        return value
    if isinstance(value, Mapping):
        try:
            return NamedToolChoice.model_validate(value)
        except ValueError:
            pass
    shown = repr(value)
    raise ValueError(
        f"tool_choice: {shown[:80]} is invalid; allowed: 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}'
    )


@dataclass(frozen=True)
class ToolCallOutput:
    """A chat answer's message once its tool calls are taken out: the content left (None when
    there is none) and the calls in OpenAI's layout (`id`, `type`, `function.name`,
    `function.arguments` as JSON text)."""

    content: str | None
    calls: tuple[dict[str, Any], ...]

    def message(self) -> dict[str, Any]:
        """The answer as the assistant message of the conversation's next turn."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [dict(call) for call in self.calls]
        return message


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asked of its tools, checked."""

    tools: tuple[FunctionDefinition, ...]
    mode: str  # none | auto | required | named
    named: str | None = None
    parallel: bool = True

    @classmethod
    def of(
        cls,
        tools: Sequence[ToolDefinition | Mapping[str, Any]] | None,
        choice: ToolChoice | Mapping[str, Any] | str | None,
        parallel: bool | None,
    ) -> ToolUse | None:
        """None when the request has no tools (and no choice that needs them); ValueError
        naming the field otherwise. Tools and the choice may come as OpenAI's JSON (a
        workload's file) or already parsed (a server request)."""
        functions = tuple(_tool_definition(t, i).function for i, t in enumerate(tools or []))
        choice = tool_choice_value(choice)
        names = [f.name for f in functions]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"tools: the function {duplicate!r} is defined twice")
        if choice is None:
            choice = "auto" if functions else "none"
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if named is not None and named not in names:
            raise ValueError(
                f"tool_choice: the function {named!r} is not among tools; allowed: "
                f"{', '.join(names) or 'none (no tools given)'}"
            )
        if choice in ("auto", "required") and not functions:
            raise ValueError(f"tool_choice: {choice!r} needs tools; allowed without: 'none'")
        if choice == "none" and not functions:
            return None
        mode = "named" if named is not None else str(choice)
        return cls(functions, mode, named, True if parallel is None else parallel)

    # ---- the prompt -------------------------------------------------------------------------

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template reads them (OpenAI's layout); None for none."""
        if self.mode == "none":
            return None
        return self._openai_tools()

    def request_fields(self) -> dict[str, Any]:
        """The tools as a chat completions request sends them to an OpenAI-compatible
        server."""
        choice: Any = self.mode
        if self.mode == "named":
            choice = {"type": "function", "function": {"name": self.named}}
        fields: dict[str, Any] = {
            "tools": self._openai_tools(),
            "tool_choice": choice,
        }
        if not self.parallel:  # sent only where it changes the default
            fields["parallel_tool_calls"] = False
        return fields

    def _openai_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": _function_dict(f)} for f in self.tools]

    def system_text(self) -> str:
        """For a template that does not render tools: what the system message tells the
        model (the Hermes format `auto` parses)."""
        listed = "\n".join(json.dumps(_function_dict(f)) for f in self.tools)
        return (
            "You may call functions. To call one, reply with "
            '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>.'
            f" The functions:\n{listed}"
        )

    # ---- the output -------------------------------------------------------------------------

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar `required` and a named function impose; None for none and auto."""
        if self.mode == "named":
            function = next(f for f in self.tools if f.name == self.named)
            return StructuredOutputsParams(json=function.parameters or _NO_PARAMETERS)
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f.name},
                    "parameters": f.parameters or _NO_PARAMETERS,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def constrain(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with the grammar the tool choice imposes (ValueError when the request
        already has a constraint of its own: one grammar per request)."""
        constraint = self.constraint()
        if constraint is None:
            return sampling
        if sampling.structured_outputs is not None:
            raise ValueError(
                "SamplingParams.structured_outputs: tool_choice already constrains the output "
                "(a named function or required); allowed: one of them"
            )
        return replace(sampling, structured_outputs=constraint)

    def output(self, text: str) -> ToolCallOutput:
        """`parse` as the message a conversation goes on with."""
        content, calls = self.parse(text)
        return ToolCallOutput(content, tuple(calls))

    def calls_valid(self, calls: Sequence[Mapping[str, Any]]) -> bool:
        """Whether every call names one of the tools and its arguments parse as JSON that
        satisfies that function's parameter schema (jsonschema, the reference validator)."""
        schemas = {f.name: f.parameters or _NO_PARAMETERS for f in self.tools}
        for call in calls:
            function = call.get("function") or {}
            schema = schemas.get(str(function.get("name")))
            arguments = function.get("arguments")
            if schema is None or not isinstance(arguments, str):
                return False
            if not StructuredOutputsParams(json=schema).matches(arguments):
                return False
        return True

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The message's content and its tool calls (OpenAI's layout; arguments as JSON
        text). Output that does not parse as calls stays content (a `required` or named
        output cut short by max_tokens, an `auto` block that is not JSON)."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            if _json_object(text) is None:
                return text, []
            return None, [_call(self.named or "", text)]
        if self.mode == "required":
            found = _json_value(text)
            if not isinstance(found, list) or not all(_is_call(c, "parameters") for c in found):
                return text, []
            return None, [_call(c["name"], json.dumps(c["parameters"])) for c in found]
        calls = []
        for block in _CALL.findall(text):
            found = _json_value(block)
            if not _is_call(found, "arguments"):
                return text, []
            arguments = found["arguments"]
            calls.append(_call(found["name"], json.dumps(arguments)))
        if not calls:
            return text, []
        content = _CALL.sub("", text).strip()
        return content or None, calls

    @property
    def constraint_field(self) -> str:
        """The request field whose schema the constraint compiles (for a 400 naming it)."""
        if self.mode == "named":
            index = next(i for i, f in enumerate(self.tools) if f.name == self.named)
            return f"tools[{index}].function.parameters"
        return "tools"

    @property
    def ends_with_calls(self) -> bool:
        """Whether an answer with calls finishes as `tool_calls` (OpenAI: not for a named
        function, which finishes as `stop`)."""
        return self.mode in ("auto", "required")


def tool_prompt(
    messages: list[dict[str, Any]], tools: ToolUse | None, renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(the messages, the tools) a chat template is given. A template that renders tools
    gets them, and the messages' tool calls as they are; for one that does not, the tools are
    described in the system message and the calls and results written as text."""
    template_tools = None if tools is None else tools.template_tools()
    if renders_tools:
        return messages, template_tools
    messages = history_as_text(messages)
    if template_tools is not None and tools is not None:
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] += "\n\n" + tools.system_text()
        else:
            messages.insert(0, {"role": "system", "content": tools.system_text()})
    return messages, None


def history_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation with tool calls and results, for a template that renders neither:
    each assistant call as its Hermes block after the message's text, each tool result as a
    user message holding `<tool_response>result</tool_response>` (Hermes' own layout)."""
    out = []
    for message in messages:
        text = message.get("content") or ""
        role = message["role"]
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            block = {
                "name": function.get("name"),
                "arguments": _json_value(function.get("arguments")),
            }
            text += f"<tool_call>{json.dumps(block)}</tool_call>"
        if role == "tool":
            role, text = "user", f"<tool_response>{text}</tool_response>"
        out.append({"role": role, "content": text})
    return out


def _tool_definition(tool: ToolDefinition | Mapping[str, Any], index: int) -> ToolDefinition:
    if isinstance(tool, ToolDefinition):
        return tool
    try:
        return ToolDefinition.model_validate(tool)
    except ValueError as exc:
        raise ValueError(f"tools[{index}]: {_first_error(exc)}") from None


def _first_error(exc: ValueError) -> str:
    """A pydantic error's first problem in one line (`where: what`)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    first = errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else str(first["msg"])


def _function_dict(function: FunctionDefinition) -> dict[str, Any]:
    return function.model_dump(exclude_none=True)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _json_value(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_object(text: str) -> dict[str, Any] | None:
    found = _json_value(text)
    return found if isinstance(found, dict) else None


def _is_call(found: Any, arguments: str) -> bool:
    return (
        isinstance(found, dict)
        and isinstance(found.get("name"), str)
        and isinstance(found.get(arguments), dict)
    )
