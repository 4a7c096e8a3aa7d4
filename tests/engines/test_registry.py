"""One registry pattern for every plug point (engines/registry.py), listed by `inferlab list`."""

from __future__ import annotations

import pytest

from engines.registry import Registry
from harness.listing import listing


def test_every_plug_point_is_listed_with_its_entries() -> None:
    lines = dict(line.split(maxsplit=1) for line in listing().splitlines())
    assert lines["engine.backend"] == "builtin|hf|llamacpp|openai"
    assert lines["engine.attention_backend"].split("|") == [
        "auto",
        "torch",
        "sdpa",
        "triton",
        "cpu",
    ]
    assert lines["engine.quantization"] == "none|int8|int4|auto|fp8"
    assert lines["engine.kv_cache"] == "none|contiguous|paged"
    assert lines["workload.type"] == "synthetic|trace|prompts|tool_calls"


def test_an_unknown_name_names_the_key_and_the_allowed_values() -> None:
    registry = Registry[int]("test.plug_point", extra_values=("auto",), listed=False)
    registry.add("one", 1)

    @registry.register("two")
    def two() -> None: ...

    assert registry.get("one") == 1 and registry["two"] is two and list(registry) == ["one", "two"]
    with pytest.raises(
        ValueError,
        match=r"test.plug_point: 'three' is invalid; allowed: "
        r"auto\|one\|two",
    ):
        registry.get("three")
    with pytest.raises(ValueError, match="registered twice"):
        registry.add("one", 2)


def test_inferlab_list_takes_no_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """`inferlab list extra` (or `list --json`) printed the listing and exited 0, the argument
    silently ignored."""
    from harness import cli

    assert cli.main(["list", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == "inferlab list: takes no arguments; got ['--json']"
    assert cli.main(["list"]) == 0
