"""Synthetic workloads, length specs and the harness contract: seeded, lengths as asked, valid
prompts, shared prefixes, sessions, clear errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from omegaconf import OmegaConf

import configs
from models.tokenizer import default_tokenizer
from workloads import (
    WORKLOAD_TYPES,
    SyntheticWorkload,
    clip_to_context,
    config_keys,
    from_config,
    parse_length,
)
from workloads.prompts import REPEAT_INSTRUCTION


def test_random_id_prompts_have_exact_lengths_and_no_special_ids() -> None:
    tok = default_tokenizer()
    reqs = SyntheticWorkload(num_requests=20, input_len=[5, 40], output_len=[1, 9], seed=3).build(
        tok
    )
    assert len(reqs) == 20 and len({r.request_id for r in reqs}) == 20
    for r in reqs:
        assert isinstance(r.request.prompt, list)
        assert len(r.request.prompt) == r.prompt_tokens_requested
        assert 5 <= len(r.request.prompt) <= 40 and 1 <= r.request.sampling.max_tokens <= 9
        assert not any(tok.is_special(t) for t in r.request.prompt)
        assert r.arrival_s == 0.0 and r.request.sampling.ignore_eos
    lengths = {len(r.request.prompt) for r in reqs}
    assert len(lengths) > 5  # a range really varies


def test_seed_reproduces_and_changes() -> None:
    tok = default_tokenizer()
    a = SyntheticWorkload(num_requests=5, input_len=[5, 40], seed=1).build(tok)
    b = SyntheticWorkload(num_requests=5, input_len=[5, 40], seed=1).build(tok)
    c = SyntheticWorkload(num_requests=5, input_len=[5, 40], seed=2).build(tok)
    assert [r.request.prompt for r in a] == [r.request.prompt for r in b]
    assert [r.request.prompt for r in a] != [r.request.prompt for r in c]


def test_text_prompts_come_from_the_corpus(tmp_path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    tok = default_tokenizer()
    reqs = SyntheticWorkload(num_requests=3, input_len=16, prompt="text", corpus=str(corpus)).build(
        tok
    )
    for r in reqs:
        assert isinstance(r.request.prompt, str) and r.request.prompt
        words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog.", "dog"}
        assert set(r.request.prompt.split()) <= words
        assert abs(len(tok.encode(r.request.prompt, add_special_tokens=False)) - 16) <= 2


def test_repeat_prompts_ask_to_repeat_the_same_windows(tmp_path) -> None:
    """prompt=repeat: the text prompt=text draws, in a chat asking for it back (output that
    overlaps the prompt, for speculative decoding)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    tok = default_tokenizer()

    def build(kind: str) -> list:
        workload = SyntheticWorkload(num_requests=3, input_len=16, prompt=kind, corpus=str(corpus))
        return [r.request.prompt for r in workload.build(tok)]

    for text, chat in zip(build("text"), build("repeat"), strict=True):
        assert chat == [{"role": "user", "content": REPEAT_INSTRUCTION + text}]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("input_len", 0, "workload.input_len"),
        ("output_len", [9, 3], "workload.output_len"),
        ("input_len", "long", "workload.input_len"),
        ("prompt", "poetry", "workload.prompt"),
        ("num_requests", -1, "workload.num_requests"),
        # finite, but past float's range: float() raised OverflowError
        ("temperature", 10**400, "workload.temperature"),
        ("temperature", float("nan"), "workload.temperature"),
        ("corpus", "/no/such/file.txt", "workload.corpus"),
    ],
)
def test_bad_settings_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace(".", r"\.")):
        SyntheticWorkload(**{field: value}).validate()


# ---- length specs ---------------------------------------------------------------------------


def test_lognormal_mean_is_the_mean_of_the_lengths() -> None:
    mean, sigma, n = 300.0, 0.8, 40_000
    values = parse_length("input_len", {"dist": "lognormal", "mean": mean, "sigma": sigma}).sample(
        n, np.random.default_rng(0)
    )
    # The CV of a lognormal is sqrt(exp(sigma^2) - 1), so the sample mean's standard error is
    # mean * CV / sqrt(n); rounding to integers moves the mean by far less than that.
    cv = math.sqrt(math.exp(sigma**2) - 1)
    assert abs(values.mean() - mean) < 5 * mean * cv / math.sqrt(n)
    assert values.dtype.kind == "i" and values.min() >= 1
    # mu = ln(mean) - sigma^2 / 2: the median sits below the mean by exp(sigma^2 / 2).
    assert np.median(values) == pytest.approx(mean * math.exp(-(sigma**2) / 2), rel=0.03)


def test_normal_uniform_and_fixed_specs() -> None:
    rng = np.random.default_rng(1)
    n = 20_000
    normal = parse_length("output_len", {"dist": "normal", "mean": 100, "std": 20}).sample(n, rng)
    assert abs(normal.mean() - 100) < 5 * 20 / math.sqrt(n)
    assert abs(normal.std() - 20) < 1.0
    tiny = parse_length("output_len", {"dist": "normal", "mean": 1, "std": 5}).sample(500, rng)
    assert tiny.min() == 1  # raised to at least 1
    uniform = parse_length("x", {"dist": "uniform", "low": 3, "high": 5}).sample(1000, rng)
    assert set(uniform.tolist()) == {3, 4, 5}
    assert set(parse_length("x", [3, 5]).sample(1000, rng).tolist()) == {3, 4, 5}
    assert parse_length("x", 7).sample(3, rng).tolist() == [7, 7, 7]


def test_empirical_lengths_come_from_the_trace(tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,10,1\n2023-11-16 18:15:47.0,20,0\n"
        "2023-11-16 18:15:48.0,30,3\n"
    )
    spec = parse_length(
        "input_len", {"dist": "empirical", "path": str(path), "format": "azure", "field": "input"}
    )
    values = spec.sample(500, np.random.default_rng(0))
    assert set(values.tolist()) == {10, 30}  # the zero-output row is skipped
    out = parse_length(
        "output_len", {"dist": "empirical", "path": str(path), "format": "azure", "field": "output"}
    )
    assert set(out.sample(500, np.random.default_rng(0)).tolist()) == {1, 3}
    reqs = SyntheticWorkload(
        num_requests=8,
        input_len={"dist": "empirical", "path": str(path), "format": "azure", "field": "input"},
    ).build()
    assert {len(r.request.prompt) for r in reqs} <= {10, 30}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"dist": "poisson", "mean": 3}, r"workload\.input_len\.dist: 'poisson' is invalid"),
        ({"dist": "lognormal", "mean": 100}, r"workload\.input_len\.sigma"),
        ({"dist": "lognormal", "mean": -1, "sigma": 1}, r"workload\.input_len\.mean"),
        ({"dist": "normal", "mean": 10, "std": 1, "max": 3}, r"workload\.input_len: unknown key"),
        ({"dist": "uniform", "low": 5, "high": 2}, r"workload\.input_len"),
        (
            {"dist": "empirical", "path": "x", "format": "excel", "field": "input"},
            r"workload\.input_len\.format",
        ),
        (
            {"dist": "empirical", "path": "x", "format": "azure", "field": "both"},
            r"workload\.input_len\.field",
        ),
        (
            {"dist": "empirical", "path": "/no/file", "format": "azure", "field": "input"},
            r"workload\.input_len\.path: no file",
        ),
        ([1, 2, 3], r"workload\.input_len"),
        (True, r"workload\.input_len"),
    ],
)
def test_bad_length_specs_name_the_field(value: object, message: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        parse_length("input_len", value)


def test_clipping_rule_output_first_then_input() -> None:
    inputs = np.array([10, 90, 10, 300, 50])
    outputs = np.array([10, 20, 150, 300, 50])
    clipped_in, clipped_out, info = clip_to_context(inputs, outputs, 100)
    assert clipped_out.tolist() == [10, 20, 99, 99, 50]
    assert clipped_in.tolist() == [10, 80, 1, 1, 50]
    assert np.all(clipped_in + clipped_out <= 100) and clipped_in.min() >= 1
    assert info == {
        "context_len": 100,
        "clipped_output": 2,
        "clipped_input": 3,
        "clipped_requests": 3,
    }
    same_in, same_out, none = clip_to_context(inputs, outputs, None)
    assert same_in.tolist() == inputs.tolist() and same_out.tolist() == outputs.tolist()
    assert none["clipped_requests"] == 0
    with pytest.raises(ValueError, match="context_len"):
        clip_to_context(inputs, outputs, 1)


def test_synthetic_build_clips_to_the_context_and_counts() -> None:
    w = SyntheticWorkload(num_requests=50, input_len=[10, 80], output_len=[10, 80], seed=4)
    reqs = w.build(default_tokenizer(), context_len=100)
    for r in reqs:
        assert len(r.request.prompt) + r.request.sampling.max_tokens <= 100
        assert len(r.request.prompt) == r.prompt_tokens_requested
    assert w.info["clipped_input"] > 0 and w.info["clipped_output"] == 0
    assert w.info["clipped_requests"] == sum(
        1
        for r in SyntheticWorkload(
            num_requests=50, input_len=[10, 80], output_len=[10, 80], seed=4
        ).build()
        if len(r.request.prompt) + r.request.sampling.max_tokens > 100
    )


# ---- shared prefixes and sessions -----------------------------------------------------------


def test_shared_prefix_groups_share_exactly_prefix_len_tokens() -> None:
    w = SyntheticWorkload(
        num_requests=12,
        input_len=[20, 30],
        output_len=4,
        seed=2,
        shared_prefix={"num_groups": 3, "prefix_len": 16},
    )
    reqs = w.build()
    groups: dict[str, list[list[int]]] = {}
    for i, r in enumerate(reqs):
        assert r.request.prefix_group == f"req-g{i % 3}"
        assert len(r.request.prompt) == r.prompt_tokens_requested  # input_len is the total
        groups.setdefault(r.request.prefix_group, []).append(r.request.prompt)
    assert len(groups) == 3
    heads = {}
    for name, prompts in groups.items():
        heads[name] = prompts[0][:16]
        for p in prompts:
            assert p[:16] == heads[name]
        for a in prompts:  # the suffixes are the requests' own: they differ at token 16
            assert sum(a[16] == b[16] for b in prompts) == 1
    assert len({tuple(h) for h in heads.values()}) == 3
    assert w.info["prefix_groups"] == 3


def test_shared_prefix_must_fit_the_input() -> None:
    with pytest.raises(ValueError, match=r"workload\.shared_prefix\.prefix_len: 40 is invalid"):
        SyntheticWorkload(
            input_len=[32, 64], shared_prefix={"num_groups": 2, "prefix_len": 40}
        ).validate()
    with pytest.raises(ValueError, match=r"workload\.shared_prefix\.num_groups"):
        SyntheticWorkload(shared_prefix={"num_groups": 0, "prefix_len": 4}).validate()
    w = SyntheticWorkload(
        num_requests=200,
        input_len={"dist": "normal", "mean": 20, "std": 10},
        shared_prefix={"num_groups": 1, "prefix_len": 12},
    )
    reqs = w.build()
    assert min(len(r.request.prompt) for r in reqs) >= 12
    assert w.info["raised_to_prefix_len"] > 0


def test_sessions_structure() -> None:
    w = SyntheticWorkload(
        num_requests=10,
        input_len=5,
        output_len=3,
        seed=1,
        sessions={"num_turns": 3, "think_time_s": 1.5},
        arrival={"process": "poisson", "rate": 2.0},
    )
    reqs = w.build()
    assert len(reqs) == 10 and w.info["sessions"] == 4
    by_id = {r.request_id: r for r in reqs}
    assert len(by_id) == 10
    for i, r in enumerate(reqs):
        session, turn = divmod(i, 3)
        assert r.request.session_id == f"req-s{session}" and r.request.turn == turn
        assert len(r.request.prompt) == 5  # only the new user part
        if turn == 0:
            assert r.follows is None
        else:
            previous = by_id[r.follows]
            assert previous.request.session_id == r.request.session_id
            assert previous.request.turn == turn - 1 and r.arrival_s == 1.5
    starts = [r.arrival_s for r in reqs if r.request.turn == 0]
    assert len(starts) == 4 and starts[0] == 0.0 and starts == sorted(starts)
    assert reqs[-1].request.turn == 0  # the 4th session is cut short by num_requests
    with pytest.raises(ValueError, match=r"workload\.sessions\.num_turns"):
        SyntheticWorkload(sessions={"num_turns": 0}).validate()
    with pytest.raises(ValueError, match=r"workload\.sessions: unknown key"):
        SyntheticWorkload(sessions={"num_turns": 2, "think": 1}).validate()


def test_sessions_with_shared_prefix_put_the_prefix_on_turn_zero() -> None:
    reqs = SyntheticWorkload(
        num_requests=8,
        input_len=10,
        sessions={"num_turns": 2},
        shared_prefix={"num_groups": 2, "prefix_len": 6},
    ).build()
    firsts = [r for r in reqs if r.request.turn == 0]
    assert firsts[0].request.prompt[:6] == firsts[2].request.prompt[:6]
    assert firsts[0].request.prompt[:6] != firsts[1].request.prompt[:6]
    assert all(r.request.prefix_group == f"req-g{(i // 2) % 2}" for i, r in enumerate(reqs))


# ---- the harness contract -------------------------------------------------------------------


def test_workload_types_contract(tmp_path) -> None:
    assert set(WORKLOAD_TYPES) == {"synthetic", "trace", "prompts", "tool_calls"}
    for cls in WORKLOAD_TYPES.values():
        keys = config_keys(cls)
        assert "info" not in keys and "concurrency" not in keys
        assert {"seed", "num_requests", "id_prefix", "ignore_eos", "temperature"} <= set(keys)
    w = from_config(
        {
            "type": "synthetic",
            "num_requests": 3,
            "temperature": 0.5,
            "ignore_eos": False,
            "sampling": {"top_k": 5},
        }
    )
    reqs = w.build(None)  # no tokenizer: the default one
    s = reqs[0].request.sampling
    assert (s.temperature, s.ignore_eos, s.top_k, s.max_tokens) == (0.5, False, 5, 64)
    assert w.info["requests"] == 3 and w.info["tokenizer"]
    json.dumps(w.info)  # the harness writes it into summary.json
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bogus'\] for type trace"):
        from_config({"type": "trace", "bogus": 1})
    with pytest.raises(ValueError, match=r"workload\.type: 'replay' is invalid"):
        from_config({"type": "replay"})
    with pytest.raises(ValueError, match=r"workload\.sampling"):
        SyntheticWorkload(sampling={"max_tokens": 3}).validate()
    with pytest.raises(ValueError, match=r"workload\.temperature"):
        SyntheticWorkload(temperature=-1).validate()


def test_shipped_configs_build(tmp_path) -> None:
    for name in WORKLOAD_TYPES:  # each extends its type's schema
        options = OmegaConf.to_container(configs.compose([f"workload={name}"]).workload)
        assert isinstance(options, dict) and options["type"] == name
        assert set(options) - {"type"} == set(config_keys(WORKLOAD_TYPES[name]))
    synthetic = OmegaConf.to_container(configs.compose([]).workload)
    assert isinstance(synthetic, dict)
    assert len(from_config(synthetic).build()) == synthetic["num_requests"]
