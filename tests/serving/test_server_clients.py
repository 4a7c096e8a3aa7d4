"""Real clients against `inferlab serve` (issue 15): the official `openai` SDK (completions,
chat, streaming, n > 1, models, and each refusal surfaced as the SDK's own exception class),
guidellm and AIPerf as subprocesses, every one of whose requests must succeed. A real uvicorn
server on loopback with an API key, model=tiny; greedy outputs are checked against the engine's
own. AIPerf cannot share the project's environment: it runs from .venv-aiperf
(`make setup-aiperf`; docs/serving.md, Clients)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_server import OPTIONS, PROMPT

from engines.builtin import LLM, SamplingParams
from engines.builtin.backend import BuiltinBackend
from harness import cli
from harness.run_folder import load_table, read_summary
from serving import ServerConfig
from serving.testing import RunningServer, serve_engine

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

API_KEY = "sk-inferlab-test"
MESSAGES: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(OPTIONS, ServerConfig(api_key=API_KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="module")
def direct() -> LLM:
    return LLM(model="tiny", **OPTIONS)


# ---- the openai SDK ---------------------------------------------------------------------------


def test_sdk_completions(client: openai.OpenAI, direct: LLM) -> None:
    want = direct.generate(PROMPT, GREEDY)[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    assert isinstance(got, openai.types.Completion)
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [
        (0, want.text, want.finish_reason)
    ]
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        len(want.prompt_token_ids),
        len(want.token_ids),
    )

    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage == got.usage

    # vLLM's fields through extra_body: an exact output length
    exact = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        extra_body={"min_tokens": 12, "ignore_eos": True},
    )
    assert exact.usage is not None and exact.usage.completion_tokens == 12


def test_sdk_chat(client: openai.OpenAI, direct: LLM) -> None:
    want = direct.generate(MESSAGES, GREEDY)[0]
    got = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0
    )
    choice = got.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant",
        want.text,
        want.finish_reason,
    )
    assert got.usage is not None and got.usage.completion_tokens == len(want.token_ids)

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage == got.usage


def test_sdk_parallel_sampling(client: openai.OpenAI, direct: LLM) -> None:
    params = dict(max_tokens=8, temperature=0.9, top_p=0.95, seed=11, n=2)
    want = [o.text for o in direct.generate(PROMPT, SamplingParams(**params))[0].outputs]
    got = client.completions.create(model="tiny", prompt=PROMPT, **params)  # type: ignore
    assert [(c.index, c.text) for c in got.choices] == list(enumerate(want))
    streamed = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, stream=True, **params):  # type: ignore[call-overload]
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want


def test_sdk_concurrent_streams(server: RunningServer, direct: LLM) -> None:
    prompts = ["Once upon a time", "Shall I compare thee", "In the beginning", "Hello there"]
    want = [direct.generate(p, GREEDY)[0].text for p in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        ) as client:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    assert asyncio.run(main()) == want


def test_sdk_models(client: openai.OpenAI) -> None:
    listed = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in listed] == [("tiny", "model", "inferlab")]
    assert client.models.retrieve("tiny") == listed[0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")


@pytest.mark.parametrize(
    ("kwargs", "error", "code", "param"),
    [
        (
            dict(prompt=PROMPT, temperature=-1),
            openai.BadRequestError,
            "invalid_value",
            "temperature",
        ),
        (dict(prompt=""), openai.BadRequestError, "invalid_value", "prompt"),
        (
            dict(prompt=PROMPT, max_tokens=1000),
            openai.BadRequestError,
            "context_length_exceeded",
            "max_tokens",
        ),
        (
            dict(prompt=PROMPT, extra_body={"bogus": 1}),
            openai.BadRequestError,
            "unknown_parameter",
            "bogus",
        ),
        (dict(prompt=PROMPT, model="gpt-4"), openai.BadRequestError, "model_not_found", "model"),
        (dict(prompt="x" * (9 << 20)), openai.APIStatusError, "request_too_large", None),
    ],
)
def test_sdk_errors(
    client: openai.OpenAI,
    kwargs: dict[str, Any],
    error: type[Exception],
    code: str,
    param: str | None,
) -> None:
    with pytest.raises(error) as raised:
        client.completions.create(**{"model": "tiny", "max_tokens": 4, **kwargs})
    exc = raised.value
    assert isinstance(exc, openai.APIStatusError)
    assert (exc.code, exc.param, exc.type) == (code, param, "invalid_request_error")
    assert exc.status_code == (413 if code == "request_too_large" else 400)


def test_sdk_api_key(server: RunningServer) -> None:
    for key in ("wrong", API_KEY + "x"):
        with (
            openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0) as stranger,
            pytest.raises(openai.AuthenticationError) as refused,
        ):
            stranger.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


# ---- guidellm ---------------------------------------------------------------------------------


def server_counts(server: RunningServer) -> dict[str, float]:
    """What the server has seen so far (its Prometheus counters): finished sequences, prompt
    and generated tokens."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def total(name: str) -> float:
        return sum(s.value for s in samples if s.name == name)

    return {
        "requests": total("inferlab_request_success_total"),
        "prompt_tokens": total("inferlab_prompt_tokens_total"),
        "output_tokens": total("inferlab_generation_tokens_total"),
    }


def check_import_matches_server(
    source: Path, out: Path, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    """`inferlab import` of a client's result file: its request and token counts are what the
    server saw in between; returns the imported summary."""
    assert cli.main(["import", str(source), "--out", str(out)]) == 0
    summary = read_summary(out)
    assert summary is not None and summary["status"] == "complete"
    metrics, seen = summary["metrics"], {k: after[k] - before[k] for k in after}
    assert metrics["num_completed"] == seen["requests"]
    assert metrics["input_tokens_total"] == seen["prompt_tokens"]
    assert metrics["output_tokens_total"] == seen["output_tokens"]
    requests = load_table(out, "requests")
    assert len(requests) == seen["requests"] and (requests["status"] == "ok").all()
    assert requests["output_tokens"].sum() == seen["output_tokens"]
    return summary


def write_tokenizer(backend: BuiltinBackend, folder: Path) -> Path:
    """The served model's tokenizer as a Hugging Face folder, so that a client sizes prompts
    in the server's own tokens without downloading anything."""
    assert backend.engine is not None
    return backend.engine.tokenizer.save_pretrained(folder)


def test_guidellm_every_request_succeeds(server: RunningServer, tmp_path: Path) -> None:
    """guidellm's streaming chat requests ask for vLLM's continuous usage stats (every one was
    a 400 before); its synthetic prompts are sized with the served tokenizer."""
    num_requests, output_tokens = 4, 8
    tokenizer = write_tokenizer(server.serving.backend, tmp_path / "tokenizer")
    out = tmp_path / "guidellm.json"
    command = [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        "--backend",
        f"kind=openai_http,target={server.base_url},model=tiny,api_key={API_KEY}",
        "--profile",
        "kind=synchronous",
        "--constraint",
        f"kind=max_requests,count={num_requests}",
        "--data",
        f"kind=synthetic_text,prompt_tokens=16,output_tokens={output_tokens}",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    before = server_counts(server)
    run = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    after = server_counts(server)
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    requests = benchmark["requests"]
    assert benchmark["scheduler_metrics"]["requests_made"] == {
        "successful": num_requests,
        "errored": 0,
        "incomplete": 0,
        "total": num_requests,
    }
    assert not requests["errored"] and not requests["incomplete"]
    for request in requests["successful"]:
        sent = json.loads(request["request_args"])["body"]
        assert sent["stream"] and sent["stream_options"]["continuous_usage_stats"]
        assert request["output_metrics"]["text_tokens"] == output_tokens  # the server's usage
    # its report, imported, counts what the server saw
    imported = check_import_matches_server(out, tmp_path / "imported", before, after)
    assert imported["imported"]["tool"] == "guidellm"
    assert imported["metrics"]["num_completed"] == num_requests


# ---- AIPerf ------------------------------------------------------------------------------------

AIPERF = Path(__file__).resolve().parents[2] / ".venv-aiperf" / "bin" / "aiperf"


def test_aiperf_every_request_succeeds(server: RunningServer, tmp_path: Path) -> None:
    """AIPerf streams chat requests two at a time; each must succeed with exactly the output
    length asked, as the server counts it (re-tokenizing the text of dummy weights counts other
    tokens), and its scrape of /metrics must see the same requests finish."""
    if not AIPERF.exists():
        pytest.fail(f"{AIPERF} is missing: AIPerf needs a venv of its own, `make setup-aiperf`")
    num_requests, output_tokens = 6, 8
    tokenizer = write_tokenizer(server.serving.backend, tmp_path / "tokenizer")
    out = tmp_path / "aiperf"
    command = [
        str(AIPERF),
        "profile",
        "--model",
        "tiny",
        "--url",
        server.base_url,
        "--api-key",
        API_KEY,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--request-count",
        str(num_requests),
        "--concurrency",
        "2",
        "--isl",
        "16",
        "--osl",
        str(output_tokens),
        "--extra-inputs",
        "ignore_eos:true",
        # random token ids: the default sonnet corpus costs ~6 s of tokenizing before the run
        "--tokenizer",
        str(tokenizer),
        "--prompt-corpus",
        "random",
        "--random-seed",
        "0",
        "--use-server-token-count",
        "--ui-type",
        "none",
        "--no-gpu-telemetry",
        "--artifact-dir",
        str(out),
    ]
    # Offline mode would make aiperf 0.13 look a local tokenizer folder up in the hub cache (and
    # fail); a local path is loaded without the network anyway. Its dataset files stay in tmp.
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.update(AIPERF_DATASET_MMAP_BASE_PATH=str(tmp_path), AIPERF_DATASET_MMAP_CACHE_ENABLED="0")
    before = server_counts(server)
    run = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    after = server_counts(server)

    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["is_complete"] and not summary["was_cancelled"]
    assert summary["request_count"]["avg"] == num_requests
    assert "error_request_count" not in summary and summary["error_summary"] == []
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == num_requests
    for record in records:
        assert "error" not in record, record["error"]
        assert record["metrics"]["usage_completion_tokens"]["value"] == output_tokens
        assert record["metrics"]["output_sequence_length"]["value"] == output_tokens
    sent = [s["payloads"][0] for s in json.loads((out / "inputs.json").read_text())["data"]]
    assert [body["max_completion_tokens"] for body in sent] == [output_tokens] * num_requests

    scraped = json.loads((out / "server_metrics_export.json").read_text())["metrics"]
    [latency] = scraped["inferlab_e2e_request_latency_seconds"]["series"]
    assert latency["stats"]["count"] == num_requests

    # its exports (summary and per-request records), imported, count what the server saw
    imported = check_import_matches_server(out, tmp_path / "imported", before, after)
    assert imported["imported"]["tool"] == "aiperf"
    assert imported["metrics"]["num_completed"] == num_requests
    assert imported["definitions"]["ttft_p50_s"]["same_as_lab"]  # from AIPerf's credits
