"""The server scrape: each server's name map read off a page written from its documented
schema (tests/fixtures/prometheus), histogram arithmetic as Prometheus does it, the scrape as
a monitor reader, and the run's figures between the scrapes that bracket it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest

from harness.measuring.monitors import Monitor
from harness.measuring.server_scrape import (
    SCRAPE_INDEX,
    SCRAPE_SERIES,
    DcgmScrape,
    Histogram,
    ServerScrape,
    detect_server,
    http_fetcher,
    parse_page,
    quantities,
    server_figures,
)

pytestmark = pytest.mark.serial  # asserts timings: run alone (Makefile's `test`)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "prometheus"


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_vllm_v1_page_sums_engines_and_averages_kv_usage() -> None:
    samples = parse_page(page("vllm_v1_serving.txt"))
    assert detect_server(name for name, _, _ in samples) == "vllm"
    q = quantities(samples, "vllm")
    assert (q["num_requests_running"], q["num_requests_waiting"]) == (5.0, 1.0)
    assert q["kv_cache_usage"] == pytest.approx(0.375)  # two engines' mean, not their sum
    assert q["prefix_cache_queries"] == 6000 and q["prefix_cache_hits"] == 1500
    assert q["num_preemptions"] == 3 and q["requests_finished"] == 60
    assert (q["prompt_tokens"], q["generation_tokens"]) == (6000, 9216)
    ttft = q["ttft"]
    assert (ttft.count, ttft.sum) == (60, pytest.approx(1.8))
    assert ttft.bounds == (0.01, 0.02, 0.04, 0.08, 0.16, float("inf"))
    assert ttft.cumulative == (0, 15, 45, 60, 60, 60)
    # rank 30 lies in (0.02, 0.04], 15 of its 30 in: halfway
    assert ttft.quantile(0.5) == pytest.approx(0.03)
    assert q["itl"].count == 9135 and q["e2e"].count == 60 and q["queue_time"].count == 60


@pytest.mark.parametrize(
    ("fixture", "server", "expected"),
    [
        (
            "sglang.txt",
            "sglang",
            {
                "num_requests_running": 162,
                "num_requests_waiting": 2826,
                "kv_cache_usage": 0.28,
                "prompt_tokens": 8128902,
                "generation_tokens": 7557572,
            },
        ),
        (
            "tgi.txt",
            "tgi",
            {"num_requests_running": 12, "num_requests_waiting": 7, "requests_finished": 100},
        ),
        (
            "llamacpp.txt",
            "llamacpp",
            {
                "num_requests_running": 4,
                "num_requests_waiting": 2,
                "kv_cache_usage": 0.125,
                "prompt_tokens": 3072,
                "generation_tokens": 2048,
            },
        ),
    ],
)
def test_each_servers_names(fixture: str, server: str, expected: dict[str, float]) -> None:
    samples = parse_page(page(fixture))
    assert detect_server(name for name, _, _ in samples) == server
    q = quantities(samples, server)
    for name, value in expected.items():
        assert q[name] == pytest.approx(value), name
    # what the server does not export is absent, never 0
    assert "prefix_cache_hits" not in q


def test_sglang_and_tgi_histograms() -> None:
    sglang = quantities(parse_page(page("sglang.txt")), "sglang")
    assert sglang["ttft"].count == 11008 and sglang["itl"].count == 7400757
    # rank 5504 of 11008 falls in the +Inf bucket: Prometheus answers the largest finite bound
    assert sglang["ttft"].quantile(0.5) == 30.0
    tgi = quantities(parse_page(page("tgi.txt")), "tgi")
    assert tgi["tpot"].mean() == pytest.approx(0.025)
    assert tgi["queue_time"].quantile(0.5) == pytest.approx(0.01 * 50 / 60)
    assert tgi["e2e"].count == 100 and "ttft" not in tgi  # TGI has no TTFT histogram


def test_a_page_with_inferlab_and_vllm_names_is_inferlab() -> None:
    names = ["vllm:num_requests_running", "inferlab_num_requests_running", "process_cpu"]
    assert detect_server(names) == "inferlab"
    assert detect_server(["process_cpu_seconds_total"]) is None


def test_histogram_differences() -> None:
    before = Histogram((0.1, 1.0, float("inf")), (2, 4, 4), 1.0, 4)
    after = Histogram((0.1, 1.0, float("inf")), (2, 10, 12), 9.0, 12)
    run = after.minus(before)
    assert run == Histogram((0.1, 1.0, float("inf")), (0, 6, 8), 8.0, 8)
    assert run is not None and run.mean() == 1.0
    assert run.quantile(0.5) == pytest.approx(0.1 + 0.9 * 4 / 6)
    assert before.minus(after) is None  # counts went down: a restart
    assert after.minus(Histogram((0.5, float("inf")), (0, 0), 0.0, 0)) is None
    assert Histogram((1.0, float("inf")), (0, 0), 0.0, 0).quantile(0.5) is None


def scripted(pages: list[str | Exception]) -> Any:
    """A fetch that answers the pages in turn."""
    answers = iter(pages)

    def fetch(url: str, timeout_s: float) -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return fetch


def vllm_page(running: float, generated: float, ttft_counts: tuple[int, int, int]) -> str:
    """A small vLLM page: one gauge, one counter, one histogram (buckets 0.01, 0.1, +Inf)."""
    cumulative = [sum(ttft_counts[: i + 1]) for i in range(3)]
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{model_name="m"}} {running}',
        "# TYPE vllm:generation_tokens_total counter",
        f'vllm:generation_tokens_total{{model_name="m"}} {generated}',
        "# TYPE vllm:time_to_first_token_seconds histogram",
        *(
            f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {c}'
            for le, c in zip(("0.01", "0.1", "+Inf"), cumulative, strict=True)
        ),
        f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {cumulative[-1]}',
        f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {0.05 * cumulative[-1]}',
    ]
    return "\n".join(lines) + "\n"


def test_scrape_keeps_pages_and_parses_them_after_the_run() -> None:
    scrape = ServerScrape(
        "http://server/metrics",
        fetch=scripted(
            [
                vllm_page(0, 100, (1, 0, 0)),
                vllm_page(4, 160, (1, 2, 0)),
                OSError("connection reset"),
                vllm_page(4, 200, (1, 3, 0)),
            ]
        ),
    )
    # during the run a scrape only points the monitor's row at its page
    assert [scrape.read() for _ in range(4)] == [
        {SCRAPE_INDEX: 0.0},
        {SCRAPE_INDEX: 1.0},
        {},  # a failed scrape after the first: counted, the run goes on
        {SCRAPE_INDEX: 2.0},
    ]
    info = scrape.info()
    assert info["server"] == "vllm" and info["num_scrapes"] == 3 and info["failed_scrapes"] == 1
    assert "connection reset" in info["first_failures"][0]
    columns, _ = scrape.parse()
    assert columns["server_num_requests_running"].tolist() == [0.0, 4.0, 4.0]
    assert columns["server_generation_tokens"].tolist() == [0.0, 60.0, 100.0]  # since the first
    assert columns["server_kv_cache_usage"].isna().all()  # not on the page
    series = scrape.series(t0_ns=0)
    assert (series["name"] == SCRAPE_SERIES).sum() == 3
    running = series[series["name"] == "vllm:num_requests_running"]
    assert list(running["value"]) == [0.0, 4.0]  # unchanged in the third: no row


def test_the_first_scrape_failing_is_an_error_for_the_monitor() -> None:
    with pytest.raises(OSError):
        ServerScrape("http://nothing/metrics", fetch=scripted([OSError("refused")])).read()
    unknown = ServerScrape("http://x/metrics", fetch=scripted(["# TYPE up gauge\nup 1\n"]))
    with pytest.raises(ValueError, match="no series of a known server"):
        unknown.read()


def figures_of(pages: list[str], times: list[float], span: tuple[float, float]) -> dict[str, Any]:
    scrape = ServerScrape("http://server/metrics", fetch=scripted(list(pages)))
    for _ in pages:
        scrape.read()
    rows = scrape.parse()[0].to_dict("records")
    series = scrape.series(t0_ns=0)
    # one time per scrape, in order: replace the wall clock's with the script's
    order = {t: i for i, t in enumerate(sorted(series["time_s"].unique()))}
    series["time_s"] = [times[order[t]] for t in series["time_s"]]
    samples = pd.DataFrame([{"time_s": t, **row} for t, row in zip(times, rows, strict=True)])
    assert scrape.server is not None
    return server_figures(series, samples, scrape.server, span)


def test_figures_are_the_differences_between_the_bracketing_scrapes() -> None:
    pages = [
        vllm_page(1, 100, (5, 0, 0)),  # warm-up done
        vllm_page(0, 110, (5, 0, 0)),  # the measured run's start
        vllm_page(4, 150, (6, 2, 0)),
        vllm_page(2, 180, (6, 4, 1)),  # its end
    ]
    figures = figures_of(pages, [-1.0, 0.0, 1.0, 3.0], span=(0.0, 3.0))
    assert figures["server_generation_tokens"] == 70  # the warm-up's 110 left out
    # one in (0, 0.01], four in (0.01, 0.1], one above: 6 observations, sum 0.05 each
    assert figures["server_ttft_mean_s"] == pytest.approx(0.05)
    assert figures["server_ttft_p50_s"] == pytest.approx(0.01 + 0.09 * 2 / 4)
    assert figures["server_ttft_p99_s"] == 0.1  # in the +Inf bucket: its lower bound
    # running: 0 for 1 s, 4 for 2 s
    assert figures["server_num_requests_running_mean"] == pytest.approx(8 / 3)
    assert figures["server_num_requests_running_peak"] == 4
    assert "server_prefix_cache_hit_rate" not in figures  # the page has no prefix cache series
    # a span inside one pair of scrapes takes the pair around it
    inner = figures_of(pages, [-1.0, 0.0, 1.0, 3.0], span=(1.5, 2.5))
    assert inner["server_generation_tokens"] == 30


def test_dcgm_columns_of_one_gpu_in_the_monitors_units() -> None:
    row = DcgmScrape("http://dcgm:9400/metrics", gpu=0, fetch=scripted([page("dcgm.txt")])).read()
    assert row == {
        "gpu_util": pytest.approx(0.87),
        "gpu_mem_used_bytes": 71680 * 2**20,
        "gpu_power_w": 612.5,
        "_gpu_energy_mj": 123456789,
    }
    with pytest.raises(ValueError, match="gpu 7"):
        DcgmScrape("http://dcgm/metrics", gpu=7, fetch=scripted([page("dcgm.txt")])).read()


def test_the_monitor_scrapes_on_its_own_interval_and_when_forced() -> None:
    pages = [vllm_page(i, 10 * i, (i, 0, 0)) for i in range(50)]
    scrape = ServerScrape("http://server/metrics", fetch=scripted(pages))
    monitor = Monitor(interval_s=0.01)
    monitor.watch_server(scrape, interval_s=10.0)
    monitor.start(gpu_index=None)
    monitor.sample_now()
    monitor.stop()
    frame = monitor.frame(t0_ns=0)
    # the start, the forced sample and the stop; never the 10 s interval in between
    assert scrape.num_scrapes == 3
    assert frame["server_generation_tokens"].dropna().tolist() == [0.0, 10.0, 20.0]
    assert monitor.info()["server"]["server"] == "vllm"


def test_a_server_without_metrics_is_a_note() -> None:
    monitor = Monitor(interval_s=0.01)
    monitor.watch_server(
        ServerScrape("http://server/metrics", fetch=scripted([OSError("404 Not Found")])), 1.0
    )
    monitor.start(gpu_index=None)
    monitor.stop()
    assert monitor.frame(t0_ns=0)["server_num_requests_running"].isna().all()
    assert any(
        "server_* (from http://server/metrics): not sampled: OSError: 404 Not Found" in note
        for note in monitor.info()["notes"]
    )


def test_dcgm_fills_the_monitors_gpu_columns_instead_of_nvml() -> None:
    energy = iter(range(1_000_000, 10_000_000, 500_000))  # +500 J per read

    def fetch(url: str, timeout_s: float) -> str:
        return page("dcgm.txt").replace("123456789", str(next(energy)))

    monitor = Monitor(interval_s=0.01)
    monitor.watch_dcgm(DcgmScrape("http://dcgm:9400/metrics", gpu=0, fetch=fetch), 0.001)
    monitor.start(gpu_index=0)
    monitor.stop()
    frame = monitor.frame(t0_ns=0)
    assert frame["gpu_util"].tolist() == pytest.approx([0.87] * len(frame))
    assert (frame["gpu_mem_used_bytes"] == 71680 * 2**20).all()
    assert list(frame["gpu_energy_j"]) == [500.0 * i for i in range(len(frame))]
    info = monitor.info()
    assert info["gpu_index"] is None  # NVML not asked: the GPU is the exporter's
    assert any(
        "from the dcgm-exporter at http://dcgm:9400/metrics, GPU 0" in n for n in info["notes"]
    )


def test_broken_pages_after_the_first_leave_their_rows_empty() -> None:
    good = vllm_page(1, 10, (1, 0, 0))
    broken_bound = good.replace('le="0.1"', 'le="ten"')
    scrape = ServerScrape(
        "http://server/metrics",
        fetch=scripted([good, "<html>502 Bad Gateway</html>", broken_bound]),
    )
    for _ in range(3):
        scrape.read()
    columns, _ = scrape.parse()
    assert columns["server_num_requests_running"].tolist()[0] == 1.0
    assert columns.iloc[1].isna().all()  # the HTML page
    assert columns["server_num_requests_running"].tolist()[2] == 1.0  # the bucket left out
    assert any("a page not parsed: ValueError" in f for f in scrape.info()["first_failures"])


def test_a_server_restarted_during_the_run_gives_no_counter_figures() -> None:
    """Counters that fell mid-run (the server restarted) were subtracted as if they had not:
    `server_*` columns went negative and the summary's figures counted whatever the new
    server had done since (here 50 tokens and 7 TTFTs where the run's requests made more)."""
    pages = [
        vllm_page(1, 100, (5, 0, 0)),  # the measured run's start
        vllm_page(4, 130, (6, 2, 0)),
        vllm_page(2, 20, (1, 0, 0)),  # restarted: counting again from 0
        vllm_page(2, 150, (3, 4, 0)),  # the end: above the start's values again
    ]
    figures = figures_of(pages, [0.0, 1.0, 2.0, 3.0], span=(0.0, 3.0))
    assert not any(k in figures for k in ("server_generation_tokens", "server_ttft_mean_s"))
    assert figures["server_num_requests_running_peak"] == 4  # gauges hold
    # a span that ends before the restart is measured as before
    before = figures_of(pages, [0.0, 1.0, 2.0, 3.0], span=(0.0, 1.0))
    assert before["server_generation_tokens"] == 30
    assert before["server_ttft_mean_s"] == pytest.approx(0.05)
    # the columns carry what the old server had counted: they never count backwards
    scrape = ServerScrape("http://server/metrics", fetch=scripted(list(pages)))
    for _ in pages:
        scrape.read()
    assert scrape.parse()[0]["server_generation_tokens"].tolist() == [0.0, 30.0, 50.0, 180.0]
    assert scrape.info()["counter_resets"] == [
        "scrape 3: generation_tokens fell from 130 to 20 (the server restarted?)"
    ]


class _Misbehaving(BaseHTTPRequestHandler):
    """/trickle: a page sent a byte every 0.2 s (each read well inside any read timeout);
    /huge: a page of 2 MB; anything else: a small vLLM page."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = vllm_page(1, 10, (1, 0, 0)).encode()
        if self.path == "/huge":
            body = b"# TYPE junk gauge\n" + b"junk 1\n" * 300_000 + body
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(10**6 if self.path == "/trickle" else len(body)))
        self.end_headers()
        if self.path != "/trickle":
            self.wfile.write(body)
            return
        for _ in range(200):
            try:
                self.wfile.write(b"#")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)


@pytest.fixture
def misbehaving() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_page_that_trickles_in_or_is_huge_is_a_failed_scrape(misbehaving: str) -> None:
    """httpx's timeout bounds each read, not the GET: a page trickling in a byte at a time
    held the scrape (and the run: the monitor's last scrape, the backend's spec-decode read)
    for as long as the server went on; a page of any size was read whole and kept."""
    fetch = http_fetcher(max_bytes=1_000_000)
    assert "vllm:num_requests_running" in fetch(f"{misbehaving}/good", 1.0)
    began = time.monotonic()
    with pytest.raises(httpx.ReadTimeout, match=r"the page took over 0\.5 s"):
        fetch(f"{misbehaving}/trickle", 0.5)
    assert time.monotonic() - began < 2.0
    with pytest.raises(ValueError, match="a page over 1000000 bytes"):
        fetch(f"{misbehaving}/huge", 5.0)
    # the monitor: the first scrape failing is a note; later ones are counted failures
    scrape = ServerScrape(f"{misbehaving}/trickle", timeout_s=0.5)
    with pytest.raises(httpx.ReadTimeout):
        scrape.read()
