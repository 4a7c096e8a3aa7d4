"""vLLM's tokenizer endpoints (serving/tokenize_routes.py): /tokenize gives the ids the
completion routes use for the same prompt (text, and chat messages through the chat template),
/detokenize inverts it, /tokenizer_info says what lm-eval's remote tokenizer reads; bad input
is a 400 naming the field, never a 500. Real uvicorn servers on loopback: model=tiny (the
project's BPE, dummy weights) and model=smollm2-135m (its GGUF's tokenizer and weights)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engines.builtin import EngineConfig
from engines.builtin.backend import BuiltinBackend
from serving import ServerConfig
from serving.testing import serve_in_thread

OPTIONS: dict[str, Any] = dict(
    dtype="float32",
    device="cpu",
    max_model_len=256,
    max_num_seqs=4,
    kv_cache="paged",
    kv_cache_memory_bytes=4 << 20,
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! 1 + 2 = 3",
    "  leading spaces, a tab\tand\nnew lines\n",
    "def f(x):\n    return {'a': [x, x**2]}  # code",
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Name a colour."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
]
API_KEY = "sk-tokenize-test"


def start(model: str, config: ServerConfig | None = None) -> Iterator[httpx.Client]:
    backend = BuiltinBackend(EngineConfig.from_dict({"model": model, **OPTIONS}))
    backend.load()
    try:
        with serve_in_thread(backend, config) as running:
            headers = {"Authorization": f"Bearer {API_KEY}"} if config else {}
            with httpx.Client(base_url=running.base_url, timeout=60, headers=headers) as c:
                yield c
    finally:
        backend.close()


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m"])
def client(request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    if request.param == "smollm2-135m":
        request.getfixturevalue("smollm2_gguf")  # installed by make setup-real, else it fails
    yield from start(request.param)


@pytest.fixture(scope="module")
def tiny() -> Iterator[httpx.Client]:
    yield from start("tiny")


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def served_model(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


# ---- the same tokens as the completion routes --------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_counts_what_a_completion_counts(client: httpx.Client, text: str) -> None:
    model = served_model(client)
    tokenized = post(client, "/tokenize", {"model": model, "prompt": text})
    completion = post(
        client,
        "/v1/completions",
        {"model": model, "prompt": text, "max_tokens": 1, "return_token_ids": True},
    )
    assert set(tokenized) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tokenized["token_strs"] is None  # as vLLM answers without return_token_strs
    assert tokenized["count"] == completion["usage"]["prompt_tokens"] == len(tokenized["tokens"])
    assert tokenized["tokens"] == completion["choices"][0]["prompt_token_ids"]
    assert tokenized["max_model_len"] == OPTIONS["max_model_len"]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "four-turns"])
def test_chat_tokens_are_the_chat_completions_prompt(
    client: httpx.Client, messages: list[dict[str, str]]
) -> None:
    tokenized = post(client, "/tokenize", {"messages": messages})
    chat = post(
        client,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 1, "return_token_ids": True},
    )
    assert tokenized["count"] == chat["usage"]["prompt_tokens"]
    assert tokenized["tokens"] == chat["prompt_token_ids"]
    # without the generation prompt the conversation is a strict prefix of it
    bare = post(client, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare["count"] < tokenized["count"]
    assert tokenized["tokens"][: bare["count"]] == bare["tokens"]


def test_chat_with_special_tokens_on_top_encodes_the_rendered_text(client: httpx.Client) -> None:
    messages = CONVERSATIONS[0]
    info = client.get("/tokenizer_info").json()
    plain = post(client, "/tokenize", {"messages": messages})["tokens"]
    extra = post(client, "/tokenize", {"messages": messages, "add_special_tokens": True})
    if info["add_bos_token"]:  # vLLM's meaning: the tokenizer's BOS on top of the template's
        assert extra["tokens"][-len(plain) :] == plain and len(extra["tokens"]) >= len(plain)
    else:
        assert extra["tokens"] == plain


# ---- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_detokenize_inverts_tokenize(client: httpx.Client, text: str) -> None:
    ids = post(client, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    assert post(client, "/detokenize", {"tokens": ids}) == {"prompt": text}
    # with the tokenizer's own additions the special tokens are spelled out, as vLLM's are
    info = client.get("/tokenizer_info").json()
    with_bos = post(client, "/tokenize", {"prompt": text})["tokens"]
    prefix = info["bos_token"] if info["add_bos_token"] else ""
    assert post(client, "/detokenize", {"tokens": with_bos})["prompt"] == prefix + text


def test_token_strs_spell_each_token(client: httpx.Client) -> None:
    text = TEXTS[1]
    got = post(client, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert len(got["token_strs"]) == got["count"]
    assert all(isinstance(s, str) and s for s in got["token_strs"])
    # each token string is what the id decodes to with special tokens kept (byte-level BPE
    # marks a leading space with "Ġ")
    for token_id, spelled in zip(got["tokens"], got["token_strs"], strict=True):
        decoded = post(client, "/detokenize", {"tokens": [token_id]})["prompt"]
        assert spelled.replace("Ġ", " ") == decoded
    chat = post(client, "/tokenize", {"messages": CONVERSATIONS[0], "return_token_strs": True})
    assert len(chat["token_strs"]) == chat["count"]


def test_tokenizer_info_is_what_a_remote_tokenizer_reads(client: httpx.Client) -> None:
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["model_max_length"] == OPTIONS["max_model_len"]
    assert isinstance(info["chat_template"], str) and "messages" in info["chat_template"]
    assert isinstance(info["eos_token"], str)  # lm-eval's check_remote_tokenizer_support
    # lm-eval's RemoteTokenizer finds EOS's id by tokenizing its text without specials
    eos = post(client, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos["count"] == 1
    if info["add_bos_token"]:
        first = post(client, "/tokenize", {"prompt": "x"})["tokens"][0]
        bos = post(client, "/tokenize", {"prompt": info["bos_token"], "add_special_tokens": False})
        assert bos["tokens"] == [first]


# ---- refusals ----------------------------------------------------------------------------------

VOCAB_TINY = 4096  # model=tiny's vocabulary (the model's, padded above the tokenizer's)
ERRORS: list[tuple[str, Any, str | None, str]] = [
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]", "invalid_value"),
    ("/detokenize", {"tokens": [10**30]}, "tokens[0]", "invalid_value"),
    ("/detokenize", {"tokens": [5, 999_999]}, "tokens[1]", "invalid_value"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [1.5]}, "tokens[0]", "invalid_type"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]", "invalid_type"),
    ("/detokenize", {}, "tokens", "missing_required_parameter"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, "model", "model_not_found"),
    ("/detokenize", {"tokens": [1], "skip": True}, "skip", "unknown_parameter"),
    ("/tokenize", {"prompt": 5}, "prompt", "invalid_type"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt", "invalid_type"),
    ("/tokenize", {}, "prompt", "missing_required_parameter"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model", "model_not_found"),
    (
        "/tokenize",
        {"prompt": "a", "add_special_tokens": "no"},
        "add_special_tokens",
        "invalid_type",
    ),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs", "invalid_type"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus", "unknown_parameter"),
    ("/tokenize", {"messages": []}, "messages", "invalid_value"),
    ("/tokenize", {"messages": "hi"}, "messages", "invalid_type"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "invalid_value"),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
        "invalid_type",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
        "continue_final_message",
        "unsupported_parameter",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
        "chat_template",
        "unsupported_parameter",
    ),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt", "invalid_value"),
    ("/tokenize", b"[1, 2]", None, "invalid_json"),
    ("/detokenize", b"{not json", None, "invalid_json"),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    ERRORS,
    ids=[f"{p.strip('/')}-{c}-{param}" for p, _, param, c in ERRORS],
)
def test_bad_input_is_a_400_naming_the_field(
    tiny: httpx.Client, path: str, body: Any, param: str | None, code: str
) -> None:
    if isinstance(body, bytes):
        response = tiny.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = tiny.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"], error


def test_the_last_id_of_the_vocabulary_is_served(tiny: httpx.Client) -> None:
    # ids above the tokenizer's own vocabulary (the model's padding) decode to nothing
    assert post(tiny, "/detokenize", {"tokens": [VOCAB_TINY - 1]}) == {"prompt": ""}
    response = tiny.post("/detokenize", json={"tokens": [VOCAB_TINY]})
    assert response.status_code == 400 and f"[0, {VOCAB_TINY})" in response.text
    assert post(tiny, "/detokenize", {"tokens": []}) == {"prompt": ""}


def test_a_body_not_sent_as_json_is_415(tiny: httpx.Client) -> None:
    response = tiny.post("/tokenize", content=b'{"prompt": "a"}')  # no Content-Type
    assert response.status_code == 415, response.text
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_an_api_key_guards_the_tokenizer_routes() -> None:
    for client in start("tiny", ServerConfig(api_key=API_KEY)):
        assert post(client, "/tokenize", {"prompt": "hi"})["count"] > 0
        assert client.get("/tokenizer_info").status_code == 200
        for method, path in (
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("GET", "/tokenizer_info"),
        ):
            response = client.request(
                method, path, json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"}
            )
            assert response.status_code == 401, (path, response.text)
