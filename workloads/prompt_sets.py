"""Prompt set loaders: ShareGPT JSON, MT-Bench JSONL, plain text (one prompt per line).

Each loader returns `PromptItem`s (a conversation's user turns, in order) plus what it skipped
and why. Malformed files raise ValueError naming the file, where (a line, or for the single
JSON document of ShareGPT the 1-based entry), and the field. Files may be gzip-compressed
and named `.gz`; binary, otherwise compressed or non-UTF-8 files are refused by name
(workloads/trace_files.py).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.trace_files import read_text, text_lines

PROMPT_FORMATS = ("sharegpt", "mt_bench", "text")
_USER_ROLES = ("human", "user")
_REPLY_ROLES = ("gpt", "chatgpt", "assistant", "bard", "model")


@dataclass(frozen=True)
class PromptItem:
    item_id: str
    turns: tuple[str, ...]  # the user messages, in order (MT-Bench: 2; others: 1)
    reference_output: str | None = None  # ShareGPT: the reply that followed the prompt
    category: str | None = None


@dataclass(frozen=True)
class PromptSet:
    path: str
    format: str
    items: tuple[PromptItem, ...]
    items_read: int
    skipped: dict[str, int]


def load_prompt_set(path: str | Path, fmt: str) -> PromptSet:
    loader = {"sharegpt": _sharegpt, "mt_bench": _mt_bench, "text": _text}[fmt]
    items, read, skipped = loader(str(path))
    if not items:
        raise ValueError(f"{path}: no usable prompts ({read} read, skipped: {dict(skipped)})")
    return PromptSet(str(path), fmt, tuple(items), read, dict(skipped))


def _sharegpt(path: str) -> tuple[list[PromptItem], int, Counter[str]]:
    text = read_text(path)
    if not text.strip():
        raise ValueError(f"{path}: line 1: empty file (expected a JSON array)")
    data = _json(text, path)
    if not isinstance(data, list):
        raise ValueError(f"{path}: line 1: expected a JSON array of conversations")
    items: list[PromptItem] = []
    skipped: Counter[str] = Counter()
    for index, entry in enumerate(data, start=1):
        where = f"{path}: entry {index}"
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"{where}: field 'conversations': expected a list of turns")
        for t, turn in enumerate(turns):
            if not (
                isinstance(turn, dict)
                and isinstance(turn.get("from"), str)
                and isinstance(turn.get("value"), str)
            ):
                raise ValueError(
                    f'{where}: field \'conversations[{t}]\': expected {{"from": str, "value": str}}'
                )
        first = next((t for t, turn in enumerate(turns) if turn["from"] in _USER_ROLES), None)
        if first is None:
            skipped["no_human_turn"] += 1
            continue
        prompt = turns[first]["value"]
        if not prompt.strip():
            skipped["empty_prompt"] += 1
            continue
        after = turns[first + 1] if first + 1 < len(turns) else None
        reply = after["value"] if after and after["from"] in _REPLY_ROLES else None
        item_id = str(entry.get("id", index))
        items.append(PromptItem(item_id, (prompt,), reply or None))
    return items, len(data), skipped


def _json(text: str, path: str, line: int | None = None) -> Any:
    """The JSON value of a whole file (line None) or of one line of it; a ValueError naming
    the file and the line where it does not parse."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: line {line or exc.lineno}: invalid JSON ({exc.msg}, column {exc.colno})"
        ) from exc
    except RecursionError as exc:
        where = f"line {line}: " if line is not None else ""
        raise ValueError(f"{path}: {where}invalid JSON (nested too deeply)") from exc


def _mt_bench(path: str) -> tuple[list[PromptItem], int, Counter[str]]:
    items: list[PromptItem] = []
    read = 0
    for line, text in text_lines(path):
        if not text.strip():
            continue
        record = _json(text, path, line)
        where = f"{path}: line {line}"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object")
        if "question_id" not in record:
            raise ValueError(f"{where}: field 'question_id': missing value")
        turns = record.get("turns")
        if not (
            isinstance(turns, list)
            and turns
            and all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise ValueError(
                f"{where}: field 'turns': expected a non-empty list of non-empty strings"
            )
        category = record.get("category")
        read += 1
        items.append(
            PromptItem(
                str(record["question_id"]),
                tuple(turns),
                category=category if isinstance(category, str) else None,
            )
        )
    if read == 0:
        raise ValueError(f"{path}: line 1: empty file (no JSON lines)")
    return items, read, Counter()


def _text(path: str) -> tuple[list[PromptItem], int, Counter[str]]:
    items: list[PromptItem] = []
    for line, prompt in text_lines(path):
        if prompt.strip():  # blank lines separate paragraphs; they are not prompts
            items.append(PromptItem(f"line{line}", (prompt,)))
    if not items:
        raise ValueError(f"{path}: line 1: empty file (no non-empty lines)")
    return items, len(items), Counter()
