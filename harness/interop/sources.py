"""Reading another tool's result files: text, JSON, JSON lines, YAML and CSV, each checked
against a pydantic model of the tool's schema. Every failure is an InteropError whose one line
names the file and what is wrong (not JSON, a key missing, a value of the wrong type)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from harness.interop.errors import InteropError
from harness.run_folder import json_kind, short_json
from models.files import RESULT, UserFileError, read_input_text

Model = TypeVar("Model", bound=BaseModel)


def read_text(path: Path) -> str:
    """A result file whole: a regular file (a FIFO or /dev/zero is refused, not read for ever)
    of at most the limit for result files (models/files.py)."""
    if not path.exists():
        raise InteropError(f"{path}: no such file")
    if path.is_dir():
        raise InteropError(f"{path}: is a folder, not a result file")
    try:
        return read_input_text(path, RESULT)
    except UserFileError as exc:
        raise InteropError(str(exc)) from exc


def parse_json(path: Path, text: str) -> Any:
    """One JSON value. Python's parser also reads the NaN and Infinity that Python tools
    (vLLM, LLMPerf) write with json.dump."""
    if not text.strip():
        raise InteropError(f"{path}: empty file; expected JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InteropError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    except (RecursionError, ValueError) as exc:
        raise InteropError(f"{path}: not usable JSON: {exc}") from exc


def parse_json_documents(path: Path, text: str) -> list[Any]:
    """A JSON value, or one JSON value per line (JSON lines; `vllm bench serve
    --append-result` appends each result as a line of its own)."""
    try:
        return [json.loads(text)]
    except json.JSONDecodeError as whole:
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if len(lines) < 2:
            raise InteropError(
                f"{path}: not valid JSON ({whole.msg} at line {whole.lineno} column {whole.colno})"
            ) from whole
        documents = []
        for number, line in lines:
            try:
                documents.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InteropError(
                    f"{path}: line {number} is not valid JSON ({exc.msg} at column {exc.colno})"
                ) from exc
        return documents
    except (RecursionError, ValueError) as exc:
        raise InteropError(f"{path}: not usable JSON: {exc}") from exc


def parse_yaml(path: Path, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InteropError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from exc


def csv_sections(path: Path, text: str) -> list[list[list[str]]]:
    """A CSV file cut into its sections (runs of rows between blank rows): AIPerf and
    genai-perf write a table of statistics, a blank row, then a table of single values."""
    sections: list[list[list[str]]] = [[]]
    try:
        for row in csv.reader(io.StringIO(text)):
            if not any(cell.strip() for cell in row):
                if sections[-1]:
                    sections.append([])
                continue
            sections[-1].append([cell.strip() for cell in row])
    except csv.Error as exc:
        raise InteropError(f"{path}: not valid CSV: {exc}") from exc
    return [s for s in sections if s]


def validate(model: type[Model], data: Any, path: Path, what: str) -> Model:
    """`data` checked against `model`; an InteropError naming the first key that is missing or
    wrong, and what the file was expected to be."""
    if not isinstance(data, dict):
        raise InteropError(f"{path}: not {what}: expected a JSON object, got {json_kind(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InteropError(f"{path}: not {what}: {describe(exc)}") from exc


def describe(exc: ValidationError) -> str:
    """The first validation error as `missing key 'a.b'` or `key 'a.b': <why> (got <value>)`."""
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"])
    if first["type"] == "missing":
        text = f"missing key '{where}'"
    else:
        text = f"key '{where}': {first['msg']} (got {short_json(first.get('input'))})"
    return text + (f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else "")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
