"""`run.accuracy`: a multiple-choice task scored on the run's own backend after its measured
requests, so that a run's accuracy sits beside its speed and `inferlab gate` can fail a variant
on it (docs/accuracy.md).

Tasks are lm-evaluation-harness YAML files of `output_type: multiple_choice` over a local JSON
lines file (data/tasks/inferlab_mc.yaml): `doc_to_text`, `doc_to_choice`, `doc_to_target` as
Jinja templates, `target_delimiter` (default " "). Each choice is scored as lm-eval scores it:
the loglikelihood of `target_delimiter + choice` after the context, tokenized by lm-eval's rule
(context and context + continuation encoded without special tokens, the continuation being the
tokens past the context's; trailing spaces of the context moved to the continuation), from the
backend's prompt log-probabilities (SamplingParams.prompt_logprobs). `accuracy` is the fraction
of items whose highest-scoring choice is the target (lm-eval's `acc`).
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from engines.base import Backend, Failed, GenerationRequest, PromptLogprobs
from engines.sampling_params import SamplingParams
from harness.measuring.trackers import Tracker

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "data" / "tasks"
_JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined)


class AccuracyTaskError(ValueError):
    """A task file run.accuracy cannot score; the message names the key or file."""


@dataclass(frozen=True)
class Item:
    context: str
    choices: list[str]
    target: int


def task_path(task: str) -> Path:
    """A task name of data/tasks (inferlab_mc) or a YAML file's path."""
    path = Path(task)
    if path.suffix not in (".yaml", ".yml"):
        path = TASKS_DIR / f"{task}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))
        raise AccuracyTaskError(
            f"run.accuracy.task: {task!r} is not a task; allowed: {'|'.join(known)} or the "
            "path of an lm-eval multiple_choice task YAML"
        )
    return path


def _render(template: Any, doc: dict[str, Any]) -> Any:
    """A field of the task over one document: `{{name}}` alone is the document's value as it
    is (a list stays a list), any other template renders to text."""
    if not isinstance(template, str):
        return template
    name = template.strip()
    if name.startswith("{{") and name.endswith("}}") and name[2:-2].strip() in doc:
        return doc[name[2:-2].strip()]
    return _JINJA.from_string(template).render(**doc)


def load_items(task: str, limit: int | None = None) -> tuple[str, list[Item]]:
    """The task's name and its items, from its YAML and its local data file."""
    path = task_path(task)
    spec = yaml.safe_load(path.read_text()) or {}
    if spec.get("output_type") != "multiple_choice":
        raise AccuracyTaskError(
            f"run.accuracy.task: {path}: output_type {spec.get('output_type')!r}; allowed: "
            "multiple_choice"
        )
    files = (spec.get("dataset_kwargs") or {}).get("data_files") or {}
    split = spec.get("test_split", "test")
    data = files.get(split) if isinstance(files, dict) else None
    if spec.get("dataset_path") != "json" or not isinstance(data, str):
        raise AccuracyTaskError(
            f"run.accuracy.task: {path}: needs dataset_path: json and dataset_kwargs.data_files."
            f"{split}: a local JSON lines file"
        )
    data_path = Path(data) if Path(data).is_absolute() else REPO / data
    docs = [json.loads(line) for line in data_path.read_text().splitlines() if line.strip()]
    items = []
    for doc in docs[:limit]:
        choices = _render(spec["doc_to_choice"], doc)
        if isinstance(choices, str):
            choices = ast.literal_eval(choices)
        target = _render(spec["doc_to_target"], doc)
        target = choices.index(target) if target in choices else int(target)
        delimiter = spec.get("target_delimiter", " ")
        items.append(
            Item(_render(spec["doc_to_text"], doc), [delimiter + c for c in choices], target)
        )
    return str(spec.get("task", path.stem)), items


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair`: the context's tokens and the continuation's, the latter being
    what the whole text has past the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    head = tokenizer.encode(context, add_special_tokens=False)
    return head, whole[len(head) :]


async def _prompt_logprobs(backend: Backend, request_id: str, ids: list[int]) -> list[float]:
    """The log-probability of each token of `ids` after the first, from the backend."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    found: list[float] | None = None
    async for event in backend.generate(GenerationRequest(request_id, ids, params)):
        if isinstance(event, PromptLogprobs):
            found = [e.logprob for e in event.logprobs[1:] if e is not None]
        elif isinstance(event, Failed):
            raise RuntimeError(f"run.accuracy: request {request_id} failed: {event.error}")
    if found is None:
        raise AccuracyTaskError(
            f"run.accuracy: the {backend.name} backend reports no prompt log-probabilities; "
            "allowed: engine=builtin"
        )
    return found


async def score_items(backend: Backend, items: list[Item]) -> list[list[float]]:
    """Each item's choices' loglikelihoods, every request in flight at once."""
    tokenizer = getattr(backend, "tokenizer", None)
    pairs = [[encode_pair(tokenizer, item.context, c) for c in item.choices] for item in items]

    async def one(i: int, j: int) -> float:
        head, tail = pairs[i][j]
        scores = await _prompt_logprobs(backend, f"accuracy-{i}-{j}", head + tail)
        return math.fsum(scores[len(head) - 1 :])

    flat = [(i, j) for i, row in enumerate(pairs) for j in range(len(row))]
    values = await asyncio.gather(*(one(i, j) for i, j in flat))
    out: list[list[float]] = [[] for _ in items]
    for (i, _), value in zip(flat, values, strict=True):
        out[i].append(value)
    return out


class AccuracyTracker(Tracker):
    name = "accuracy"

    def __init__(self, task: str, limit: int | None) -> None:
        self.task, self.items = load_items(task, limit)  # a bad task stops the run at once
        self.result: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, settings: dict[str, Any]) -> AccuracyTracker | None:
        task = settings.get("task")
        return None if task is None else cls(task, settings.get("limit"))

    def stop(self, backend: Backend, engine: dict[str, Any]) -> None:
        scores = asyncio.run(score_items(backend, self.items))
        correct = [
            row.index(max(row)) == item.target for row, item in zip(scores, self.items, strict=True)
        ]
        self.result = {
            "task": self.task,
            "items": len(self.items),
            "loglikelihoods": scores,
            "metrics": {"accuracy": sum(correct) / len(correct), "accuracy_items": len(correct)},
        }

    def results(self, run_dir: Path, t0_ns: int | None) -> dict[str, Any]:
        return {} if self.result is None else {"accuracy": self.result}
