"""lm-evaluation-harness as a client of `inferlab serve`, against its own Hugging Face backend on
the same model: SmolLM2-135M-Instruct's GGUF file, which the engine and transformers each read
to float32. Two of the project's tasks (data/tasks/): `inferlab_mc` through `local-completions`
(loglikelihood: echo with logprobs, lm-eval's remote tokenizer over /tokenize) and
`inferlab_gen` through `local-chat-completions` (greedy generate_until with the chat template).
Every example's choice, every loglikelihood (within 1e-3) and every generated answer equal
lm-eval's `hf` backend's, and so do the scores; so do `run.accuracy`'s on both tasks. lm-eval
runs from .venv-lmeval (`make setup-lmeval`), as a subprocess."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import configs
from models.packaged import packaged_model_path
from serving.testing import ServeProcess, serve_process

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[2]
LM_EVAL = REPO / ".venv-lmeval" / "bin" / "lm_eval"
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    if not LM_EVAL.exists():
        pytest.fail(f"{LM_EVAL} is missing: lm-eval needs a venv of its own, `make setup-lmeval`")
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serve_process([f"model={MODEL}", "engine.dtype=float32", "log_level=warning"], log) as s:
        yield s


def lm_eval(output: Path, *args: str) -> dict[str, Any]:
    """Run lm_eval from the repository root (the tasks' data paths are relative to it); the
    samples of each task by task name, each a list of per-example records in doc order."""
    done = subprocess.run(
        [str(LM_EVAL), *args, "--include_path", "data/tasks", "--log_samples",
         "--output_path", str(output), "--seed", "1234"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    samples: dict[str, Any] = {}
    for path in output.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = sorted(rows, key=lambda row: row["doc_id"])
    results = next(output.rglob("results_*.json"))
    samples["results"] = json.loads(results.read_text())["results"]
    return samples


def hf(output: Path, task: str, *extra: str) -> dict[str, Any]:
    gguf = packaged_model_path(MODEL)
    pretrained = f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32"
    return lm_eval(output, "--model", "hf", "--model_args", pretrained, "--device", "cpu",
                   "--tasks", task, *extra)  # fmt: skip


@pytest.fixture(scope="module")
def hf_mc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lm-eval's own `hf` backend on inferlab_mc: the reference."""
    return hf(tmp_path_factory.mktemp("hf_mc"), "inferlab_mc")


def test_loglikelihood_through_the_server_equals_hf(
    server: ServeProcess, hf_mc: dict[str, Any], tmp_path: Path
) -> None:
    args = (
        f"model={MODEL},base_url={server.base_url}/v1/completions,tokenizer_backend=remote,"
        "tokenized_requests=True,num_concurrent=2"
    )
    ours = lm_eval(tmp_path / "ours", "--model", "local-completions", "--model_args", args,
                   "--tasks", "inferlab_mc")  # fmt: skip
    reference = hf_mc
    assert len(ours["inferlab_mc"]) == len(reference["inferlab_mc"]) == 16
    for mine, theirs in zip(ours["inferlab_mc"], reference["inferlab_mc"], strict=True):
        scores = [float(r[0]) for r in mine["filtered_resps"]]
        expected = [float(r[0]) for r in theirs["filtered_resps"]]
        assert scores == pytest.approx(expected, abs=1e-3), mine["doc"]["question"]
        assert scores.index(max(scores)) == expected.index(max(expected))  # the same choice
        assert mine["acc"] == theirs["acc"]
    assert (
        ours["results"]["inferlab_mc"]["acc,none"]
        == reference["results"]["inferlab_mc"]["acc,none"]
    )


@pytest.fixture(scope="module")
def hf_gen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lm-eval's own `hf` backend on inferlab_gen with the chat template: the reference."""
    return hf(tmp_path_factory.mktemp("hf_gen"), "inferlab_gen", "--apply_chat_template")


def test_generation_through_the_chat_api_equals_hf(
    server: ServeProcess, hf_gen: dict[str, Any], tmp_path: Path
) -> None:
    args = f"model={MODEL},base_url={server.base_url}/v1/chat/completions,num_concurrent=2"
    ours = lm_eval(tmp_path / "ours", "--model", "local-chat-completions", "--model_args", args,
                   "--apply_chat_template", "--tasks", "inferlab_gen")  # fmt: skip
    reference = hf_gen
    answers = [row["resps"][0][0] for row in ours["inferlab_gen"]]
    assert answers == [row["resps"][0][0] for row in reference["inferlab_gen"]]
    assert sum(row["exact_match"] for row in ours["inferlab_gen"]) > 0  # the scorer can pass
    ours_score = ours["results"]["inferlab_gen"]["exact_match,last_word"]
    assert ours_score == reference["results"]["inferlab_gen"]["exact_match,last_word"]


def test_a_runs_accuracy_metric_equals_lm_evals(hf_mc: dict[str, Any], tmp_path: Path) -> None:
    """`run.accuracy.task=inferlab_mc` on the built-in engine (in process, no server): every
    choice's loglikelihood as lm-eval's hf backend scores it, and the same `acc`."""
    from harness.running.experiment import run_experiment

    overrides = [
        f"model={MODEL}",
        "engine.dtype=float32",
        "run.accuracy.task=inferlab_mc",
        "workload.num_requests=2",
        "workload.output_len=4",
        "run.warmup_requests=0",
    ]
    config = OmegaConf.to_container(configs.compose(overrides), resolve=True)
    assert isinstance(config, dict)
    summary = run_experiment(config, tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary.get("error")
    scored = summary["accuracy"]["loglikelihoods"]
    for mine, theirs in zip(scored, hf_mc["inferlab_mc"], strict=True):
        expected = [float(r[0]) for r in theirs["filtered_resps"]]
        assert mine == pytest.approx(expected, abs=1e-3), theirs["doc"]["question"]
    assert summary["metrics"]["accuracy"] == hf_mc["results"]["inferlab_mc"]["acc,none"]
    assert summary["metrics"]["accuracy_items"] == 16


def test_a_runs_generation_accuracy_equals_lm_evals(hf_gen: dict[str, Any], tmp_path: Path) -> None:
    """`run.accuracy.task=inferlab_gen` with `apply_chat_template` on the built-in engine: every
    response, every filtered answer and every item's exact match as lm-eval's hf backend gives
    them, and the same score."""
    from harness.running.experiment import run_experiment

    overrides = [
        f"model={MODEL}",
        "engine.dtype=float32",
        "run.accuracy.task=inferlab_gen",
        "run.accuracy.apply_chat_template=true",
        "workload.num_requests=2",
        "workload.output_len=4",
        "run.warmup_requests=0",
    ]
    config = OmegaConf.to_container(configs.compose(overrides), resolve=True)
    assert isinstance(config, dict)
    summary = run_experiment(config, tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary.get("error")
    scored = summary["accuracy"]
    rows = hf_gen["inferlab_gen"]
    assert scored["responses"] == [row["resps"][0][0] for row in rows]
    last_word = scored["filters"]["last_word"]
    assert last_word["filtered"] == [row["filtered_resps"][0] for row in rows]
    assert last_word["correct"] == [row["exact_match"] == 1.0 for row in rows]
    reference = hf_gen["results"]["inferlab_gen"]["exact_match,last_word"]
    assert summary["metrics"]["accuracy"] == reference
