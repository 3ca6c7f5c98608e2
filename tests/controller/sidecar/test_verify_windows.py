"""The live verification's accounting alone: which requests a window counts and the pair's number.

Known answers by hand: a window opened at t = 100 with settle 2 counts arrivals from t = 102 on;
requests of 1 s and 3 s give a mean of 2 s; a request still running one window (grace 10 s) after
its window ended is counted with its age at that moment; a pair whose policy window averages 2 s
and default window 3 s gives ln(3 / 2); a window with fewer counted requests than the minimum, or
with no time at all, voids its pair.
"""

from __future__ import annotations

import math

import pytest

from overtake.controller.sidecar.verify_windows import Window, WindowLedger, pair_log_ratio


def window(arm: str, times: list[float]) -> Window:
    w = Window(arm, 0.0, 0.0)
    w.n, w.total = len(times), sum(times)
    return w


def test_pair_log_ratio_by_hand() -> None:
    pol, dft = window("policy", [1.0, 3.0]), window("default", [2.0, 4.0, 3.0])
    assert pol.mean == 2.0 and dft.mean == 3.0
    assert pair_log_ratio(pol, dft, min_requests=2) == pytest.approx(math.log(3 / 2))
    assert pair_log_ratio(dft, pol, min_requests=2) == pytest.approx(-math.log(3 / 2))  # antisymmetric
    assert pair_log_ratio(pol, dft, min_requests=3) is None  # the policy window has 2 < 3
    assert pair_log_ratio(window("policy", [0.0, 0.0]), dft, min_requests=1) is None  # no time: no ratio
    assert Window("policy", 0.0, 0.0).mean is None


def test_the_ledger_counts_after_the_settle_time_and_censors_at_the_grace() -> None:
    led = WindowLedger(settle=2.0, grace=10.0)
    led.count(1, 100.0)  # no window yet: ignored
    assert not led.tickets
    led.open("policy", 100.0)
    led.count(2, 101.0)  # settle time: not counted
    led.count(3, 102.0)
    led.count(4, 103.0)
    led.count(5, 104.0)
    assert sorted(led.tickets) == [3, 4, 5] and led.windows[0].outstanding == 3
    led.end(2, 105.0, rejected=False)  # not counted: nothing changes
    led.end(3, 103.0, rejected=False)  # 1 s
    led.end(4, 106.0, rejected=True)  # 3 s, rejected
    w = led.windows[0]
    assert (w.n, w.total, w.rejected, w.outstanding) == (2, pytest.approx(4.0), 1, 1)
    assert w.mean == pytest.approx(2.0)
    assert not led.final(0, 106.0)  # still open
    led.close(110.0)
    led.open("default", 110.0)
    assert led.pair(0, 111.0) is None  # the second window is not over
    assert not led.final(0, 119.0)  # request 5 still running, before the grace
    assert led.final(0, 120.0)  # censored with its age: 120 - 104 = 16 s
    assert (w.n, w.total, w.censored, w.outstanding) == (3, pytest.approx(20.0), 1, 0)
    assert not led.tickets
    led.count(6, 115.0)
    led.end(6, 117.0, rejected=False)
    led.close(120.0)
    pol, dft = led.pair(0, 120.0) or (None, None)
    assert pol is led.windows[0] and dft is led.windows[1]
    assert (dft.n, dft.total) == (1, pytest.approx(2.0))
    assert pair_log_ratio(pol, dft, 1) == pytest.approx(math.log(2.0 / (20.0 / 3)))
    led.reset()
    assert led.windows == [] and led.tickets == {}


def test_a_pair_is_returned_policy_first_whatever_the_order() -> None:
    led = WindowLedger(settle=0.0, grace=1.0)
    led.open("default", 0.0)
    led.close(1.0)
    led.open("policy", 1.0)
    led.close(2.0)
    pair = led.pair(0, 2.0)
    assert pair is not None and [w.arm for w in pair] == ["policy", "default"]
    assert led.pair(1, 2.0) is None  # no second pair
