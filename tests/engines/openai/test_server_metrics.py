"""A server's speculative-decoding counters from its /metrics page: vLLM's names, summed over
engines, the run's share as the difference of two reads, and the metrics they give."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engines.openai import backend as openai_backend
from engines.openai.backend import OpenAIBackend
from engines.openai.config import OpenAIConfig, OpenAIConfigError
from engines.openai.server_metrics import MAX_POSITIONS, metrics_url, parse_spec_decode
from harness.measuring.metrics import server_spec_summary

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "prometheus" / "vllm_spec_decode.txt"


def test_vllm_counters_are_summed_over_engines() -> None:
    counters = parse_spec_decode(FIXTURE.read_text())
    assert counters is not None and counters.server == "vllm"
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (
        1600,
        4800,
        3200,
    )
    assert counters.num_accepted_tokens_per_pos == (1400, 1050, 750)
    assert counters.num_draft_tokens_per_pos == ()  # vLLM has no such series


def test_the_runs_counts_are_the_difference_of_two_reads() -> None:
    text = FIXTURE.read_text()
    before = parse_spec_decode(text)
    after = parse_spec_decode(
        text.replace(" 3000.0", " 3300.0")
        .replace(" 2100.0", " 2300.0")
        .replace('position="0"} 900.0', 'position="0"} 990.0')
    )
    assert after is not None and before is not None
    run = after.since(before)
    assert run is not None
    assert (run.num_drafts, run.num_draft_tokens, run.num_accepted_tokens) == (0, 300, 200)
    assert run.num_accepted_tokens_per_pos == (90, 0, 0)


def test_server_counts_give_the_engine_metrics() -> None:
    counters = parse_spec_decode(FIXTURE.read_text())
    assert counters is not None
    metrics = server_spec_summary(counters.to_dict())
    assert metrics["spec_acceptance_rate"] == pytest.approx(3200 / 4800)
    assert metrics["spec_mean_accepted_length"] == pytest.approx(1 + 3200 / 1600)
    # vLLM: a position's rate over every verifying row
    assert [metrics[f"spec_acceptance_rate_pos{i}"] for i in (1, 2, 3)] == pytest.approx(
        [1400 / 1600, 1050 / 1600, 750 / 1600]
    )
    assert "spec_acceptance_rate_pos4" not in metrics


def test_a_page_with_both_names_is_read_once() -> None:
    """inferlab serve exports each counter under its inferlab_ name and vLLM's: the two are one
    count, read under inferlab_ (which also counts drafts per position), never summed."""
    vllm_page = FIXTURE.read_text()
    ours = "\n".join(
        line.replace("vllm:", "inferlab_")
        for line in vllm_page.splitlines()
        if 'engine="0"' in line or line.startswith("#")
    )
    ours += (
        "\n# TYPE inferlab_spec_decode_num_draft_tokens_per_pos_total counter\n"
        'inferlab_spec_decode_num_draft_tokens_per_pos_total{position="0"} 1000.0\n'
    )
    counters = parse_spec_decode(vllm_page + ours)
    assert counters is not None and counters.server == "inferlab"
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (
        1000,
        3000,
        2100,
    )
    assert counters.num_draft_tokens_per_pos == (1000,)
    assert counters.num_accepted_tokens_per_pos == (900, 700, 500)


def test_a_page_without_the_counters_gives_none() -> None:
    page = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
    assert parse_spec_decode(page) is None
    assert parse_spec_decode("") is None
    assert server_spec_summary(None) == {}


@pytest.mark.parametrize(
    ("base_url", "expected"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/metrics"),
        ("https://host/prefix/v1/", "https://host/prefix/metrics"),
        ("http://host:9000", "http://host:9000/metrics"),
    ],
)
def test_metrics_url_is_the_servers_root(base_url: str, expected: str) -> None:
    assert metrics_url(base_url) == expected


def test_a_bad_metrics_url_is_named() -> None:
    with pytest.raises(OpenAIConfigError, match=r"engine.metrics_url: 'ftp://x' .*auto\|none"):
        OpenAIConfig(model="m", metrics_url="ftp://x")


def test_counters_that_went_down_give_no_counts() -> None:
    """A server restarted between the two reads: its counters start over, and a difference
    would be negative; nothing is reported rather than nonsense."""
    text = FIXTURE.read_text()
    before = parse_spec_decode(text)
    after = parse_spec_decode(text.replace(" 1000.0", " 10.0"))
    assert before is not None and after is not None
    assert after.since(before) is None


def test_a_position_label_past_the_cap_is_ignored() -> None:
    page = FIXTURE.read_text() + (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="100000000"} 1.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="x"} 1.0\n'
    )
    counters = parse_spec_decode(page)
    assert counters is not None and counters.num_accepted_tokens_per_pos == (1400, 1050, 750)
    assert MAX_POSITIONS >= 8


def backend_reading(pages: list[str | None], monkeypatch: pytest.MonkeyPatch) -> OpenAIBackend:
    """An engine=openai backend whose /metrics reads answer `pages` in turn (None: HTTP 500)."""
    answers = iter(pages)

    def get(client: httpx.Client, url: str, timeout_s: float) -> str:
        page = next(answers)
        if page is None:
            request = httpx.Request("GET", url)
            response = httpx.Response(500, text="boom", request=request)
            raise httpx.HTTPStatusError("boom", request=request, response=response)
        return page

    monkeypatch.setattr(openai_backend, "get_page", get)
    return OpenAIBackend(OpenAIConfig(model="m"))


def test_the_run_gets_the_servers_counts_between_the_two_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = FIXTURE.read_text()
    backend = backend_reading([text, text.replace(" 3000.0", " 3100.0")], monkeypatch)
    assert backend.describe()["server_spec_decode"] is None  # before the measured requests
    backend.start_measuring()
    counts = backend.describe()["server_spec_decode"]
    assert counts["server"] == "vllm" and counts["num_draft_tokens"] == 100


def test_a_failed_first_read_gives_no_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Else the server's lifetime totals would pass for the run's."""
    text = FIXTURE.read_text()
    backend = backend_reading([None, text], monkeypatch)
    backend.start_measuring()
    assert backend.describe()["server_spec_decode"] is None
