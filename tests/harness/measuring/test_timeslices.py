"""timeslices.csv's table on hand-made frames with known answers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from harness.measuring.metrics import compute_summary
from harness.measuring.timeslices import COLUMNS, automatic_slice_s, timeslices
from harness.run_folder import REQUEST_COLUMNS, TOKEN_COLUMNS, read_timeslices, write_timeslices
from harness.running.run_config import RunConfig


def request(request_id: str, status: str, sent: float, token_times: list[float],
            finished: float | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "request_id": request_id,
        "status": status,
        "arrival_s": sent,
        "sent_s": sent,
        "first_token_s": token_times[0] if token_times else None,
        "last_token_s": token_times[-1] if token_times else None,
        "finished_s": finished if finished is not None else (token_times or [sent])[-1],
        "prompt_tokens": 8,
        "output_tokens": len(token_times),
    }


def frames(rows: list[tuple[dict[str, Any], list[float]]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    requests = pd.DataFrame([r for r, _ in rows]).reindex(columns=REQUEST_COLUMNS)
    tokens = pd.DataFrame(
        [
            {"request_id": r["request_id"], "index": i, "time_s": t}
            for r, times in rows
            for i, t in enumerate(times)
        ]
    ).reindex(columns=TOKEN_COLUMNS)
    return requests, tokens


def run() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Over [0, 4] s in 1 s slices: a (ok) sent 0, tokens 0.5, 0.7, 1.1; b (ok) sent 0.2,
    tokens 1.5, 1.6, 3.9; c failed at 1.2; d cancelled at 2.5 after a token at 2.2; nothing
    streams of an ok request in [2, 3)."""
    a = [0.5, 0.7, 1.1]
    b = [1.5, 1.6, 3.9]
    d = [2.2]
    return frames(
        [
            (request("a", "ok", 0.0, a), a),
            (request("b", "ok", 0.2, b), b),
            (request("c", "failed", 0.9, [], finished=1.2), []),
            (request("d", "cancelled", 2.0, d, finished=2.5), d),
            (request("e", "ok", 3.1, [4.0]), [4.0]),
        ]
    )


def test_each_slice_counts_what_happened_inside_it() -> None:
    table = timeslices(*run(), slice_s=1.0)
    assert list(table.columns) == list(COLUMNS)
    assert table["slice_start_s"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert table["slice_end_s"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert table["requests_sent"].tolist() == [3, 0, 1, 1]
    assert table["requests_completed"].tolist() == [0, 1, 0, 2]  # a at 1.1; b 3.9, e 4.0
    assert table["requests_failed"].tolist() == [0, 1, 0, 0]
    assert table["requests_cancelled"].tolist() == [0, 0, 1, 0]
    # a, b, c; b (c failed, a done); b (d sent and cancelled); none at the run's end
    assert table["in_flight"].tolist() == [3, 1, 1, 0]
    # d's token is a cancelled request's: not counted, as the summary counts none of it
    assert table["output_tokens"].tolist() == [2, 3, 0, 2]
    assert table["output_tok_per_s"].tolist() == [2.0, 3.0, 0.0, 2.0]


def test_latencies_are_placed_where_they_end() -> None:
    table = timeslices(*run(), slice_s=1.0)
    # first tokens: a 0.5 (TTFT 0.5) in [0, 1); b 1.5 (1.3) in [1, 2); e 4.0 (0.9) in the last
    assert table["ttft_p50_s"].tolist()[:2] == pytest.approx([0.5, 1.3])
    assert np.isnan(table["ttft_p50_s"][2]) and table["ttft_p99_s"][3] == pytest.approx(0.9)
    # gaps by their later token: a 0.2 in [0, 1); a 0.4, b 0.1 in [1, 2); b 2.3 in [3, 4]
    assert table["itl_p50_s"][0] == pytest.approx(0.2)
    assert table["itl_p50_s"][1] == pytest.approx(0.25)
    assert table["itl_p99_s"][1] == pytest.approx(np.percentile([0.4, 0.1], 99))
    assert np.isnan(table["itl_p50_s"][2]) and table["itl_p50_s"][3] == pytest.approx(2.3)
    # TPOT of requests completed in the slice: a (1.1 - 0.5) / 2; b 1.2; e has one token
    assert table["tpot_p50_s"][1] == pytest.approx(0.3)
    assert table["tpot_p50_s"][3] == pytest.approx(1.2)


def test_tokens_over_the_slices_add_up_to_the_summarys() -> None:
    requests, tokens = run()
    table = timeslices(requests, tokens, slice_s=0.3)
    summary = compute_summary(requests, tokens, pd.DataFrame(columns=["step"]))
    assert table["output_tokens"].sum() == summary["output_tok_per_s"] * summary["duration_s"]
    assert table["requests_completed"].sum() == summary["num_completed"]
    assert table["requests_sent"].sum() == summary["num_requests"]
    # the last slice is cut at the run's end (4.0), not at 4.2
    assert table["slice_end_s"].iloc[-1] == 4.0 and len(table) == 14


def test_a_run_of_one_instant_is_one_slice_of_no_length() -> None:
    requests, tokens = frames([(request("a", "ok", 0.0, [0.0]), [0.0])])
    table = timeslices(requests, tokens)
    assert len(table) == 1
    assert (table["slice_start_s"][0], table["slice_end_s"][0]) == (0.0, 0.0)
    assert table["requests_completed"][0] == 1 and table["output_tokens"][0] == 1
    assert np.isnan(table["output_tok_per_s"][0])  # no rate over no time


def test_no_requests_give_an_empty_table() -> None:
    requests, tokens = frames([])
    assert list(timeslices(requests, tokens).columns) == list(COLUMNS)


@pytest.mark.parametrize(
    ("duration", "length"), [(4.0, 0.2), (13.0, 0.5), (45.0, 2.0), (60.0, 2.0), (1000.0, 50.0)]
)
def test_an_automatic_slice_gives_about_20_of_a_readable_length(
    duration: float, length: float
) -> None:
    assert automatic_slice_s(duration) == length
    assert 10 <= duration / length <= 40


def test_too_many_slices_are_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match=r"run\.timeslice_s: 0\.0001 gives 40000 slices"):
        timeslices(*run(), slice_s=1e-4)


def test_the_table_round_trips_through_the_run_folder(tmp_path: Any) -> None:
    table = timeslices(*run(), slice_s=1.0)
    write_timeslices(tmp_path, table)
    read = read_timeslices(tmp_path)
    assert read is not None
    pd.testing.assert_frame_equal(read, table, check_dtype=False)
    assert read_timeslices(tmp_path / "nothing") is None


@pytest.mark.parametrize("value", [0, -1, "x", float("inf")])
def test_a_bad_slice_length_is_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ValueError, match=r"run\.timeslice_s: .* allowed: null or a number"):
        RunConfig.from_dict({"timeslice_s": value})
