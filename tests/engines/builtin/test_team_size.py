"""The decode program's team size (engines/builtin/team_size.py): measured as the steps run,
probing a neighbouring size now and then, moving where it is faster by the margin."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engines.builtin.team_size import TeamSizer


def run(sizer: TeamSizer, steps: int, ns_per_row: Callable[[int], float]) -> list[int]:
    """`steps` steps whose time per row is ns_per_row(size); the sizes taken."""
    taken = []
    for _ in range(steps):
        size = sizer.next_size()
        assert 1 <= size <= sizer.most
        sizer.record(size, ns_per_row(size))
        taken.append(size)
    return taken


def test_a_quiet_machine_keeps_every_thread_and_probes_ever_more_rarely() -> None:
    sizer = TeamSizer(2)
    taken = run(sizer, 20_000, lambda size: 4.0 if size == 2 else 6.5)
    assert sizer.size == 2 and sizer.probes >= 5
    assert sizer.interval == sizer.longest_interval
    slower = taken.count(1)
    assert slower == sizer.probes * sizer.probe_steps
    assert slower / len(taken) < 0.01  # the probes' price


def test_a_busy_machine_moves_to_the_faster_smaller_team_and_back_when_it_is_quiet() -> None:
    sizer = TeamSizer(2)
    run(sizer, 200, lambda size: 12.0 if size == 2 else 6.5)  # one core shared
    assert sizer.size == 1
    taken = run(sizer, 2_000, lambda size: 12.0 if size == 2 else 6.5)
    assert taken.count(2) / len(taken) < 0.05  # probes only
    run(sizer, 3_000, lambda size: 4.0 if size == 2 else 6.5)  # the other process ended
    assert sizer.size == 2


def test_within_the_margin_the_size_stays() -> None:
    sizer = TeamSizer(4)
    run(sizer, 5_000, lambda size: 10.0 - 0.2 * size)  # 3 threads only 2% slower than 4
    assert sizer.size == 4


def test_many_threads_walk_to_the_best_size_one_step_at_a_time() -> None:
    sizer = TeamSizer(8)
    best = 5
    run(sizer, 20_000, lambda size: 10.0 + 3.0 * abs(size - best))
    assert sizer.size == best


def test_one_thread_never_probes() -> None:
    sizer = TeamSizer(1)
    assert run(sizer, 500, lambda size: 1.0) == [1] * 500 and sizer.probes == 0


def test_a_team_of_none_is_refused() -> None:
    with pytest.raises(ValueError, match=r"TeamSizer\.most: 0; allowed: at least 1"):
        TeamSizer(0)


def test_the_documented_spin_budget_is_the_librarys() -> None:
    """docs/engine_options.md's cpu_wait_policy row said `auto` spins up to 100 us while the
    library spins 2 us (hostile pass, issue 36): the row now states the library's budget."""
    from pathlib import Path

    from engines.builtin import native

    lib = native.load()
    assert lib is not None, native.reason()  # CI machines have a C compiler
    budget_us = lib.team_default_spin_ns() / 1000
    docs = Path(__file__).resolve().parents[3] / "docs" / "engine_options.md"
    (row,) = [line for line in docs.read_text().splitlines() if line.startswith("| `cpu_wait_")]
    assert f"`auto` (spin up to {budget_us:g} us, then sleep" in row, row
