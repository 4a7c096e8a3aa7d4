"""/metrics under both naming sets: the page parses with prometheus_client's reference parser,
every metric of serving/metric_names.py is there under its inferlab_ name and vLLM's with equal
values, counters and histograms move by exactly what known requests did (each request counted
once), engine counters (preemptions, prefix-cache hits) are exported, `metrics_names` selects
the names, and every series vLLM's Grafana dashboard queries is served. A real uvicorn server
on loopback, model=tiny."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_server import OPTIONS as TINY_OPTIONS

from engines.builtin import EngineConfig
from engines.builtin.backend import BuiltinBackend
from harness.measuring.server_scrape import parse_page, quantities
from serving import ServerConfig
from serving.metric_names import ENGINE_INDEX, METRICS, MetricSpec, resolve
from serving.metrics import FINISH_REASONS
from serving.prometheus import CollectorRegistry, Naming, Series, render
from serving.testing import RunningServer, serve_engine, serve_in_thread

OPTIONS: dict[str, Any] = {**TINY_OPTIONS, "enable_prefix_caching": True}
SERVED = "tiny-served"
COMPLETIONS = "/v1/completions"
Key = tuple[str, frozenset[tuple[str, str]]]

# What the vLLM Grafana dashboard (vllm-project/vllm,
# examples/observability/prometheus_grafana/grafana.json) queries, each with
# {model_name="$model_name"}: every one is something the engine produces.
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(OPTIONS, ServerConfig(served_model_name=SERVED)) as running:
        yield running


def scrape(client: httpx.Client) -> tuple[dict[str, str], dict[Key, float]]:
    """(family name -> type, sample -> value), read with prometheus_client's parser."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    types: dict[str, str] = {}
    samples: dict[Key, float] = {}
    for family in text_string_to_metric_families(response.text):
        assert family.name not in types, f"{family.name} twice"
        types[family.name] = family.type
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = sample.value
    assert not any(name.endswith("_created") for name, _ in samples)  # filtered out
    return types, samples


def family_of(name: str) -> str:
    """The family prometheus_client's parser files a counter under (without `_total`)."""
    return name.removesuffix("_total")


def of(samples: dict[Key, float], name: str, vllm: bool = False) -> dict[Key, float]:
    """The samples of metric `name` (its _total / _bucket / _sum / _count too), keyed by suffix
    and labels; vLLM's model_name and engine labels are checked and dropped."""
    family = family_of(name)
    found = {}
    for (sample, labels), value in samples.items():
        suffix = sample[len(family) :]
        if not sample.startswith(family) or suffix not in (
            "",
            "_total",
            "_bucket",
            "_sum",
            "_count",
        ):
            continue
        label_map = dict(labels)
        if vllm:
            assert (label_map.pop("model_name"), label_map.pop("engine")) == (SERVED, ENGINE_INDEX)
        found[(suffix, frozenset(label_map.items()))] = value
    return found


def value(samples: dict[Key, float], name: str, suffix: str = "", **labels: str) -> float:
    """One sample of an inferlab_ metric."""
    return samples[(family_of(name) + suffix, frozenset(labels.items()))]


def exported(spec: MetricSpec, spec_decode: bool = False) -> bool:
    return spec.needs is None or spec.needs == "prefix_caching" or spec_decode


def assert_names_agree(samples: dict[Key, float], specs: list[MetricSpec]) -> None:
    """Every vLLM name of each metric has exactly the inferlab_ name's values; histograms
    agree on count, sum and every bound the two share."""
    for spec in specs:
        ours = of(samples, spec.inferlab)
        assert ours, spec.inferlab
        for name in spec.vllm:
            theirs = of(samples, name, vllm=True)
            assert theirs, name
            if spec.kind != "histogram":
                assert theirs == ours, name
                continue
            shared = {k for k in ours if k[0] != "_bucket"} | (
                {k for k in ours if k[0] == "_bucket"} & set(theirs)
            )
            assert len(shared) > 3, name  # count, sum, +Inf and some bound in common
            assert {k: theirs[k] for k in shared} == {k: ours[k] for k in shared}, name


def complete(client: httpx.Client, **payload: Any) -> dict[str, Any]:
    response = client.post(COMPLETIONS, json=payload)
    assert response.status_code == 200, response.text
    return response.json()


# ---- both names, equal values -------------------------------------------------------------------


def test_every_metric_under_both_names_with_equal_values(client: httpx.Client) -> None:
    _, before = scrape(client)
    complete(client, prompt="Once upon a time", max_tokens=6, ignore_eos=True)
    complete(client, prompt=list(range(700, 740)), max_tokens=3, ignore_eos=True)
    complete(client, prompt=list(range(700, 740)), max_tokens=3, ignore_eos=True)  # a hit
    complete(client, prompt="Hi", max_tokens=4, n=2, temperature=1.0, seed=3)
    types, samples = scrape(client)
    specs = [spec for spec in METRICS if exported(spec)]
    for spec in specs:  # every name, with its type
        for name in (spec.inferlab, *spec.vllm):
            assert types.get(family_of(name)) == spec.kind, name
    assert not any(s.needs == "spec_decode" and family_of(s.inferlab) in types for s in METRICS)
    assert_names_agree(samples, specs)
    # the check above compared real values, not zeros

    def moved(name: str, suffix: str) -> float:
        return value(samples, name, suffix) - value(before, name, suffix)

    assert moved("inferlab_generation_tokens_total", "_total") == 6 + 3 + 3 + 8
    assert moved("inferlab_prefix_cache_hits_total", "_total") > 0
    # per sequence, as vLLM's: the n=2 request's two choices are two
    assert moved("inferlab_request_queue_time_seconds", "_count") == 5


def test_the_vllm_dashboards_series_are_served(client: httpx.Client) -> None:
    complete(client, prompt="Hello", max_tokens=2)
    _, samples = scrape(client)
    served = {name for (name, labels) in samples if ("model_name", SERVED) in labels}
    assert not [name for name in DASHBOARD_SERIES if name not in served]
    # bounds as vLLM's: a dashboard's heatmaps and quantiles read them
    ttft = {
        dict(labels)["le"]
        for name, labels in samples
        if name == "vllm:time_to_first_token_seconds_bucket"
    }
    assert {"0.001", "0.005", "160.0", "640.0", "2560.0", "+Inf"} <= ttft
    e2e = {
        dict(labels)["le"]
        for name, labels in samples
        if name == "vllm:e2e_request_latency_seconds_bucket"
    }
    assert {"0.3", "0.8", "7680.0"} <= e2e
    prompt = {
        dict(labels)["le"]
        for name, labels in samples
        if name == "vllm:request_prompt_tokens_bucket"
    }
    assert prompt == {
        "1.0",
        "2.0",
        "5.0",
        "10.0",
        "20.0",
        "50.0",
        "100.0",
        "200.0",
        "+Inf",
    }  # to 256


# ---- what known requests move ----------------------------------------------------------------


def test_counters_and_histograms_move_by_what_the_requests_did(client: httpx.Client) -> None:
    def moved(
        before: dict[Key, float], after: dict[Key, float], name: str, suffix: str, **labels: str
    ) -> float:
        return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)

    # one prompt, one choice, exactly 7 tokens
    _, before = scrape(client)
    body = complete(client, prompt="The quick brown fox", max_tokens=7, ignore_eos=True)
    _, after = scrape(client)
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert moved(before, after, "inferlab_prompt_tokens_total", "_total") == prompt_tokens
    assert moved(before, after, "inferlab_generation_tokens_total", "_total") == 7
    assert (
        moved(before, after, "inferlab_request_success_total", "_total", finished_reason="length")
        == 1
    )
    assert moved(before, after, "inferlab_inter_token_latency_seconds", "_count") == 6
    for name in (  # once per request
        "inferlab_time_to_first_token_seconds",
        "inferlab_e2e_request_latency_seconds",
        "inferlab_request_queue_time_seconds",
        "inferlab_request_prefill_time_seconds",
        "inferlab_request_decode_time_seconds",
        "inferlab_request_inference_time_seconds",
        "inferlab_request_prompt_tokens",
        "inferlab_request_generation_tokens",
        "inferlab_request_max_num_generation_tokens",
        "inferlab_request_params_n",
        "inferlab_request_params_max_tokens",
    ):
        assert moved(before, after, name, "_count") == 1, name
    for name, total in [
        ("inferlab_request_prompt_tokens", prompt_tokens),
        ("inferlab_request_generation_tokens", 7),
        ("inferlab_request_max_num_generation_tokens", 7),
        ("inferlab_request_params_n", 1),
        ("inferlab_request_params_max_tokens", 7),
    ]:
        assert moved(before, after, name, "_sum") == total, name

    def seconds(name: str) -> float:
        return moved(before, after, name, "_sum")

    # the phases add up: decode = the ITLs of its one sequence, inference = prefill + decode,
    # and the whole request (from its arrival at the server) holds them all
    decode = seconds("inferlab_request_decode_time_seconds")
    assert decode == pytest.approx(seconds("inferlab_inter_token_latency_seconds"), rel=1e-6)
    inference = seconds("inferlab_request_inference_time_seconds")
    assert inference == pytest.approx(seconds("inferlab_request_prefill_time_seconds") + decode)
    assert seconds("inferlab_e2e_request_latency_seconds") >= inference
    assert seconds("inferlab_time_to_first_token_seconds") >= seconds(
        "inferlab_request_prefill_time_seconds"
    )
    assert 0 < decode < seconds("inferlab_e2e_request_latency_seconds")

    # n=2: two sequences finish, one prompt; vLLM's units (two child requests of one parent)
    before = after
    body = complete(client, prompt="Hello", max_tokens=5, n=2, temperature=1.0, seed=1)
    _, after = scrape(client)
    lengths = [5, 5] if all(c["finish_reason"] == "length" for c in body["choices"]) else None
    assert (
        moved(before, after, "inferlab_request_success_total", "_total", finished_reason="length")
        + moved(before, after, "inferlab_request_success_total", "_total", finished_reason="stop")
        == 2
    )
    assert (
        moved(before, after, "inferlab_request_generation_tokens", "_sum")
        == body["usage"]["completion_tokens"]
    )
    for name in (  # per sequence
        "inferlab_request_generation_tokens",
        "inferlab_time_to_first_token_seconds",
        "inferlab_request_queue_time_seconds",
        "inferlab_e2e_request_latency_seconds",
        "inferlab_request_prompt_tokens",
    ):
        assert moved(before, after, name, "_count") == 2, name
    for name in ("inferlab_request_max_num_generation_tokens", "inferlab_request_params_n"):
        assert moved(before, after, name, "_count") == 1, name  # per prompt
    # the choices share one prefill: its prompt tokens once
    assert (
        moved(before, after, "inferlab_prompt_tokens_total", "_total")
        == (body["usage"]["prompt_tokens"])
    )
    assert moved(before, after, "inferlab_request_params_n", "_sum") == 2
    if lengths:
        assert moved(before, after, "inferlab_request_max_num_generation_tokens", "_sum") == 5


# ---- n > 1: one unit per series, as vLLM's ---------------------------------------------------

# vLLM v1 runs a prompt with n choices as n child requests (vllm/v1/engine/parallel_sampling.py)
# and records each child's stats as a request's (vllm/v1/engine/output_processor.py,
# vllm/v1/metrics/stats.py): the unit of these series is the sequence (prompt x choice).
PER_SEQUENCE_AT_FINISH = (  # one observation per sequence that finished (stop or length)
    "inferlab_e2e_request_latency_seconds",
    "inferlab_request_queue_time_seconds",
    "inferlab_request_prefill_time_seconds",
    "inferlab_request_decode_time_seconds",
    "inferlab_request_inference_time_seconds",
    "inferlab_request_prompt_tokens",
    "inferlab_request_generation_tokens",
    "inferlab_request_params_max_tokens",
)
# ... and once per prompt (vLLM's parent request), when its last choice finishes
PER_PROMPT_AT_FINISH = (
    "inferlab_request_max_num_generation_tokens",
    "inferlab_request_params_n",
)
CANCEL = "cancel"  # a streaming request its client closes once every choice has a token


async def _n2_request(c: httpx.AsyncClient, kind: str) -> tuple[int, int]:
    """One n=2 request of `kind`; (sequences finished, prompts finished) as the client saw."""
    base: dict[str, Any] = {"n": 2, "temperature": 1.0, "max_tokens": 12}
    if kind == "stop":  # stop strings: some choices end early on them, some at max_tokens
        body = complete_async(c, {**base, "prompt": "Tell me", "stop": ["e", "a"]})
        choices = (await body)["choices"]
        return len(choices), 1
    if kind == "prompts":  # two prompts of two choices: four sequences
        body = complete_async(c, {**base, "prompt": ["One", "Two three"]})
        return len((await body)["choices"]), 2
    payload = {**base, "prompt": "Stream it", "stop": [" the"]}
    if kind == "plain":
        return len((await complete_async(c, payload))["choices"]), 1
    payload["stream"] = True
    if kind == CANCEL:  # long enough that no choice finishes before the abort arrives
        payload.update(max_tokens=200, ignore_eos=True, stop=[])
    seen: set[int] = set()
    async with c.stream("POST", COMPLETIONS, json=payload) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            seen.update(choice["index"] for choice in json.loads(line[6:])["choices"])
            if kind == CANCEL and seen == {0, 1}:
                return 0, 0  # leaving the block closes the connection: the server aborts
    assert seen == {0, 1}
    return 2, 1


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def complete_async(c: httpx.AsyncClient, payload: dict[str, Any]) -> dict[str, Any]:
    response = await c.post(COMPLETIONS, json=payload)
    assert response.status_code == 200, response.text
    return response.json()


def test_n2_counts_sequences_in_success_e2e_and_ttft_alike(
    server: RunningServer, client: httpx.Client
) -> None:
    """Many concurrent n=2 requests (stop strings, streaming or not, several prompts, some
    closed by their client mid-stream): request_success, the E2E histogram and every
    per-finish histogram count each finished sequence once; TTFT counts each sequence that
    produced a token (vLLM records it at the child's first token, so a sequence aborted after
    its first token is in TTFT but not in success or E2E, as in vLLM); n and the most output
    tokens count each finished prompt once."""
    kinds = ["stop", "stream", "prompts", CANCEL, "plain"] * 6

    async def run() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            return await asyncio.gather(*(_n2_request(c, kind) for kind in kinds))

    _, before = scrape(client)
    results = asyncio.run(run())
    cancelled = kinds.count(CANCEL)
    # an abort lands once the server notices the closed connection: wait for it to go idle
    assert wait_until(lambda: value(scrape(client)[1], "inferlab_num_requests_admitted") == 0)
    _, after = scrape(client)

    def moved(name: str, suffix: str) -> float:
        return value(after, name, suffix) - value(before, name, suffix)

    def finished() -> float:  # over every finish reason
        name = "inferlab_request_success_total"
        return sum(
            value(after, name, "_total", finished_reason=r)
            - value(before, name, "_total", finished_reason=r)
            for r in FINISH_REASONS
        )

    sequences = sum(finished for finished, _ in results)
    prompts = sum(finished for _, finished in results)
    assert sequences == 2 * prompts == 2 * (len(kinds) - cancelled + kinds.count("prompts"))
    assert finished() == sequences  # per sequence
    for name in PER_SEQUENCE_AT_FINISH:
        assert moved(name, "_count") == sequences, name
    for name in PER_PROMPT_AT_FINISH:
        assert moved(name, "_count") == prompts, name
    # per sequence too, at its first token: the cancelled requests' two choices had theirs
    ttft = moved("inferlab_time_to_first_token_seconds", "_count")
    assert ttft == sequences + 2 * cancelled
    assert moved("inferlab_requests_aborted_total", "_total") == cancelled
    assert_names_agree(after, [spec for spec in METRICS if exported(spec)])


def test_a_repeated_prompt_hits_the_prefix_cache(client: httpx.Client) -> None:
    prompt = list(range(900, 940))  # 40 tokens: 2 full blocks of 16, then 8
    _, first = scrape(client)
    complete(client, prompt=prompt, max_tokens=2, ignore_eos=True)
    _, second = scrape(client)
    complete(client, prompt=prompt, max_tokens=2, ignore_eos=True)
    _, third = scrape(client)

    def moved(before: dict[Key, float], after: dict[Key, float], name: str) -> float:
        return value(after, name, "_total") - value(before, name, "_total")

    assert moved(first, second, "inferlab_prefix_cache_queries_total") == 40
    assert moved(first, second, "inferlab_prefix_cache_hits_total") == 0  # never seen
    assert moved(second, third, "inferlab_prefix_cache_queries_total") == 40
    assert moved(second, third, "inferlab_prefix_cache_hits_total") == 32  # its full blocks
    assert of(third, "vllm:prefix_cache_hits_total", vllm=True) == of(
        third, "inferlab_prefix_cache_hits_total"
    )


# ---- engine counters -------------------------------------------------------------------------


def test_preemptions_are_counted_under_both_names() -> None:
    """A KV pool too small for four long sequences at once: the engine preempts, and /metrics
    exports exactly the engine's count."""
    options = {**OPTIONS, "enable_prefix_caching": False, "kv_cache_memory_bytes": 12 * 8192}
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **options}))
    backend.load()
    assert backend.engine is not None and backend.engine.kv.layout.num_blocks <= 13
    payload = {"prompt": list(range(50, 60)), "max_tokens": 60, "ignore_eos": True}

    async def run(base_url: str) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
            responses = await asyncio.gather(*(c.post(COMPLETIONS, json=payload) for _ in range(4)))
        assert [r.status_code for r in responses] == [200] * 4

    try:
        with (
            serve_in_thread(backend, ServerConfig(served_model_name=SERVED)) as running,
            httpx.Client(base_url=running.base_url, timeout=60) as c,
        ):
            asyncio.run(run(running.base_url))
            types, samples = scrape(c)
            engine_count = running.serving.engine_thread.stats.num_preemptions
    finally:
        backend.close()
    assert engine_count > 0
    assert value(samples, "inferlab_num_preemptions_total", "_total") == engine_count
    assert of(samples, "vllm:num_preemptions_total", vllm=True) == of(
        samples, "inferlab_num_preemptions_total"
    )
    # no prefix caching: its counters are absent, not zeros
    assert "inferlab_prefix_cache_hits" not in types and "vllm:prefix_cache_hits" not in types


def test_speculative_decoding_counters_under_both_names() -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    options = {**OPTIONS, "enable_prefix_caching": False, "speculative_config": ngram}
    rng = random.Random(2)
    stretch = [rng.randrange(10, 4000) for _ in range(6)]
    prompt = [rng.randrange(10, 4000) for _ in range(5)] + stretch * 3  # lookups find drafts
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **options}))
    backend.load()
    try:
        with (
            serve_in_thread(backend, ServerConfig(served_model_name=SERVED)) as running,
            httpx.Client(base_url=running.base_url, timeout=60) as c,
        ):
            complete(c, prompt=prompt, max_tokens=30, temperature=0)
            types, samples = scrape(c)
    finally:
        backend.close()
    specs = [spec for spec in METRICS if spec.needs == "spec_decode"]
    assert_names_agree(samples, specs)
    assert value(samples, "inferlab_spec_decode_num_accepted_tokens_total", "_total") > 0
    # drafts per position: ours only (vLLM has no such series)
    assert "inferlab_spec_decode_num_draft_tokens_per_pos" in types
    assert not any(name.startswith("vllm:spec_decode_num_draft_tokens_per_pos") for name in types)


# ---- the option ---------------------------------------------------------------------------------


@pytest.mark.parametrize("names", [("vllm",), ("inferlab",)])
def test_metrics_names_selects_the_names(names: tuple[str, ...]) -> None:
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **OPTIONS}))
    backend.load()
    try:
        with (
            serve_in_thread(
                backend, ServerConfig(served_model_name=SERVED, metrics_names=names)
            ) as running,
            httpx.Client(base_url=running.base_url, timeout=60) as c,
        ):
            complete(c, prompt="Hello", max_tokens=3, ignore_eos=True)
            types, samples = scrape(c)
    finally:
        backend.close()
    prefixes = {"vllm:" if name.startswith("vllm:") else "inferlab_" for name in types}
    assert prefixes == {"vllm:" if names == ("vllm",) else "inferlab_"}
    if names == ("vllm",):
        expected = {family_of(n) for spec in METRICS if exported(spec) for n in spec.vllm}
        assert set(types) == expected
        assert value_any(samples, "vllm:generation_tokens_total") == 3
    else:
        expected = {family_of(spec.inferlab) for spec in METRICS if exported(spec)}
        assert set(types) == expected
        assert value(samples, "inferlab_generation_tokens_total", "_total") == 3


def value_any(samples: dict[Key, float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_inferlabs_ttft_bounds_resolve_a_cpu_sized_ttft() -> None:
    """inferlab_'s TTFT bounds went from 0.1 straight to 0.25 s, so server_ttft_p50_s of a CPU
    run's TTFTs (0.1 to 0.2 s) was 0.175 s whatever they were; vLLM's own bounds stay vLLM's."""
    [spec] = [s for s in METRICS if s.key == "ttft"]
    bounds = resolve(spec.buckets, OPTIONS["max_model_len"])
    for ttft in (0.12, 0.15, 0.18):  # the bucket holding it is at most 50 ms wide
        upper = min(b for b in bounds if b >= ttft)
        lower = max((b for b in bounds if b < ttft), default=0.0)
        assert upper - lower <= 0.05 + 1e-9, (ttft, lower, upper)
    registry = CollectorRegistry()
    series = Series(registry, "histogram", spec.help, [Naming(spec.inferlab, {}, bounds)])
    for ttft in (0.11, 0.12, 0.13):
        series.observe(ttft)
    scraped = quantities(parse_page(render(registry).decode()), "inferlab")["ttft"]
    assert scraped.quantile(0.5) == pytest.approx(0.12, abs=0.01)  # 0.175 before
    assert set(resolve(spec.vllm_buckets, 256)) >= {0.1, 0.25, 0.5, 0.75, 1.0, 2560.0}
    assert not set(resolve(spec.vllm_buckets, 256)) & {0.15, 0.2, 0.3, 0.4, 0.6, 0.8}


def test_kv_tier_counters_follow_the_engine() -> None:
    """A pool of 12 blocks of 4 and a host tier: prompts that evict each other come back from
    the tier, and /metrics exports the engine's counts."""
    options = {**OPTIONS, "kv_cache": "paged", "block_size": 4}
    options.update(kv_cache_memory_bytes=12 * 4 * 512, kv_host_tier_bytes=1 << 20)
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **options}))
    backend.load()
    prompts = [list(range(100 * i + 10, 100 * i + 42)) for i in range(4)]  # 8 blocks each
    try:
        with (
            serve_in_thread(backend, ServerConfig(served_model_name=SERVED)) as running,
            httpx.Client(base_url=running.base_url, timeout=60) as c,
        ):
            for prompt in prompts + prompts[::-1]:
                complete(c, prompt=prompt, max_tokens=2, ignore_eos=True)
            _, samples = scrape(c)
            stats = running.serving.engine_thread.stats
    finally:
        backend.close()
    assert stats.kv_tier_hits[0] > 0
    assert value(samples, "inferlab_kv_host_tier_hits_total", "_total") == stats.kv_tier_hits[0]
    assert value(samples, "inferlab_kv_disk_tier_hits_total", "_total") == 0  # no disk tier
    assert value(samples, "inferlab_kv_host_tier_blocks") == stats.kv_tier_blocks[0] > 0
    assert_names_agree(samples, [spec for spec in METRICS if spec.needs == "kv_tiers"])
