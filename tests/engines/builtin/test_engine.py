"""End-to-end behaviour of the built-in engine on the `tiny` preset: KV modes agree, batching
does not change results, inputs are validated by name, stops and limits end requests with the
right reason, and the contiguous KV cache accounts its slots exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines.base import ConfigError, Finished, Tokens
from engines.builtin import LLM, EngineConfig, SamplingParams, platform
from models.config import kv_bytes_per_token

PROMPTS = [
    "Hello, world! The quick brown fox",
    [100, 200, 300],
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate",
    [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69],
    "x",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Write a line about the sea."},
]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_none_and_contiguous_give_identical_greedy_tokens(make_tiny) -> None:
    outs = {kv: make_tiny(kv_cache=kv).generate(PROMPTS, greedy()) for kv in ("none", "contiguous")}
    for a, b in zip(outs["none"], outs["contiguous"], strict=True):
        assert a.finish_reason == b.finish_reason == "length"
        assert len(a.token_ids) == 24
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        assert a.prompt_token_ids == b.prompt_token_ids


@pytest.mark.parametrize("kv_cache", ["none", "contiguous"])
def test_batch_equals_each_prompt_alone(make_tiny, kv_cache: str) -> None:
    llm = make_tiny(kv_cache=kv_cache)
    batch = llm.generate(PROMPTS, greedy())
    alone = [llm.generate(p, greedy())[0] for p in PROMPTS]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    assert [o.text for o in batch] == [o.text for o in alone]


def test_batch_with_fewer_slots_than_requests(make_tiny) -> None:
    """A budget for two sequences queues the rest; results are unchanged."""
    reference = make_tiny().generate(PROMPTS, greedy())
    bpt = kv_bytes_per_token(make_tiny().engine.model_config, 4)
    llm = make_tiny(kv_cache_memory_bytes=2 * 256 * bpt + 100)
    assert llm.engine.limits.max_num_seqs == 2
    live = []
    llm.engine.step_observers.append(lambda r: live.append(r.num_seqs))
    outs = llm.generate(PROMPTS, greedy())
    assert max(live) == 2
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]


def test_prompt_forms(tiny_llm: LLM) -> None:
    text, tokens, chat = tiny_llm.generate(["Hello there", [300, 301, 302], CHAT], greedy(8))
    assert text.prompt_token_ids == tiny_llm.tokenizer.encode("Hello there")
    assert tokens.prompt_token_ids == [300, 301, 302]
    assert chat.prompt_token_ids == tiny_llm.tokenizer.encode_chat(CHAT)
    for out in (text, tokens, chat):
        assert out.error is None and out.finish_reason == "length"
        assert len(out.token_ids) == 8
        assert out.text == tiny_llm.tokenizer.decode(out.token_ids)
    # a single prompt of each form is not mistaken for a batch
    assert tiny_llm.generate(CHAT, greedy(8))[0].token_ids == chat.token_ids
    assert tiny_llm.generate([300, 301, 302], greedy(8))[0].token_ids == tokens.token_ids
    assert tiny_llm.generate("Hello there", greedy(8))[0].token_ids == text.token_ids


def test_outputs_keep_input_order_and_metrics(tiny_llm: LLM) -> None:
    outs = tiny_llm.generate(PROMPTS, [greedy(n) for n in (3, 9, 1, 5, 7)])
    assert [len(o.token_ids) for o in outs] == [3, 9, 1, 5, 7]
    for o in outs:
        m = o.metrics
        assert len(m.token_times_ns) == len(o.token_ids)
        assert m.arrival_ns <= m.first_token_ns <= m.finished_ns
        assert m.token_times_ns == sorted(m.token_times_ns)
        assert m.ttft_s is not None and m.ttft_s >= 0


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(n=0), "n"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_revalidated_at_add_request(tiny_llm: LLM) -> None:
    params = SamplingParams()
    params.top_p = 2.0  # mutated after construction
    with pytest.raises(ValueError, match="top_p"):
        tiny_llm.generate([5, 6, 7, 8], params)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_bad_prompts_name_the_issue(make_tiny) -> None:
    llm = make_tiny(max_model_len=32)
    with pytest.raises(ValueError, match="prompt: empty"):
        llm.generate([[]], greedy())
    # '' tokenizes to BOS alone; the server refuses it too rather than generate from nothing
    with pytest.raises(ValueError, match="prompt: empty"):
        llm.generate("", greedy())
    with pytest.raises(ValueError, match=r"prompt: 32 tokens .*max_model_len=32"):
        llm.generate([list(range(10, 42))], greedy())
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        llm.generate([[10, 4096]], greedy())
    with pytest.raises(ValueError, match="prompt: expected"):
        llm.engine.add_request("r", 3.5, greedy())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy()])
    llm.engine.add_request("dup", [10, 11], greedy(2))
    with pytest.raises(ValueError, match="request_id"):
        llm.engine.add_request("dup", [10, 11], greedy(2))
    llm.engine.abort_request("dup")
    # 31 tokens leave room for exactly one output token
    out = llm.generate([list(range(10, 41))], greedy(8))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_rejected_batch_leaves_nothing_queued(make_tiny) -> None:
    """A bad prompt in a batch rejects the call without leaving earlier prompts in the engine."""
    llm = make_tiny()
    with pytest.raises(ValueError, match="prompt: empty"):
        llm.generate([[10, 11, 12], [20, 21], []], greedy())
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_live == 0
    assert not llm.engine.sequences
    steps = []
    llm.engine.step_observers.append(lambda r: steps.append(r.num_seqs))
    out = llm.generate([30, 31], greedy(3))
    assert len(out) == 1 and len(out[0].token_ids) == 3
    assert max(steps) == 1  # nothing left over ran alongside


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        (dict(model="no-such-preset"), r"model: 'no-such-preset' is neither a preset"),
        (dict(foo=1), r"unknown option\(s\) \['foo'\]"),
        (
            dict(enable_prefix_caching=True),
            r"enable_prefix_caching=true needs engine\.kv_cache=paged",
        ),
        (
            dict(quantization="int4", quantization_zero_point="half"),
            r"engine\.quantization_zero_point: 'half' is invalid; allowed: float\|int",
        ),
        (
            dict(kv_cache="bogus"),
            r"engine\.kv_cache: 'bogus' is invalid; allowed: none\|contiguous",
        ),
        (dict(dtype="int3"), r"engine\.dtype"),
        (dict(device="tpu"), r"engine\.device"),
        (dict(max_num_seqs=0), r"engine\.max_num_seqs"),
        (dict(max_num_seqs=True), r"engine\.max_num_seqs: True is invalid; allowed: an integer"),
        (
            dict(tensor_parallel_size=True),
            r"engine\.tensor_parallel_size: True is invalid; allowed: an integer >= 1",
        ),
        (dict(max_model_len=0), r"engine\.max_model_len"),
        *(
            (
                dict(debug_step_delay_fraction=value),
                rf"engine\.debug_step_delay_fraction: {value} is invalid; allowed: a finite "
                "number >= 0",
            )
            for value in (float("inf"), float("nan"))
        ),
        (
            dict(gpu_memory_utilization=float("nan")),
            r"engine\.gpu_memory_utilization: nan is invalid; allowed: a number in \(0, 1\]",
        ),
        (dict(max_model_len=4096), r"max_model_len=4096 exceeds .*max_position_embeddings=1024"),
        (dict(model_overrides={"nope": 1}), r"model\.overrides: unknown field\(s\) \['nope'\]"),
        (dict(kv_cache_memory_bytes=1000), r"kv_cache_memory_bytes: a budget of 1000 bytes"),
        # refused before any rank starts (a timedelta of inf seconds overflows in every rank;
        # one under a second fails a healthy engine's first collectives, or its start)
        *(
            (
                dict(tensor_parallel_size=2, tensor_parallel_timeout_s=value),
                rf"engine\.tensor_parallel_timeout_s: {value} is invalid; allowed: a number of "
                r"seconds >= 1 and <= 31536000",
            )
            for value in (float("inf"), 1e15, float("nan"), 0, 1e-7, 0.5)
        ),
    ],
)
def test_bad_engine_options_name_the_issue(options, pattern: str) -> None:
    options = {"model": "tiny", "dtype": "float32", **options}
    with pytest.raises(ValueError, match=pattern):
        LLM(**options)


def test_engine_config_from_dict() -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['bar', 'foo'\]"):
        EngineConfig.from_dict({"model": "tiny", "foo": 1, "bar": 2})
    config = EngineConfig.from_dict({"model": "tiny", "dtype": "bf16", "kv_cache": "none"})
    assert config.dtype == "bfloat16" and config.kv_cache == "none"
    with pytest.raises(ConfigError, match=r"quantization_group_size: 48 is invalid"):
        EngineConfig.from_dict({"quantization": "int4", "quantization_group_size": 48})


# ---- stopping -------------------------------------------------------------------------------


def test_stop_string_truncates_text(tiny_llm: LLM) -> None:
    prompt = "Shall I compare thee to a summer's day?"
    full = tiny_llm.generate(prompt, greedy(40))[0]
    assert len(full.text) > 30
    stop = full.text[12:16]
    cut = full.text.find(stop)
    assert cut > 0
    out = tiny_llm.generate(prompt, greedy(40, stop=[stop, "never-appears-anywhere"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    kept = tiny_llm.generate(prompt, greedy(40, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop"
    assert kept.text == full.text[: cut + len(stop)]
    assert kept.token_ids == out.token_ids


def test_stop_string_streaming_never_leaks_stop_text(tiny_llm: LLM) -> None:
    """Streamed Tokens deltas add up to the final text and never show the stop string."""
    engine = tiny_llm.engine
    prompt = [300, 301, 302, 303]
    full = tiny_llm.generate(prompt, greedy(40))[0].text
    stop = full[20:23]
    engine.add_request("stream", prompt, greedy(40, stop=[stop]))
    deltas, finished = [], None
    while engine.has_unfinished_requests():
        for event in engine.step():
            if event.request_id != "stream":
                continue
            if isinstance(event, Tokens):
                deltas.append(event.text)
            elif isinstance(event, Finished):
                finished = event
    assert finished is not None and finished.finish_reason == "stop"
    assert "".join(deltas) == finished.text == full[: full.find(stop)]


def test_stop_token_ids(tiny_llm: LLM) -> None:
    full = tiny_llm.generate([400, 401, 402], greedy(20))[0].token_ids
    target = full[6]
    first = full.index(target)
    out = tiny_llm.generate([400, 401, 402], greedy(20, stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[: first + 1]


def test_eos_stops_unless_ignored(make_tiny) -> None:
    """Make the greedy third token an EOS id via model_overrides; it ends the request."""
    llm = make_tiny()
    full = llm.generate([500, 501], greedy(10))[0].token_ids
    eos = full[2]
    llm = make_tiny(model_overrides={"eos_token_ids": [eos]})
    assert eos in llm.engine.eos_ids
    stopped = llm.generate([500, 501], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full[: full.index(eos) + 1]
    ignored = llm.generate([500, 501], greedy(10))[0]
    assert ignored.token_ids == full and ignored.finish_reason == "length"


def test_max_model_len_finishes_with_length(make_tiny) -> None:
    for kv in ("none", "contiguous"):
        llm = make_tiny(kv_cache=kv, max_model_len=32)
        out = llm.generate([list(range(100, 120))], greedy(100))[0]
        assert out.finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.token_ids) == 32


# ---- KV cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache", ["none", "contiguous"])
def test_abort_frees_the_kv_slot(make_tiny, kv_cache: str) -> None:
    engine = make_tiny(kv_cache=kv_cache).engine
    engine.add_request("a", [10, 11, 12], greedy(50))
    engine.add_request("b", [20, 21], greedy(50))
    engine.step()
    engine.step()
    assert engine.kv.num_live == 2
    engine.abort_request("a")
    assert engine.kv.num_live == 1
    assert "a" not in engine.sequences
    events = engine.step()
    aborted = [e for e in events if isinstance(e, Finished) and e.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    assert not any(isinstance(e, Tokens) and e.request_id == "a" for e in events)
    engine.abort_request("b")
    engine.abort_request("b")  # twice is harmless
    engine.abort_request("never-added")
    assert engine.kv.num_live == 0
    assert engine.kv.bytes_reserved() == 0
    engine.step()
    assert not engine.has_unfinished_requests()


def test_abort_waiting_request(make_tiny) -> None:
    engine = make_tiny().engine
    engine.add_request("w", [10, 11, 12], greedy(5))
    engine.abort_request("w")
    assert not engine.has_unfinished_requests()
    events = engine.step()
    assert [e.finish_reason for e in events if isinstance(e, Finished)] == ["abort"]
    assert engine.kv.num_live == 0


def test_contiguous_kv_accounting(make_tiny) -> None:
    max_model_len = 128
    llm = make_tiny(kv_cache="contiguous", max_model_len=max_model_len)
    engine = llm.engine
    cfg = engine.model_config
    bpt = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    assert engine.kv.layout.bytes_per_token == bpt
    assert engine.kv.layout.block_size == max_model_len
    records = []

    def check(record) -> None:
        live = engine.kv.num_live
        assert live == len(engine.scheduler.running)
        assert record.kv_bytes_reserved == engine.kv.bytes_reserved()
        assert record.kv_bytes_reserved == live * max_model_len * bpt
        held = sum(s.num_computed_tokens for s in engine.scheduler.running)
        assert record.kv_bytes_used == held * bpt
        records.append((live, record.kv_bytes_reserved))

    engine.step_observers.append(check)
    outs = llm.generate(PROMPTS, [greedy(n) for n in (4, 12, 8, 16, 2)])
    assert [len(o.token_ids) for o in outs] == [4, 12, 8, 16, 2]
    assert records[0][0] == len(PROMPTS)
    assert sorted({live for live, _ in records}, reverse=True)[:2] == [5, 4]  # slots free early
    assert engine.kv.num_live == 0
    assert engine.kv.bytes_reserved() == 0 and engine.kv.bytes_used() == 0
    assert sorted(engine.kv.free_slots) == list(range(engine.kv.layout.num_blocks))


def test_kv_none_holds_nothing(make_tiny) -> None:
    llm = make_tiny(kv_cache="none")
    seen = []
    llm.engine.step_observers.append(
        lambda r: seen.append((r.kv_bytes_reserved, r.kv_bytes_used, r.decode_tokens))
    )
    llm.generate(PROMPTS[:2], greedy(5))
    assert seen and all(s == (0, 0, 0) for s in seen)  # every step recomputes the context


def test_describe_states_the_kv_budget_and_where_it_came_from(make_tiny, monkeypatch) -> None:
    """The CPU default comes from psutil's *available* memory (page cache counts), not free
    pages: with 2 GB available and almost nothing free, a quarter of the 2 GB."""
    monkeypatch.setattr(
        platform.psutil,
        "virtual_memory",
        lambda: SimpleNamespace(total=32 * 10**9, available=2 * 10**9, free=10**6),
    )
    monkeypatch.setattr(platform, "cgroup_memory_headroom", lambda: None)
    facts = make_tiny(max_num_seqs=2).engine.describe()
    assert facts["kv_budget_bytes"] == 5 * 10**8
    assert facts["kv_budget_reason"] == (
        "min(4 GiB, 0.25 x 1.86 GiB available (psutil available, after the weights were loaded))"
    )
    paged = make_tiny(max_num_seqs=2, kv_cache="paged").engine.describe()
    assert paged["kv_budget_reason"].endswith(
        "; capped at max_num_seqs=2 sequences of max_model_len"
    )
    given = make_tiny(max_num_seqs=2, kv_cache_memory_bytes=10**7).engine.describe()
    assert (given["kv_budget_bytes"], given["kv_budget_reason"]) == (
        10**7,
        "engine.kv_cache_memory_bytes=10000000",
    )


def test_a_budget_too_small_names_where_it_came_from(make_tiny, monkeypatch) -> None:
    monkeypatch.setattr(
        platform.psutil,
        "virtual_memory",
        lambda: SimpleNamespace(total=32 * 10**9, available=10**5, free=10**5),
    )
    monkeypatch.setattr(platform, "cgroup_memory_headroom", lambda: None)
    with pytest.raises(
        ValueError,
        match=r"holds no sequence of max_model_len=256 .*budget: "
        r"min\(4 GiB, 0.25 x 0.00 GiB available",
    ):
        make_tiny()
