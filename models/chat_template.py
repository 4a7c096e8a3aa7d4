"""Chat templates: Jinja from a checkpoint (or a GGUF file's metadata), rendered in a sandbox
with bounds on what one render may cost.

Jinja's sandbox keeps a template away from Python's internals and caps `range` at 100,000 items,
but not the work a template does: two nested `range(100000)` loops ran for hours,
`'x' * 2000000000` built a 2 GB string, and `'x'.ljust(10**10)` or `lipsum(10**9)` the same.
A template comes with a downloaded checkpoint and is rendered for every chat request, so a
render here has a budget: at most `MAX_STEPS` steps, Python calls and lines of the template's
own code (a count, not a clock: the same template passes or fails on every machine), no integer
argument to a call and no repeated string or list beyond `MAX_SIZE`, and at most `MAX_OUTPUT`
characters of output. Real templates (a few hundred steps per conversation) are far below each.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_STEPS = 5_000_000  # Python calls and template lines executed by one render
MAX_SIZE = 1_000_000  # an integer argument, a repeated string's or list's length
MAX_OUTPUT = 64 << 20  # characters rendered


class ChatTemplateError(ValueError):
    """A chat template that raised, or went past a bound, while rendering."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and _repeated_length(left, right) > MAX_SIZE:
            raise SecurityError(f"a repeated string or list longer than {MAX_SIZE:,} items")
        if operator == "**" and _power_bits(left, right) > 64 * MAX_SIZE:
            raise SecurityError(f"an integer power over {64 * MAX_SIZE:,} bits")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SIZE:
                raise SecurityError(f"a call with an integer argument over {MAX_SIZE:,}")
        return super().call(__context, __obj, *args, **kwargs)


def _repeated_length(left: Any, right: Any) -> int:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
            return len(seq) * times
    return 0


def _power_bits(base: Any, exponent: Any) -> int:
    if not (isinstance(base, int) and isinstance(exponent, int)) or abs(base) < 2:
        return 0
    return base.bit_length() * exponent


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same signature as transformers' filter, which templates rely on; Jinja's own tojson
    # escapes HTML characters instead.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.cache
def compile_template(source: str) -> jinja2.Template:
    """The template, compiled once per source; jinja2.TemplateSyntaxError if it does not parse."""
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def check_template(source: str, where: str | Path) -> None:
    """Compile it now, so that a template that does not parse is refused at load, naming
    where it came from, rather than failing every chat request."""
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{where}: the chat template does not parse (line {exc.lineno}: {exc.message})"
        ) from None


class _StepBudget:
    """A trace function counting the render's steps: every Python call, and the lines of the
    template's own code (its loops). Lines inside Jinja's and Python's library functions are
    not traced: tracing them made a render 13x slower (29 -> 390 us for SmolLM2's template),
    and their loops are bounded by the template's own steps and the size bounds."""

    def __init__(self) -> None:
        self.left = MAX_STEPS

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        self._spend()
        return self._line if frame.f_code.co_filename == "<template>" else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self._spend()
        return self._line

    def _spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise ChatTemplateError(
                f"chat template error: the render ran more than {MAX_STEPS:,} steps "
                "(a loop that does not end in reasonable time?)"
            )


def render_template(source: str, **variables: Any) -> str:
    """Render within the module's bounds; ChatTemplateError (a ValueError) names what failed."""
    template = compile_template(source)
    previous = sys.gettrace()
    sys.settrace(_StepBudget())
    try:
        return "".join(_bounded(template.generate(**variables)))
    except SecurityError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from None
    finally:
        sys.settrace(previous)


def _bounded(chunks: Iterator[str]) -> Iterator[str]:
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_OUTPUT:
            raise ChatTemplateError(
                f"chat template error: the render is longer than {MAX_OUTPUT:,} characters"
            )
        yield chunk
