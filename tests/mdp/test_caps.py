"""mdp.caps: the growing caps every solver and evaluation settles E[W] on."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from overtake.mdp.caps import ladder_cap, next_cap, next_evaluation_cap, next_solve_cap, relative_change, settle
from overtake.mdp.errors import TruncationError


@dataclass(frozen=True)
class M:
    mean_response_time: float


def test_caps_grow_by_their_factor_and_at_least_two() -> None:
    assert [next_evaluation_cap(c) for c in (1, 2, 4, 10, 15)] == [3, 4, 6, 15, 23]
    assert [next_solve_cap(c) for c in (1, 10, 13, 17)] == [3, 13, 17, 22]
    assert next_cap(10, 1.25) == next_solve_cap(10)
    # the ladder 10, 15, 23, 35: the last cap whose successor is below 35 and at most 13 is 10,
    # at most 16 is 15
    assert ladder_cap(10, 35, 13) == 10
    assert ladder_cap(10, 35, 16) == 15
    assert ladder_cap(10, 23, 100) == 15
    assert relative_change(1.1, 1.0) == pytest.approx(0.1)


def test_settle_stops_at_the_first_small_step() -> None:
    # E[W](C) = 2 − 1/C: the steps shrink as the cap grows
    seen: list[tuple[int, float]] = []
    out = settle(lambda C: M(2.0 - 1.0 / C), 10, tol=0.015, step=lambda c, m, ch: seen.append((c, ch)))
    assert [c for c, _ in seen] == [15, 23]
    assert out.settled and out.cap == 23 and out.metrics == M(2.0 - 1.0 / 23)
    assert seen[0][1] == pytest.approx((1 / 10 - 1 / 15) / (2 - 1 / 10))


def test_settle_never_evaluates_beyond_max_cap_and_says_so() -> None:
    calls: list[int] = []

    def ev(C: int) -> M:
        calls.append(C)
        return M(float(C))  # never settles

    out = settle(ev, 10, tol=1e-3, max_cap=30)
    assert calls == [10, 15, 23] and out.stop == "max_cap" and out.cap == 23 and out.refused == 35
    assert not out.settled


def test_settle_reports_the_last_evaluation_where_the_next_is_beyond_the_budget() -> None:
    out = settle(lambda C: None if C > 20 else M(float(C)), 10, tol=1e-3, first=M(10.0))
    assert out.stop == "budget" and out.cap == 15 and out.refused == 23 and out.metrics == M(15.0)
    with pytest.raises(TruncationError, match="first evaluation cap, 10 requests"):
        settle(lambda C: None, 10, tol=1e-3)
