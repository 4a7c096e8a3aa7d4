"""`inferlab serve` with LoRA adapters (issue 41): /v1/models lists the adapters beside the base
model (vLLM's `root` and `parent`); a request names its adapter as `model` and gets what the
engine in process gives under that adapter, through the `openai` SDK; vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters at run time, with
400s naming the field; engine=openai runs an adapter workload against it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pandas as pd
import pytest
from checkpoints import write_random_lora
from tiny_server import OPTIONS

from engines.builtin.llm import LLM
from engines.sampling_params import SamplingParams
from serving.testing import RunningServer, serve_engine

PROMPT = [5, 9, 13, 2, 7, 11]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(write_random_lora(root / name, rank=4 * (k + 1), seed=k))
        for k, name in enumerate(["a", "b", "c"])
    }


def lora_options(adapters: dict[str, str], names: tuple[str, ...]) -> dict[str, Any]:
    return {
        **OPTIONS,
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 16,
        "lora_modules": {name: adapters[name] for name in names},
    }


@pytest.fixture(scope="module")
def server(adapters: dict[str, str]) -> Iterator[RunningServer]:
    with serve_engine(lora_options(adapters, ("a", "b"))) as running:
        yield running


@pytest.fixture(scope="module")
def in_process(adapters: dict[str, str]) -> dict[str | None, list[int]]:
    """The engine in process: each adapter's (and the base's) greedy tokens for PROMPT."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(model="tiny", **lora_options(adapters, ("a", "b", "c"))) as llm:
        names: list[str | None] = [None, "a", "b", "c"]
        outputs = llm.generate([PROMPT] * 4, params, lora_request=names)
    return {name: out.outputs[0].token_ids for name, out in zip(names, outputs, strict=True)}


@pytest.fixture(scope="module")
def sdk(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
        yield client


def tokens(sdk: openai.OpenAI, model: str) -> tuple[str, list[int]]:
    completion = sdk.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return completion.model, completion.choices[0].token_ids  # type: ignore[attr-defined]


def test_the_models_list_holds_the_adapters_with_their_parent(server: RunningServer) -> None:
    listed = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["tiny", "a", "b"]
    assert listed[0]["parent"] is None and {m["parent"] for m in listed[1:]} == {"tiny"}
    card = httpx.get(f"{server.base_url}/v1/models/b").json()
    assert card["id"] == "b" and card["root"].endswith("/b")


def test_a_request_names_its_adapter_and_gets_the_engines_tokens(
    sdk: openai.OpenAI, in_process: dict[str | None, list[int]]
) -> None:
    for model, name in (("tiny", None), ("a", "a"), ("b", "b")):
        answered_as, ids = tokens(sdk, model)
        assert answered_as == model and ids == in_process[name], model
    assert in_process["a"] != in_process[None] != in_process["b"]


def test_an_unknown_model_is_refused_naming_the_adapters(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        tokens(sdk, "nope")
    assert "this server serves `tiny` and its LoRA adapters a, b" in str(info.value)


def test_adapters_are_loaded_and_unloaded_at_run_time(
    server: RunningServer,
    sdk: openai.OpenAI,
    adapters: dict[str, str],
    in_process: dict[str | None, list[int]],
    tmp_path: Path,
) -> None:
    url = server.base_url

    def post(route: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{url}/v1/{route}", json=body)

    loaded = post("load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
    assert loaded.status_code == 200 and loaded.text == (
        "Success: LoRA adapter 'c' added successfully."
    )
    assert tokens(sdk, "c")[1] == in_process["c"]  # three adapters through two slots
    again = post("load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    missing = post("load_lora_adapter", {"lora_name": "d", "lora_path": str(tmp_path / "x")})
    error = missing.json()["error"]
    assert missing.status_code == 400 and error["param"] == "lora_path"
    assert error["message"].startswith("lora_modules.d: no such folder")
    unloaded = post("unload_lora_adapter", {"lora_name": "c"})
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", "a", "b"]
    gone = post("unload_lora_adapter", {"lora_name": "c"})
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "lora_name"
    bad = post("load_lora_adapter", {"lora_name": "e"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"


def test_an_admitted_requests_adapter_is_not_unloaded_under_it(server: RunningServer) -> None:
    """A request admitted under an adapter (its prompt tokenized, not yet in the engine) holds
    it: the unload is a 400 until the request ends (before, the request failed inside its 200
    stream with a 500)."""
    serving = server.serving
    admission = serving.admit(1, "n", "a")
    try:
        held = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert held.status_code == 400 and "in use" in held.json()["error"]["message"]
    finally:
        admission.release()
    assert not serving.adapter_holds


def test_an_adapter_named_as_the_served_model_is_refused(adapters: dict[str, str]) -> None:
    options = {**lora_options(adapters, ()), "lora_modules": {"tiny": adapters["a"]}}
    refused = r"^engine\.lora_modules\.tiny: the served model's name"
    with pytest.raises(ValueError, match=refused), serve_engine(options):
        pass


def test_an_adapter_workload_runs_through_engine_openai(
    server: RunningServer, tmp_path: Path
) -> None:
    from harness.cli import main as inferlab

    out = tmp_path / "run"
    code = inferlab(
        [
            "run",
            "engine=openai",
            "model=tiny",
            f"engine.base_url={server.base_url}/v1",
            "workload.num_requests=8",
            "workload.input_len=8",
            "workload.output_len=4",
            "workload.lora_adapters=[a,b]",
            "workload.lora_fraction=0.5",
            "run.warmup_requests=0",
            f"hydra.run.dir={out}",
        ]
    )
    assert code == 0
    requests = pd.read_parquet(out / "requests.parquet")
    assert (requests["status"] == "ok").all()
    assert requests["lora"].value_counts().to_dict() == {"a": 2, "b": 2}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["num_failed"] == 0
