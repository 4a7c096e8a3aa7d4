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
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_STEPS = 5_000_000  # Python calls and template lines executed by one render
MAX_SIZE = 1_000_000  # an integer argument, a repeated string's or list's length
MAX_OUTPUT = 64 << 20  # characters rendered


class ChatTemplateError(ValueError):
    """A chat template that raised, or went past a bound, while rendering."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)  # a str's format or format_map method
        if wrapper is not None:
            _check_format(value.__self__)
        return wrapper


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*" and _repeated_length(left, right) > MAX_SIZE:
        raise SecurityError(f"a repeated string or list longer than {MAX_SIZE:,} items")
    if operator == "*" and _product_bits(left, right) > MAX_SIZE:
        raise SecurityError(f"an integer product over {MAX_SIZE:,} bits")
    if operator == "**" and _power_bits(left, right) > MAX_SIZE:
        raise SecurityError(f"an integer power over {MAX_SIZE:,} bits")
    if operator == "+":
        _check_size(left, right)
    if operator == "%" and isinstance(left, str):
        _check_format(left)


def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SIZE:
            raise SecurityError(f"a call with an integer argument over {MAX_SIZE:,}")


def _check_size(*parts: Any) -> None:
    """Strings or lists joined into one (`+`, `~`) longer than MAX_SIZE: doubling a string in
    a loop reaches gigabytes in 31 steps."""
    if sum(len(p) for p in parts if isinstance(p, (str, list, tuple))) > MAX_SIZE:
        raise SecurityError(f"a joined string or list longer than {MAX_SIZE:,} items")


def _check_format(template: str) -> None:
    """A width or precision in a format string ('%2000001s', '{:>2000001}') makes a string
    that long in one step."""
    if re.search(rf"\d{{{len(str(MAX_SIZE))},}}", template):
        raise SecurityError(f"a format width or precision over {MAX_SIZE:,}")


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """A built-in filter called as a call() is: no integer argument over MAX_SIZE (center,
    indent, truncate, wordwrap widths), no format string with such a width."""

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        if name == "format" and args and isinstance(args[0], str):
            _check_format(args[0])
        return function(*args, **kwargs)

    return bounded


def _bounded_str_join(parts: Iterable[Any]) -> str:
    """`a ~ b` (Jinja compiles it to runtime.str_join) within MAX_SIZE."""
    pieces = [str(p) for p in parts]
    _check_size(*pieces)
    return "".join(pieces)


def _repeated_length(left: Any, right: Any) -> int:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
            return len(seq) * times
    return 0


def _product_bits(left: Any, right: Any) -> int:
    if isinstance(left, int) and isinstance(right, int):
        return left.bit_length() + right.bit_length()
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


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens
    for training): rendered as its body, as transformers and vLLM render it."""

    tags = {"generation"}  # noqa: RUF012 (Jinja declares it so on Extension)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@functools.cache
def compile_template(source: str) -> jinja2.Template:
    """The template, compiled once per source; jinja2.TemplateSyntaxError if it does not parse."""
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    template = env.from_string(source)
    # the compiled module's own name for `~`; its blocks and macros share these globals
    template.root_render_func.__globals__["str_join"] = _bounded_str_join
    return template


def check_template(source: str, where: str | Path) -> None:
    """Compile it now, so that a template that does not parse is refused at load, naming
    where it came from, rather than failing every chat request."""
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{where}: the chat template does not parse (line {exc.lineno}: {exc.message})"
        ) from None
    except RecursionError:
        raise ChatTemplateError(
            f"{where}: the chat template does not parse (nested too deeply)"
        ) from None


class _StepBudget:
    """A trace function counting the render's steps: every Python call, and the lines of the
    template's own code (its loops). Lines inside Jinja's and Python's library functions are
    not traced: tracing them made a render 13x slower (29 -> 390 us for SmolLM2's template),
    and their loops are bounded by the template's own steps and the size bounds.

    It raises only in the template's own code, which has no `except`: raised in a library
    function, a broad `except Exception` there (Jinja's `is sequence` test) would swallow it
    and switch tracing off for the rest of the render. The render also fails afterwards if
    the budget ran out or the trace function was taken away."""

    def __init__(self) -> None:
        self.left = MAX_STEPS

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        self.left -= 1
        if frame.f_code.co_filename != "<template>":
            return None
        self._check()
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.left -= 1
            self._check()
        return self._line

    def _check(self) -> None:
        if self.left < 0:
            raise self.error()

    @staticmethod
    def error() -> ChatTemplateError:
        return ChatTemplateError(
            f"chat template error: the render ran more than {MAX_STEPS:,} steps "
            "(a loop that does not end in reasonable time?)"
        )


def render_template(source: str, **variables: Any) -> str:
    """Render within the module's bounds; ChatTemplateError (a ValueError) names what failed,
    whatever the template raised (an undefined name, 1/0, a bound)."""
    template = compile_template(source)
    budget = _StepBudget()
    previous = sys.gettrace()
    sys.settrace(budget)
    try:
        text = "".join(_bounded(template.generate(**variables)))
        untraced = sys.gettrace() is not budget
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, ArithmeticError, TypeError, ValueError, LookupError) as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from None
    finally:
        sys.settrace(previous)
    if budget.left < 0 or untraced:
        raise budget.error()
    return text


def _bounded(chunks: Iterator[str]) -> Iterator[str]:
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_OUTPUT:
            raise ChatTemplateError(
                f"chat template error: the render is longer than {MAX_OUTPUT:,} characters"
            )
        yield chunk
