"""run.accuracy: lm-eval tasks loaded from their YAML. Multiple choice: choices tokenized by
lm-eval's rule, each choice's loglikelihood equal to Hugging Face's log-softmax over the same
tokens (a random Llama), the accuracy as lm-eval's `acc`. Generation (generate_until): lm-eval's
`regex` / `take_first` filters, its stop-string cut and its `exact_match` on cases whose answers
lm-eval 0.4.13 itself gave (its functions cannot be imported here: it lives in .venv-lmeval),
and inferlab_gen scored on the built-in engine equal to the same rules applied to
LLM.generate's own outputs. Bad tasks and backends without prompt log-probabilities named.
(Parity with lm-eval itself on SmolLM2: tests/serving/test_server_lm_eval.py.)"""

from __future__ import annotations

import asyncio
import json
import re
import string
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import random_hf_llama

from engines.base import (
    Backend,
    Finished,
    GenerationRequest,
    PromptLogprobs,
    RequestEvent,
    TokenLogprob,
)
from engines.builtin import LLM, SamplingParams
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from harness.measuring.accuracy import (
    AccuracyTaskError,
    AccuracyTracker,
    GenerationTask,
    Item,
    cut_at_stops,
    encode_pair,
    exact_match,
    load_items,
    load_task,
    regex_filter,
    score_items,
)
from harness.running.run_config import RunConfig
from models.tokenizer import default_tokenizer

VOCAB = 256
TASKS = Path(__file__).resolve().parents[3] / "data" / "tasks"


def write_task(folder: Path, docs: list[dict[str, Any]], **spec: Any) -> Path:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {
        "task": "words",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        **spec,
    }
    path = folder / "words.yaml"
    path.write_text(json.dumps(task))  # JSON is YAML
    return path


def test_the_shipped_task_loads_as_lm_eval_renders_it() -> None:
    name, items = load_items("inferlab_mc")
    assert name == "inferlab_mc" and len(items) == 16
    first = items[0]
    assert first.context == "Question: What is the capital of France?\nAnswer:"
    assert first.choices == [" Paris", " London", " Rome", " Berlin"] and first.target == 0
    assert len(load_items("inferlab_mc", limit=3)[1]) == 3


def test_lm_evals_pair_rule_moves_the_contexts_trailing_spaces() -> None:
    class Chars:  # one token per character, to see the split
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert add_special_tokens is False
            return [ord(c) for c in text]

    head, tail = encode_pair(Chars(), "Answer: ", "yes")
    assert head == [ord(c) for c in "Answer:"] and tail == [ord(c) for c in " yes"]


def test_the_shipped_generation_task_loads_as_lm_eval_reads_it() -> None:
    task = load_task("inferlab_gen")
    assert isinstance(task, GenerationTask) and task.name == "inferlab_gen"
    assert len(task.items) == 8 and task.items[0].targets == ("Paris",)
    assert task.items[0].context == "Answer with one word. What is the capital of France?"
    assert task.until == ("\n", ".") and task.max_gen_toks == 8
    assert [p.name for p in task.pipelines] == ["last_word"]
    assert [f.function for f in task.pipelines[0].filters] == ["regex", "take_first"]
    assert task.exact_match == {"ignore_case": True, "ignore_punctuation": True}


def test_a_name_that_is_no_task_is_named() -> None:
    with pytest.raises(
        AccuracyTaskError, match=r"'nope' is not a task; allowed: inferlab_gen\|inferlab_mc"
    ):
        load_items("nope")


GEN = {
    "output_type": "generate_until",
    "doc_to_choice": None,
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False},
}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"output_type": "loglikelihood_rolling"},
            r"output_type: 'loglikelihood_rolling'; "
            r"allowed: multiple_choice\|generate_until",
        ),
        (
            {"process_docs": "!function utils.p"},
            r"key\(s\) \['process_docs'\] not supported; "
            r"allowed: \[",
        ),
        ({"num_fewshot": 5}, r"num_fewshot: 5; allowed: 0 or null"),
        (
            {"metric_list": [{"metric": "acc_norm"}]},
            r"metric_list\[0\].metric: 'acc_norm'; "
            r"allowed: acc$",
        ),
        ({**GEN, "metric_list": [{"metric": "bleu"}]}, r"metric: 'bleu'; allowed: exact_match"),
        (
            {**GEN, "metric_list": [{"metric": "exact_match", "ignore_spaces": True}]},
            r"metric_list\[0\].ignore_spaces: not an option of exact_match; allowed: ignore_case",
        ),
        (
            {**GEN, "metric_list": [{"metric": "exact_match", "aggregation": "median"}]},
            r"aggregation: 'median'; allowed: mean",
        ),
        (
            {**GEN, "generation_kwargs": {"until": ["\n"], "do_sample": True, "temperature": 0.7}},
            r"do_sample=True, temperature=0.7 samples; allowed: do_sample: false or temperature: 0",
        ),
        (
            {**GEN, "generation_kwargs": {"until": ["\n"], "temperature": 0.5}},
            r"do_sample=None, temperature=0.5 samples",
        ),
        (
            {**GEN, "generation_kwargs": {"top_p": 0.9}},
            r"generation_kwargs.top_p: not supported; allowed: until\|max_gen_toks",
        ),
        (
            {**GEN, "filter_list": [{"name": "f", "filter": [{"function": "majority_vote"}]}]},
            r"filter_list\[0\].filter\[0\].function: 'majority_vote'; allowed: regex\|take_first",
        ),
        (
            {**GEN, "filter_list": [{"name": "f", "filter": [{"function": "regex", "flags": 2}]}]},
            r"filter\[0\].flags: not an option of regex; allowed: regex_pattern\|group_select",
        ),
        (
            {
                **GEN,
                "filter_list": [
                    {"name": "f", "filter": [{"function": "take_first"}, {"function": "regex"}]}
                ],
            },
            r"filter\[0\].function: 'take_first'; allowed: take_first as the last filter",
        ),
        (
            {
                **GEN,
                "filter_list": [
                    {"name": "f", "filter": [{"function": "regex", "regex_pattern": "(unclosed"}]}
                ],
            },
            r"regex_pattern: '\(unclosed'; allowed: a Python regex",
        ),
        (
            {**GEN, "generation_kwargs": None, "filter_list": [], "doc_to_choice": None},
            r"filter_list: \[\]; allowed",
        ),
    ],
)
def test_a_task_it_cannot_score_is_refused_naming_the_key(
    tmp_path: Path, spec: dict[str, Any], message: str
) -> None:
    docs = [{"question": "q", "choices": ["a", "b"], "answer": 0}]
    task = write_task(tmp_path, docs, **spec)
    with pytest.raises(AccuracyTaskError, match=message):
        load_task(str(task))


# ---- lm-eval's filters and metric, on answers lm-eval 0.4.13 gave ------------------------
# Each expected value below is what lm-eval's own RegexFilter, exact_match_hf_evaluate and
# postprocess_generated_text returned for the same input (run in .venv-lmeval).


@pytest.mark.parametrize(
    ("response", "pattern", "group", "fallback", "expected"),
    [
        ("The capital of France is Paris.", r"(\w+)\W*$", 0, "[invalid]", "Paris"),
        ("...", r"(\w+)\W*$", 0, "[invalid]", "[invalid]"),
        ("", r"(\w+)\W*$", 0, "[invalid]", "[invalid]"),
        ("#### 42\nmore #### 7", r"#### (\-?[0-9\.\,]+)", 0, "[invalid]", "42"),
        ("#### 42\nmore #### 7", r"#### (\-?[0-9\.\,]+)", -1, "[invalid]", "7"),  # the last
        ("no number", r"#### (\-?[0-9\.\,]+)", 0, "none", "none"),
        # several groups: the match's first non-empty one (GSM8K's flexible-extract)
        ("The answer is 12 or 13", r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1, "[invalid]", "13"),
        ("x 5 y", r"(-?[$0-9.,]{2,})|(-?[0-9]+)", 0, "[invalid]", "5"),
        ("ab", r"(a)|(b)", 1, "[invalid]", "b"),
        ("  spaced  ", r"\s*\w+\s*", 0, "[invalid]", "spaced"),  # stripped
        ("a", r"(x)?(y)?a", 0, "FB ", "FB"),  # every group empty: the fallback, stripped
    ],
)
def test_regex_filter_as_lm_eval(
    response: str, pattern: str, group: int, fallback: str, expected: str
) -> None:
    assert regex_filter(response, pattern, group, fallback) == expected


def test_regex_filter_past_the_matches_is_named() -> None:
    with pytest.raises(AccuracyTaskError, match=r"group_select 2 but .* matched 1 time"):
        regex_filter("one 1", r"(\d)", 2)


@pytest.mark.parametrize(
    ("prediction", "reference", "options", "expected"),
    [
        ("Paris", "Paris", {}, True),
        ("Paris", "paris", {}, False),
        ("Paris", "paris", {"ignore_case": True}, True),
        ("Paris ", "Paris", {}, False),  # no whitespace rule
        (" Paris", "Paris", {"ignore_case": True, "ignore_punctuation": True}, False),
        ("Paris.", "Paris", {"ignore_punctuation": True}, True),
        ("Pa-ris!", "paris", {"ignore_case": True, "ignore_punctuation": True}, True),
        ("Paris\u2019", "Paris", {"ignore_punctuation": True}, False),  # ASCII punctuation
        ("\u00c9T\u00c9", "\u00e9t\u00e9", {"ignore_case": True}, True),
        ("Stra\u00dfe", "STRASSE", {"ignore_case": True}, False),
        ("\u0130", "i\u0307", {"ignore_case": True}, False),  # numpy's lower, not str.lower
        ("Paris\x00", "Paris", {}, True),  # numpy strings end at trailing NULs
        ("a1b2", "ab", {"ignore_numbers": True}, True),
        ("the cat", "cat", {"regexes_to_ignore": ["the "]}, True),
        ("The Cat", "cat", {"regexes_to_ignore": ["the "], "ignore_case": True}, False),
        ("[invalid]", "invalid", {"ignore_punctuation": True}, True),
    ],
)
def test_exact_match_as_lm_eval(
    prediction: str, reference: str, options: dict[str, Any], expected: bool
) -> None:
    assert exact_match(prediction, reference, **options) is expected


@pytest.mark.parametrize(
    ("text", "until", "expected"),
    [
        ("Paris.\nNext", ["\n", "."], "Paris"),
        ("a.b\nc", ["\n", "."], "a"),
        ("xab", ["ab", "b"], "x"),
        ("xbab", ["ab", "b"], "x"),
        ("none here", ["\n"], "none here"),
        ("keep", ["", "z"], "keep"),
    ],
)
def test_generations_are_cut_at_the_first_stop_as_lm_eval(
    text: str, until: list[str], expected: str
) -> None:
    assert cut_at_stops(text, until) == expected


def test_bad_settings_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"run.accuracy.limit: 0 is invalid"):
        RunConfig.from_dict({"accuracy": {"task": "inferlab_mc", "limit": 0}})


class NoPromptLogprobs(Backend):
    name = "silent"

    def load(self) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        yield Finished(request.request_id, 0, 0, "length", 3, 1)


def test_a_backend_without_prompt_logprobs_is_named() -> None:
    tokenizer_item = [Item("t10 t11", [" t12"], 0)]
    backend = NoPromptLogprobs()
    backend.tokenizer = type(  # type: ignore[attr-defined]
        "T", (), {"encode": staticmethod(lambda text, add_special_tokens=True: [1, 2, 3])}
    )()
    with pytest.raises(AccuracyTaskError, match="the silent backend reports no prompt log-prob"):
        asyncio.run(score_items(backend, tokenizer_item))


@pytest.mark.slow
@torch.inference_mode()
def test_loglikelihoods_equal_hf_and_accuracy_is_lm_evals_acc(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    folder = tmp_path / "llama"
    model = random_hf_llama(folder, VOCAB, seed=3)
    docs = [
        {"question": "t10 t11 t12", "choices": ["t20", "t21 t22", "t23"], "answer": 1},
        {"question": "t30 t31", "choices": ["t40 t41 t42", "t43"], "answer": 0},
        {"question": "t50", "choices": ["t60", "t61", "t62", "t63"], "answer": 3},
    ]
    task = write_task(tmp_path, docs)
    tracker = AccuracyTracker(str(task), None)
    backend = BuiltinBackend(EngineConfig.from_dict({"model": str(folder), "dtype": "float32"}))
    backend.load()
    tokenizer = backend.tokenizer
    try:
        tracker.stop(backend, {})
    finally:
        backend.close()
    result = tracker.results(tmp_path, None)["accuracy"]
    expected_correct = []
    for item, scores in zip(tracker.items, result["loglikelihoods"], strict=True):
        reference = []
        for choice in item.choices:
            head, tail = encode_pair(tokenizer, item.context, choice)
            ids = torch.tensor([head + tail])
            logprobs = model(ids).logits[0].float().log_softmax(-1)
            positions = range(len(head) - 1, len(head) + len(tail) - 1)
            reference.append(sum(float(logprobs[p, ids[0, p + 1]]) for p in positions))
        assert scores == pytest.approx(reference, abs=1e-4)
        expected_correct.append(reference.index(max(reference)) == item.target)
    metrics = result["metrics"]
    assert metrics["accuracy"] == sum(expected_correct) / 3 and metrics["accuracy_items"] == 3


# ---- generate_until on the built-in engine -----------------------------------------------


def independent_scores(texts: list[str], task: GenerationTask) -> tuple[list[str], list[bool]]:
    """inferlab_gen's rules written out over LLM.generate's texts: cut at "\n", "." or EOS,
    the last word by its regex, exact match ignoring case and ASCII punctuation."""
    eos = default_tokenizer().eos_token
    filtered, correct = [], []
    for text, item in zip(texts, task.items, strict=True):
        cut = min((text.find(s) for s in ("\n", ".", eos or "\0") if s in text), default=None)
        response = text[:cut]
        words = re.findall(r"(\w+)\W*$", response)
        word = words[0].strip() if words else "[invalid]"
        filtered.append(word)
        clean = word.lower().translate(str.maketrans("", "", string.punctuation))
        target = item.targets[0].lower().translate(str.maketrans("", "", string.punctuation))
        correct.append(clean == target)
    return filtered, correct


@pytest.mark.parametrize("chat", [False, True])
def test_generation_task_on_the_builtin_engine_scores_llm_generates_outputs(
    chat: bool, tmp_path: Path
) -> None:
    """inferlab_gen on model=tiny (the scores are what a random model gets): each response is
    LLM.generate's greedy text for the same prompt (text, or a user message under the chat
    template), and the filter and exact_match give what the rules written out give. A copy of
    the task whose targets are, for half the items, what the model answers scores exactly 1/2."""
    options = {"dtype": "float32", "max_model_len": 128}
    task = load_task("inferlab_gen", apply_chat_template=chat)
    assert isinstance(task, GenerationTask)
    prompts = [[{"role": "user", "content": i.context}] if chat else i.context for i in task.items]
    with LLM("tiny", **options) as llm:
        texts = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    filtered, correct = independent_scores(texts, task)
    # a copy of the task whose first four targets are the model's answers
    data = tmp_path / "gen.jsonl"
    docs = [json.loads(line) for line in (TASKS / "inferlab_gen.jsonl").read_text().splitlines()]
    for doc, answer in zip(docs[:4], filtered, strict=False):
        doc["answer"] = answer
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    copy = tmp_path / "gen.yaml"
    spec = (
        (TASKS / "inferlab_gen.yaml")
        .read_text()
        .replace("data/tasks/inferlab_gen.jsonl", str(data))
    )
    copy.write_text(spec.replace("task: inferlab_gen", "task: copied"))

    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **options}))
    backend.load()
    try:
        trackers = [AccuracyTracker(t, None, chat) for t in ("inferlab_gen", str(copy))]
        for tracker in trackers:
            tracker.stop(backend, {})
    finally:
        backend.close()
    result = trackers[0].results(tmp_path, None)["accuracy"]
    assert result["generations"] == texts
    assert result["responses"] == [
        cut_at_stops(t, ["\n", ".", default_tokenizer().eos_token or "\n"]) for t in texts
    ]
    assert result["filters"]["last_word"]["filtered"] == filtered
    assert result["filters"]["last_word"]["correct"] == correct
    assert result["metrics"] == {"accuracy": sum(correct) / 8, "accuracy_items": 8}
    assert result["metric"] == "exact_match,last_word" and result["apply_chat_template"] is chat
    copied = trackers[1].results(tmp_path, None)["accuracy"]
    expected = [True] * 4 + correct[4:]
    assert copied["filters"]["last_word"]["correct"] == expected
    assert copied["metrics"]["accuracy"] == sum(expected) / 8


class Recorder(Backend):
    """A backend that records each request's prompt and scores every prompt token -1."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = default_tokenizer()
        self.prompts: dict[str, Any] = {}

    def load(self) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        self.prompts[request.request_id] = request.prompt
        ids = list(request.prompt)
        scores = tuple(TokenLogprob(t, -1.0, 1) for t in ids[1:])
        yield PromptLogprobs(request.request_id, 0, 0, (None, *scores))
        yield Finished(request.request_id, 0, 0, "length", len(ids), 1)


def test_multiple_choice_under_the_chat_template_is_lm_evals(tmp_path: Path) -> None:
    """apply_chat_template with a multiple-choice task, as lm-eval does it: the context is a
    user message rendered by the model's chat template, with no delimiter before the choice."""
    task = load_task("inferlab_mc", limit=2, apply_chat_template=True)
    assert task.items[0].choices == ["Paris", "London", "Rome", "Berlin"]
    backend = Recorder()
    tokenizer = backend.tokenizer
    scores = asyncio.run(score_items(backend, task.items, apply_chat_template=True))
    first = task.items[0]
    text = tokenizer.apply_chat_template([{"role": "user", "content": first.context}])
    head, tail = encode_pair(tokenizer, text, "Paris")
    assert backend.prompts["accuracy-0-0"] == head + tail
    assert scores[0][0] == -len(tail)  # the continuation's tokens only


def test_a_backend_without_a_tokenizer_takes_the_model_groups_or_stops_at_load(
    tmp_path: Path,
) -> None:
    """A client of a server whose backend loaded no tokenizer (engine=openai with a packaged
    or GGUF model) tokenizes multiple-choice items with the model group's own, as lm-eval's
    local-completions loads one; with none anywhere the run stops at load, naming the keys."""
    pytest.importorskip("transformers")
    folder = tmp_path / "llama"
    random_hf_llama(folder, VOCAB, seed=3)
    backend = NoPromptLogprobs()  # no tokenizer attribute
    tracker = AccuracyTracker("inferlab_mc", 1, model={"name": "hf", "path": str(folder)})
    tracker.loaded(backend, {})
    assert tracker.tokenizer is not None and tracker.tokenizer.vocab_size == VOCAB
    for model in ({"name": "tiny", "path": None}, None):
        lost = AccuracyTracker("inferlab_mc", 1, model=model)
        with pytest.raises(AccuracyTaskError, match=r"the silent backend has no tokenizer, nor"):
            lost.loaded(backend, {})
    AccuracyTracker("inferlab_gen", 1).loaded(backend, {})  # generation needs none
