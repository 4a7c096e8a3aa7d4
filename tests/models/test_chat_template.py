"""A checkpoint's chat template is rendered within bounds: steps run, the size of a repeated
string or list, integer arguments, output length. Before, nested `range(100000)` loops ran for
hours (a run killed by its timeout), `'x' * 2000000000` built a 2 GB string in 36 s (8 GB of
memory) and `'x'.ljust(10**10)` the same; each cheaper case below rendered without a word, each
costly one is refused at once, as one line naming the chat template and the bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import write_tiny_checkpoint

from models import chat_template
from models.tokenizer import Tokenizer, load_tokenizer

HI = [{"role": "user", "content": "hi"}]
#: a value squared (joined with itself) 40 times, kept in a namespace: no output to bound
DOUBLING = (
    "{{% set ns = namespace(v={start}) %}}{{% for i in range(40) %}}"
    "{{% set ns.v = ns.v {op} ns.v %}}{{% endfor %}}{{{{ 1 }}}}"
)


def with_template(tmp_path: Path, template: str) -> Tokenizer:
    folder = write_tiny_checkpoint(tmp_path / "ckpt")
    (folder / "chat_template.jinja").write_text(template)
    return load_tokenizer(folder)


@pytest.mark.parametrize(
    ("template", "says"),
    [
        (
            "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}x",
            "the render ran more than 5,000,000 steps",
        ),
        ("{{ 'x' * 2000000 }}", "a repeated string or list longer than 1,000,000 items"),
        ("{{ ([1] * 2000000) | length }}", "a repeated string or list longer than 1,000,000"),
        ("{{ 'x'.ljust(2000000) }}", "a call with an integer argument over 1,000,000"),
        ("{{ (lipsum(2000000)) | length }}", "a call with an integer argument over 1,000,000"),
        ("{{ (7 ** 70000000) % 10 }}", "an integer power over 1,000,000 bits"),
        # each of these rendered gigabytes (or ran for seconds) past the first bounds
        (DOUBLING.format(op="~", start="'x'"), "a joined string or list longer than 1,000,000"),
        (DOUBLING.format(op="+", start="[1]"), "a joined string or list longer than 1,000,000"),
        (DOUBLING.format(op="*", start="7"), "an integer product over 1,000,000 bits"),
        ("{{ '%2000001s' % 'x' }}", "a format width or precision over 1,000,000"),
        ("{{ '{:>2000001}'.format('x') }}", "a format width or precision over 1,000,000"),
        ("{{ '%2000001s' | format('x') }}", "a format width or precision over 1,000,000"),
        ("{{ 'x' | center(2000001) }}", "a call with an integer argument over 1,000,000"),
        ("{{ 1 / 0 }}", "division by zero"),
        ("{{ undefined_name.field }}", "'undefined_name' is undefined"),
        (
            "{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}",
            "the render is longer than 67,108,864 characters",
        ),
    ],
)
def test_a_costly_template_is_refused_naming_the_bound(
    tmp_path: Path, template: str, says: str
) -> None:
    tok = with_template(tmp_path, template)
    with pytest.raises(ValueError) as refused:
        tok.apply_chat_template(HI)
    assert str(refused.value).startswith(f"chat template error: {says}")


def test_a_budget_swallowed_by_library_code_still_stops_the_render(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jinja's `is sequence` test catches any exception around len(): a budget that ran out
    inside it was swallowed, tracing stopped, and the loops after it ran unbounded."""
    monkeypatch.setattr(chat_template, "MAX_STEPS", 1000)
    for padding in (0, 4, 8):  # the step on which the budget runs out
        template = (
            f"{{% for k in range({padding}) %}}{{% endfor %}}"
            "{% for i in range(400) %}{{ u is sequence }}{% endfor %}"
            "{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}"
        )
        with pytest.raises(ValueError, match="the render ran more than 1,000 steps"):
            chat_template.render_template(template)


def test_raise_exception_and_an_ordinary_template_still_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^chat template error: nope$"):
        with_template(tmp_path / "a", "{{ raise_exception('nope') }}").apply_chat_template(HI)
    ordinary = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        "{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ '%-5s' | format('x') }}|"
        "{% generation %}{{ 'ab' ~ 'c' }}{% endgeneration %}"  # transformers' training tag
    )
    rendered = with_template(tmp_path / "b", ordinary).apply_chat_template(HI)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nababab1024x    |abc"


@pytest.mark.parametrize(
    ("config", "jinja", "says"),
    [
        (None, "{% for %}", "chat_template.jinja: the chat template does not parse (line 1: "),
        (
            {"chat_template": "{{ x "},
            None,
            "tokenizer_config.json: chat_template: the chat template does not parse (line 1: ",
        ),
        (  # an AttributeError ('int' object has no attribute 'get'), exit 1, before
            {"chat_template": [1, "x"]},
            None,
            "tokenizer_config.json: chat_template: [1, 'x'] is invalid; allowed: a Jinja",
        ),
        (  # ignored without a word before: the plain fallback template was used
            {"chat_template": 42},
            None,
            "tokenizer_config.json: chat_template: 42 is invalid; allowed: a Jinja",
        ),
    ],
)
def test_a_template_that_cannot_be_used_is_refused_at_load_naming_the_file(
    tmp_path: Path, config: dict | None, jinja: str | None, says: str
) -> None:
    """Before, a template that does not parse loaded, and every chat request failed with
    'TemplateSyntaxError: ...' naming no file."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt")
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    with pytest.raises(ValueError) as refused:
        load_tokenizer(folder)
    assert str(refused.value).startswith(f"{folder}/{says}")
