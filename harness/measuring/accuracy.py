"""`run.accuracy`: an lm-evaluation-harness task scored on the run's own backend after its
measured requests, so that a run's accuracy sits beside its speed and `inferlab gate` can fail a
variant on it (docs/accuracy.md).

Tasks are lm-eval task YAML files over a local JSON lines file (data/tasks/), of two kinds:

- `output_type: multiple_choice` (data/tasks/inferlab_mc.yaml): each choice is scored as lm-eval
  scores it, the loglikelihood of `target_delimiter + choice` after the context, tokenized by
  lm-eval's rule (context and context + continuation encoded without special tokens, the
  continuation being the tokens past the context's; trailing spaces of the context moved to the
  continuation), from the backend's prompt log-probabilities (SamplingParams.prompt_logprobs).
  `accuracy` is the fraction of items whose highest-scoring choice is the target (lm-eval's
  `acc`).
- `output_type: generate_until` (data/tasks/inferlab_gen.yaml): one greedy generation per item
  (`generation_kwargs`: `until`, `max_gen_toks`), cut at the first `until` string (or the
  tokenizer's EOS text) as lm-eval cuts it, passed through each `filter_list` pipeline (`regex`,
  `take_first`) and compared with the target by `exact_match` (`ignore_case`,
  `ignore_punctuation`, `ignore_numbers`, `regexes_to_ignore`), lm-eval's definitions.
  `accuracy` is the first pipeline's `exact_match`.

The fields are read as lm-eval reads them (`doc_to_text`, `doc_to_target`, `doc_to_choice`: a
column's name or a Jinja template); a key, filter, metric or option this module does not
implement is refused with an AccuracyTaskError naming it and the allowed values, never ignored.
`run.accuracy.apply_chat_template` is lm-eval's `--apply_chat_template`: the context becomes a
user message under the model's chat template.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import yaml

from engines.base import Backend, Failed, Finished, GenerationRequest, Prompt, PromptLogprobs
from engines.sampling_params import SamplingParams
from harness.measuring.trackers import Tracker

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "data" / "tasks"


def _regex_replace(value: str, pattern: str, repl: str, count: int = 0) -> str:
    return re.sub(pattern, repl, value, count=count)


# lm-eval's template environment (lm_eval.utils): trailing newlines kept, `regex_replace`
_JINJA = jinja2.Environment(
    loader=jinja2.BaseLoader(), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
)
_JINJA.filters["regex_replace"] = _regex_replace

OUTPUT_TYPES = ("multiple_choice", "generate_until")
METRICS = {"multiple_choice": ("acc",), "generate_until": ("exact_match",)}
EXACT_MATCH_OPTIONS = ("ignore_case", "ignore_punctuation", "ignore_numbers", "regexes_to_ignore")
FILTERS = ("regex", "take_first")
REGEX_OPTIONS = ("regex_pattern", "group_select", "fallback")
GENERATION_KWARGS = (
    "until",
    "max_gen_toks",
    "max_new_tokens",
    "max_tokens",
    "max_completion_tokens",
    "do_sample",
    "temperature",
)
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default (lm_eval.defaults)
DEFAULT_REGEX = r"#### (\-?[0-9\.\,]+)"  # lm-eval's RegexFilter default pattern
DEFAULT_FALLBACK = "[invalid]"
# Keys of an lm-eval task read here, and keys that change no score of a zero-shot task run on
# its test split (descriptive, or used only for few-shot examples or decontamination).
TASK_KEYS = (
    "task",
    "dataset_path",
    "dataset_kwargs",
    "test_split",
    "validation_split",
    "output_type",
    "doc_to_text",
    "doc_to_target",
    "doc_to_choice",
    "target_delimiter",
    "fewshot_delimiter",
    "generation_kwargs",
    "filter_list",
    "metric_list",
    "num_fewshot",
    "description",
    "repeats",
)
INERT_KEYS = (
    "tag",
    "task_alias",
    "metadata",
    "training_split",
    "fewshot_split",
    "should_decontaminate",
    "doc_to_decontamination_query",
)


class AccuracyTaskError(ValueError):
    """A task file run.accuracy cannot score; the message names the key or file."""


@dataclass(frozen=True)
class Item:
    """A multiple-choice item: the context, each choice with its delimiter, the target's index."""

    context: str
    choices: list[str]
    target: int


@dataclass(frozen=True)
class GenItem:
    """A generation item: the context and its target (several: any one matches, as lm-eval
    scores a task whose doc_to_target gives a list)."""

    context: str
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Filter:
    function: str  # one of FILTERS
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pipeline:
    """One entry of lm-eval's `filter_list`: a name and its filters in order."""

    name: str
    filters: tuple[Filter, ...]


@dataclass(frozen=True)
class ChoiceTask:
    name: str
    items: list[Item]
    apply_chat_template: bool = False
    output_type: str = "multiple_choice"


@dataclass(frozen=True)
class GenerationTask:
    name: str
    items: list[GenItem]
    until: tuple[str, ...]
    max_gen_toks: int
    pipelines: tuple[Pipeline, ...]
    exact_match: dict[str, Any]  # exact_match's options (EXACT_MATCH_OPTIONS)
    apply_chat_template: bool = False
    output_type: str = "generate_until"


Task = ChoiceTask | GenerationTask


def task_path(task: str) -> Path:
    """A task name of data/tasks (inferlab_mc) or a YAML file's path."""
    path = Path(task)
    if path.suffix not in (".yaml", ".yml"):
        path = TASKS_DIR / f"{task}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))
        raise AccuracyTaskError(
            f"run.accuracy.task: {task!r} is not a task; allowed: {'|'.join(known)} or the "
            "path of an lm-eval task YAML (output_type multiple_choice or generate_until)"
        )
    return path


# ---- lm-eval's document fields ------------------------------------------------------------


def doc_to_text(template: Any, doc: dict[str, Any]) -> str:
    """lm-eval's ConfigurableTask.doc_to_text: a column's name is its value, else a template."""
    if isinstance(template, str) and template in doc:
        return str(doc[template])
    return _JINJA.from_string(str(template)).render(**doc)


def doc_to_choice(template: Any, doc: dict[str, Any]) -> list[str]:
    """lm-eval's doc_to_choice: a column, a template rendering a list literal, or a list."""
    if isinstance(template, list):
        return [str(c) for c in template]
    if isinstance(template, dict):
        return [str(c) for c in template.values()]
    if template in doc:
        choices = doc[template]
    else:
        choices = ast.literal_eval(_JINJA.from_string(str(template)).render(**doc))
    if not isinstance(choices, list):
        raise AccuracyTaskError(f"doc_to_choice: {choices!r} is not a list")
    return [str(c) for c in choices]


def doc_to_target(template: Any, doc: dict[str, Any], has_choices: bool) -> Any:
    """lm-eval's doc_to_target: a column's value as it is; else the rendered template, a number
    when it is digits and the task has choices, a list when it renders a list literal."""
    if isinstance(template, int | list):
        return template
    if template in doc:
        return doc[template]
    text = _JINJA.from_string(str(template)).render(**doc)
    if text.isdigit() and has_choices:
        return ast.literal_eval(text)
    if len(text) >= 2 and text[0] == "[" and text[-1] == "]":
        try:
            return ast.literal_eval(text)
        except (SyntaxError, ValueError):
            return text
    return text


# ---- lm-eval's filters and exact_match ---------------------------------------------------


def regex_filter(
    response: Any,
    regex_pattern: str = DEFAULT_REGEX,
    group_select: int = 0,
    fallback: str = DEFAULT_FALLBACK,
) -> str:
    """lm-eval's `regex` filter on one response: `re.findall`'s `group_select`-th match
    (negative counts from the end), the first non-empty group of a match with several, stripped;
    `fallback` where nothing matches (or no group of the match is non-empty)."""
    if not isinstance(response, str):
        response = ""
    matches = re.findall(regex_pattern, response)
    if not matches:
        return fallback
    try:
        match = matches[group_select]
    except IndexError:
        raise AccuracyTaskError(
            f"filter regex: group_select {group_select} but {regex_pattern!r} matched "
            f"{len(matches)} time(s) in {response!r} (lm-eval fails the same way)"
        ) from None
    if isinstance(match, tuple):
        found = [m for m in match if m]
        match = found[0] if found else fallback
    return str(match).strip()


def apply_pipeline(pipeline: Pipeline, responses: Sequence[str]) -> str:
    """A pipeline over one item's responses (one: lm-eval's `repeats: 1`): each `regex` maps
    every response, `take_first` keeps the first; the item's filtered response."""
    values: list[str] = list(responses)
    for f in pipeline.filters:
        if f.function == "regex":
            values = [regex_filter(v, **f.options) for v in values]
        else:  # take_first, the last filter (load_task checks)
            values = values[:1]
    return values[0]


def exact_match(
    prediction: str,
    reference: str,
    ignore_case: bool = False,
    ignore_punctuation: bool = False,
    ignore_numbers: bool = False,
    regexes_to_ignore: Sequence[str] | None = None,
) -> bool:
    """lm-eval's exact_match (HF evaluate's): each regex of `regexes_to_ignore` removed from
    both, then lowercased, ASCII punctuation (string.punctuation) removed, digits removed, each
    where asked, and compared as numpy strings compare them (as lm-eval does, numpy's own
    lowercasing and its trailing-NUL rule included)."""
    predictions, references = np.asarray([prediction]), np.asarray([reference])
    for pattern in regexes_to_ignore or ():
        predictions = np.array([re.sub(pattern, "", x) for x in predictions])
        references = np.array([re.sub(pattern, "", x) for x in references])
    if ignore_case:
        predictions, references = np.char.lower(predictions), np.char.lower(references)
    if ignore_punctuation:
        table: Any = str.maketrans("", "", string.punctuation)  # numpy's stubs say str
        predictions = np.char.translate(predictions, table=table)
        references = np.char.translate(references, table=table)
    if ignore_numbers:
        table = str.maketrans("", "", string.digits)
        predictions = np.char.translate(predictions, table=table)
        references = np.char.translate(references, table=table)
    return bool((predictions == references)[0])


def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """lm-eval's postprocess_generated_text: the text before each non-empty stop string, in
    order (so before the first occurrence of any)."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


# ---- loading a task -----------------------------------------------------------------------


def _refuse(path: Path, key: str, value: Any, allowed: str) -> AccuracyTaskError:
    return AccuracyTaskError(f"run.accuracy.task: {path}: {key}: {value!r}; allowed: {allowed}")


def _check_keys(path: Path, spec: dict[str, Any], output_type: str) -> None:
    unknown = sorted(k for k in spec if k not in TASK_KEYS + INERT_KEYS)
    if unknown:
        raise AccuracyTaskError(
            f"run.accuracy.task: {path}: key(s) {unknown} not supported; allowed: "
            f"{sorted(TASK_KEYS + INERT_KEYS)}"
        )
    if spec.get("num_fewshot") not in (None, 0):
        raise _refuse(path, "num_fewshot", spec["num_fewshot"], "0 or null (zero-shot only)")
    if spec.get("description") not in (None, ""):
        raise _refuse(path, "description", spec["description"], '"" (none)')
    if spec.get("repeats", 1) != 1:
        raise _refuse(path, "repeats", spec["repeats"], "1")
    if output_type == "multiple_choice":
        for key in ("generation_kwargs", "filter_list"):
            if spec.get(key) is not None:
                raise _refuse(path, key, spec[key], "none with output_type multiple_choice")
        if spec.get("doc_to_choice") is None:
            raise _refuse(path, "doc_to_choice", None, "a column or template giving the choices")


def _metric_options(path: Path, spec: dict[str, Any], output_type: str) -> dict[str, Any]:
    """The task's one metric (METRICS[output_type]) and its options; the default when the task
    names none, as lm-eval does."""
    allowed = METRICS[output_type]
    metrics = spec.get("metric_list")
    if metrics is None:
        return {}
    if not isinstance(metrics, list) or len(metrics) != 1 or not isinstance(metrics[0], dict):
        raise _refuse(path, "metric_list", metrics, f"one metric: {'|'.join(allowed)}")
    entry = dict(metrics[0])
    name = entry.pop("metric", None)
    if name not in allowed:
        raise _refuse(path, "metric_list[0].metric", name, "|".join(allowed))
    if entry.pop("aggregation", "mean") != "mean":
        raise _refuse(path, "metric_list[0].aggregation", metrics[0]["aggregation"], "mean")
    if entry.pop("higher_is_better", True) is not True:
        raise _refuse(
            path, "metric_list[0].higher_is_better", metrics[0]["higher_is_better"], "true"
        )
    options = EXACT_MATCH_OPTIONS if name == "exact_match" else ()
    for key, value in entry.items():
        if key not in options:
            raise AccuracyTaskError(
                f"run.accuracy.task: {path}: metric_list[0].{key}: not an option of {name}; "
                f"allowed: {'|'.join(options) or 'none'}"
            )
        if key == "regexes_to_ignore":
            if value is not None and (
                not isinstance(value, list) or not all(isinstance(p, str) for p in value)
            ):
                raise _refuse(path, f"metric_list[0].{key}", value, "a list of regexes")
        elif not isinstance(value, bool):
            raise _refuse(path, f"metric_list[0].{key}", value, "true|false")
    return entry


def _generation(path: Path, spec: dict[str, Any]) -> tuple[tuple[str, ...], int]:
    """`until` and `max_gen_toks` from generation_kwargs, as lm-eval normalizes them; greedy
    only."""
    delimiter = spec.get("fewshot_delimiter", "\n\n")
    kwargs = spec.get("generation_kwargs")
    if kwargs is None:
        return (delimiter,), DEFAULT_MAX_GEN_TOKS
    if not isinstance(kwargs, dict):
        raise _refuse(path, "generation_kwargs", kwargs, "a mapping")
    for key in kwargs:
        if key not in GENERATION_KWARGS:
            raise AccuracyTaskError(
                f"run.accuracy.task: {path}: generation_kwargs.{key}: not supported; allowed: "
                f"{'|'.join(GENERATION_KWARGS)}"
            )
    until = kwargs.get("until", [delimiter])
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, list) or not all(isinstance(u, str) for u in until):
        raise _refuse(path, "generation_kwargs.until", until, "a string or a list of strings")
    # lm-eval's priority: max_gen_toks > max_new_tokens > max_tokens > max_completion_tokens
    given = [kwargs[k] for k in GENERATION_KWARGS[1:5] if kwargs.get(k) is not None]
    max_gen_toks = given[0] if given else DEFAULT_MAX_GEN_TOKS
    if not isinstance(max_gen_toks, int) or isinstance(max_gen_toks, bool) or max_gen_toks < 1:
        raise _refuse(path, "generation_kwargs.max_gen_toks", max_gen_toks, "an integer >= 1")
    temperature = kwargs.get("temperature", 0.0)
    do_sample = kwargs.get("do_sample")
    if not isinstance(temperature, int | float) or isinstance(temperature, bool):
        raise _refuse(path, "generation_kwargs.temperature", temperature, "a number")
    # lm-eval: do_sample false is greedy whatever the temperature; unset, temperature decides
    if do_sample is True or (do_sample is None and temperature > 0):
        raise AccuracyTaskError(
            f"run.accuracy.task: {path}: generation_kwargs: do_sample={do_sample}, "
            f"temperature={temperature} samples; allowed: do_sample: false or temperature: 0 "
            "(greedy)"
        )
    if do_sample not in (None, False):
        raise _refuse(path, "generation_kwargs.do_sample", do_sample, "false")
    return tuple(until), max_gen_toks


def _pipelines(path: Path, spec: dict[str, Any]) -> tuple[Pipeline, ...]:
    """filter_list, checked; lm-eval's default (`none`: take_first) when there is none."""
    entries = spec.get("filter_list")
    if entries is None:
        return (Pipeline("none", (Filter("take_first"),)),)
    if not isinstance(entries, list) or not entries:
        raise _refuse(path, "filter_list", entries, "a list of {name, filter: [...]}")
    pipelines = []
    for i, entry in enumerate(entries):
        where = f"filter_list[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"name", "filter"}:
            raise _refuse(path, where, entry, "{name, filter: [{function, ...}]}")
        steps = entry.get("filter")
        if not isinstance(steps, list) or not steps:
            raise _refuse(path, f"{where}.filter", steps, "a non-empty list of filters")
        filters = []
        for j, step in enumerate(steps):
            at = f"{where}.filter[{j}]"
            options = dict(step) if isinstance(step, dict) else {}
            function = options.pop("function", None)
            if function not in FILTERS:
                raise _refuse(path, f"{at}.function", function, "|".join(FILTERS))
            allowed = REGEX_OPTIONS if function == "regex" else ()
            for key in options:
                if key not in allowed:
                    raise AccuracyTaskError(
                        f"run.accuracy.task: {path}: {at}.{key}: not an option of {function}; "
                        f"allowed: {'|'.join(allowed) or 'none'}"
                    )
            if function == "regex":
                _check_regex(path, at, options)
            elif j != len(steps) - 1:
                raise _refuse(path, f"{at}.function", function, "take_first as the last filter")
            filters.append(Filter(function, options))
        pipelines.append(Pipeline(str(entry.get("name", "none")), tuple(filters)))
    names = [p.name for p in pipelines]
    if len(set(names)) != len(names):
        raise _refuse(path, "filter_list", names, "distinct names")
    return tuple(pipelines)


def _check_regex(path: Path, at: str, options: dict[str, Any]) -> None:
    pattern = options.get("regex_pattern", DEFAULT_REGEX)
    try:
        re.compile(pattern)
    except (re.error, TypeError) as exc:
        raise _refuse(path, f"{at}.regex_pattern", pattern, f"a Python regex ({exc})") from None
    group = options.get("group_select", 0)
    if not isinstance(group, int) or isinstance(group, bool):
        raise _refuse(path, f"{at}.group_select", group, "an integer (negative: from the end)")
    if not isinstance(options.get("fallback", DEFAULT_FALLBACK), str):
        raise _refuse(path, f"{at}.fallback", options["fallback"], "a string")


def _docs(path: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    files = (spec.get("dataset_kwargs") or {}).get("data_files") or {}
    split = spec.get("test_split") or spec.get("validation_split") or "test"
    data = files.get(split) if isinstance(files, dict) else None
    if spec.get("dataset_path") != "json" or not isinstance(data, str):
        raise AccuracyTaskError(
            f"run.accuracy.task: {path}: needs dataset_path: json and dataset_kwargs.data_files."
            f"{split}: a local JSON lines file"
        )
    data_path = Path(data) if Path(data).is_absolute() else REPO / data
    return [json.loads(line) for line in data_path.read_text().splitlines() if line.strip()]


def load_task(task: str, limit: int | None = None, apply_chat_template: bool = False) -> Task:
    """The task from its YAML and its local data file, every key checked."""
    path = task_path(task)
    spec = yaml.safe_load(path.read_text()) or {}
    if not isinstance(spec, dict):
        raise AccuracyTaskError(f"run.accuracy.task: {path}: not a mapping of task keys")
    output_type = spec.get("output_type", "generate_until")  # lm-eval's default
    if output_type not in OUTPUT_TYPES:
        raise _refuse(path, "output_type", output_type, "|".join(OUTPUT_TYPES))
    _check_keys(path, spec, output_type)
    metric = _metric_options(path, spec, output_type)
    name = str(spec.get("task", path.stem))
    docs = _docs(path, spec)[:limit]
    if "doc_to_text" not in spec or "doc_to_target" not in spec:
        raise _refuse(path, "doc_to_text/doc_to_target", None, "both set")
    has_choices = spec.get("doc_to_choice") is not None
    if output_type == "multiple_choice":
        # lm-eval with --apply_chat_template: no delimiter between the prompt and a choice
        delimiter = "" if apply_chat_template else spec.get("target_delimiter", " ")
        items = []
        for doc in docs:
            choices = doc_to_choice(spec["doc_to_choice"], doc)
            target = doc_to_target(spec["doc_to_target"], doc, True)
            target = choices.index(target) if target in choices else int(target)
            context = doc_to_text(spec["doc_to_text"], doc)
            items.append(Item(context, [delimiter + c for c in choices], target))
        return ChoiceTask(name, items, apply_chat_template)
    until, max_gen_toks = _generation(path, spec)
    gen_items = []
    for doc in docs:
        target = doc_to_target(spec["doc_to_target"], doc, has_choices)
        if has_choices:  # lm-eval: doc_to_target is then the index of the answer
            target = doc_to_choice(spec["doc_to_choice"], doc)[int(target)]
        targets = tuple(str(t) for t in target) if isinstance(target, list) else (str(target),)
        gen_items.append(GenItem(doc_to_text(spec["doc_to_text"], doc), targets))
    return GenerationTask(
        name, gen_items, until, max_gen_toks, _pipelines(path, spec), metric, apply_chat_template
    )


def load_items(task: str, limit: int | None = None) -> tuple[str, list[Item] | list[GenItem]]:
    """The task's name and its items."""
    loaded = load_task(task, limit)
    return loaded.name, loaded.items


# ---- scoring on a backend -----------------------------------------------------------------


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair`: the context's tokens and the continuation's, the latter being
    what the whole text has past the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    head = tokenizer.encode(context, add_special_tokens=False)
    return head, whole[len(head) :]


def _chat(context: str) -> list[dict[str, str]]:
    """lm-eval's chat history of a zero-shot prompt without a system instruction."""
    return [{"role": "user", "content": context}]


def _no_prompt_logprobs(backend: Backend) -> AccuracyTaskError:
    return AccuracyTaskError(
        f"run.accuracy: the {backend.name} backend reports no prompt log-probabilities; "
        "allowed: engine=builtin|hf|openai (a server that answers completions' echo with "
        "logprobs), or a generate_until task"
    )


async def _prompt_logprobs(backend: Backend, request_id: str, ids: list[int]) -> list[float]:
    """The log-probability of each token of `ids` after the first, from the backend."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    found: PromptLogprobs | None = None
    async for event in backend.generate(GenerationRequest(request_id, ids, params)):
        if isinstance(event, PromptLogprobs):
            found = event
        elif isinstance(event, Failed):
            raise RuntimeError(f"run.accuracy: request {request_id} failed: {event.error}")
    if found is None:
        raise _no_prompt_logprobs(backend)
    scored = [e.token_id for e in found.logprobs[1:] if e is not None]
    if len(found.logprobs) != len(ids) or any(
        got not in (sent, -1) for got, sent in zip(scored, ids[1:], strict=False)
    ):
        raise AccuracyTaskError(
            f"run.accuracy: the {backend.name} backend scored other tokens than the "
            f"{len(ids)} sent ({len(found.logprobs)} came back): the prompt was re-tokenized "
            "on the way (a server sent text for token ids); allowed: a backend that takes "
            "token-id prompts as given (engine=builtin|hf, engine=openai with a server that "
            "takes token ids, e.g. engine.server=vllm)"
        )
    return [e.logprob for e in found.logprobs[1:] if e is not None]


def model_tokenizer(model: Mapping[str, Any] | None) -> Any:
    """The tokenizer of the model the run's model group names, where it names one with a
    tokenizer of its own (model.tokenizer, a checkpoint folder's, a GGUF file's, a packaged
    model's): what lm-eval's local-completions loads client-side, for a client of a server
    whose backend has none (engine=openai with model=smollm2-135m). None otherwise (a preset
    has no tokenizer of its own; an unknown name is no file)."""
    from models.gguf import is_gguf
    from models.location import model_location
    from models.tokenizer import load_tokenizer, tokenizer_for_model

    if not model:
        return None
    if model.get("tokenizer"):
        return load_tokenizer(model["tokenizer"])
    name = model.get("path") or model.get("name")
    if not isinstance(name, str):
        return None
    where = model_location(name)
    if is_gguf(where) or (Path(where) / "tokenizer.json").is_file():
        return tokenizer_for_model(where)
    return None


def _tokenizer(backend: Backend, fallback: Any = None) -> Any:
    tokenizer = getattr(backend, "tokenizer", None) or fallback
    if tokenizer is None:
        raise AccuracyTaskError(
            f"run.accuracy: a multiple_choice task is tokenized here by lm-eval's rule, and "
            f"the {backend.name} backend has no tokenizer, nor has the model group one; "
            "allowed: engine.tokenizer (engine=openai) or model.tokenizer set to a "
            "tokenizer.json file or folder"
        )
    return tokenizer


async def score_items(
    backend: Backend,
    items: list[Item],
    apply_chat_template: bool = False,
    tokenizer: Any = None,
) -> list[list[float]]:
    """Each item's choices' loglikelihoods, every request in flight at once (`tokenizer`: the
    backend's, else this one)."""
    tokenizer = _tokenizer(backend, tokenizer)

    def context(item: Item) -> str:
        if not apply_chat_template:
            return item.context
        return str(tokenizer.apply_chat_template(_chat(item.context), add_generation_prompt=True))

    pairs = [[encode_pair(tokenizer, context(item), c) for c in item.choices] for item in items]

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


async def _generate(backend: Backend, request_id: str, prompt: Prompt, max_tokens: int) -> str:
    """One greedy generation's text (it stops at EOS or after max_tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    text: str | None = None
    async for event in backend.generate(GenerationRequest(request_id, prompt, params)):
        if isinstance(event, Finished):
            text = event.text
        elif isinstance(event, Failed):
            raise RuntimeError(f"run.accuracy: request {request_id} failed: {event.error}")
    if text is None:
        raise RuntimeError(f"run.accuracy: request {request_id} ended without finishing")
    return text


async def generate_responses(backend: Backend, task: GenerationTask) -> tuple[list[str], list[str]]:
    """Each item's greedy generation, and its response as lm-eval sees it: the generation cut
    at the first `until` string or the tokenizer's EOS text. Stop strings are applied here,
    not sent (the hf and llamacpp backends take none): each generation runs to EOS or
    max_gen_toks, and the text before the first stop string is what it would have been had it
    stopped there."""
    tokenizer = getattr(backend, "tokenizer", None)
    eos = getattr(tokenizer, "eos_token", None)
    until = [*task.until, *([eos] if eos and eos not in task.until else [])]

    async def one(i: int, item: GenItem) -> str:
        prompt: Prompt = _chat(item.context) if task.apply_chat_template else item.context
        return await _generate(backend, f"accuracy-{i}", prompt, task.max_gen_toks)

    texts = list(await asyncio.gather(*(one(i, item) for i, item in enumerate(task.items))))
    return texts, [cut_at_stops(text, until) for text in texts]


def score_generations(task: GenerationTask, responses: list[str]) -> dict[str, Any]:
    """Each pipeline's filtered responses and exact_match (an item counts where any of its
    targets matches)."""
    out: dict[str, Any] = {}
    for pipeline in task.pipelines:
        filtered = [apply_pipeline(pipeline, [r]) for r in responses]
        correct = [
            any(exact_match(f, t, **task.exact_match) for t in item.targets)
            for f, item in zip(filtered, task.items, strict=True)
        ]
        out[pipeline.name] = {
            "filtered": filtered,
            "correct": correct,
            "exact_match": sum(correct) / len(correct) if correct else 0.0,
        }
    return out


def score_task(backend: Backend, task: Task, tokenizer: Any = None) -> dict[str, Any]:
    """The task scored on the backend (`tokenizer`: for a backend without one): what
    summary.json's `accuracy` holds."""
    result: dict[str, Any] = {
        "task": task.name,
        "output_type": task.output_type,
        "apply_chat_template": task.apply_chat_template,
        "items": len(task.items),
    }
    if isinstance(task, ChoiceTask):
        scores = asyncio.run(score_items(backend, task.items, task.apply_chat_template, tokenizer))
        correct = [
            row.index(max(row)) == item.target for row, item in zip(scores, task.items, strict=True)
        ]
        result["loglikelihoods"] = scores
        result["metric"] = "acc"
        accuracy = sum(correct) / len(correct)
    else:
        generations, responses = asyncio.run(generate_responses(backend, task))
        filters = score_generations(task, responses)
        result["generations"] = generations  # as the backend returned them
        result["responses"] = responses  # cut at the stop strings: what the filters read
        result["filters"] = filters
        result["metric"] = f"exact_match,{task.pipelines[0].name}"
        accuracy = filters[task.pipelines[0].name]["exact_match"]
    result["metrics"] = {"accuracy": accuracy, "accuracy_items": len(task.items)}
    return result


class AccuracyTracker(Tracker):
    name = "accuracy"

    def __init__(
        self,
        task: str,
        limit: int | None,
        apply_chat_template: bool = False,
        model: Mapping[str, Any] | None = None,
    ) -> None:
        self.spec = load_task(task, limit, apply_chat_template)  # a bad task stops the run now
        self.task, self.items = self.spec.name, self.spec.items
        self.model = model  # the run's model group: its tokenizer, for a backend without one
        self.tokenizer: Any = None
        self.result: dict[str, Any] | None = None

    @classmethod
    def from_config(
        cls, settings: dict[str, Any], model: Mapping[str, Any] | None = None
    ) -> AccuracyTracker | None:
        task = settings.get("task")
        if task is None:
            return None
        chat = bool(settings.get("apply_chat_template"))
        return cls(task, settings.get("limit"), chat, model)

    def loaded(self, backend: Backend, engine: dict[str, Any]) -> None:
        """A multiple-choice task needs a tokenizer: the backend's, else the model group's;
        without either the run stops now, before its measured requests."""
        if isinstance(self.spec, ChoiceTask) and getattr(backend, "tokenizer", None) is None:
            self.tokenizer = _tokenizer(backend, model_tokenizer(self.model))

    def stop(self, backend: Backend, engine: dict[str, Any]) -> None:
        self.result = score_task(backend, self.spec, self.tokenizer)

    def results(self, run_dir: Path, t0_ns: int | None) -> dict[str, Any]:
        return {} if self.result is None else {"accuracy": self.result}
