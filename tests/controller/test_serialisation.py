"""The serialisation detector on known answers (overtake.controller.online.serialisation).

Records come from an exact event simulation (tests/support/lock_sim.py) of one core shared by processor sharing between two
stages: stage A's requests hold a lock of ``m`` holders for their whole stay (FCFS for the lock; a
waiter is blocked, off the CPU), stage B's take no lock. Every request also gets a little blocked
time independent of the others (a disk read), so alone requests are not exactly 0. Known answers:
m = 1 and m = 2 are detected with their capacities, no lock (PS) is not, and stage B never is.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.lock_sim import simulate

from overtake.controller.online.serialisation import TimedRequest, detect, lock_capacity, overlapped

N = 400  # requests per stage at the stated sample size
SEEDS = range(10)


def test_the_simulation_conserves_time():
    """wall = cpu + wait + blocked for every request, and the lock shows in stage A's blocked time."""
    recs = simulate(200, 1, seed=0)
    for r in recs["A"] + recs["B"]:
        assert r.wall == pytest.approx(r.cpu + r.wait + r.blocked, abs=1e-9)
    a = recs["A"]
    assert sum(r.blocked for r in a) > 10 * sum(r.blocked for r in recs["B"])  # the lock shows


@pytest.mark.parametrize("seed", SEEDS)
def test_an_exclusive_lock_is_detected_with_capacity_one(seed):
    recs = simulate(N, 1, seed)
    v = detect(recs["A"])
    assert v.serialising is True, v
    assert v.lock_capacity == 1 and v.capacity is not None and 0.9 <= v.capacity <= 1.2, v
    assert v.concurrency is not None and v.concurrency > 1.1  # they did overlap: the capacity is evidence
    assert detect(recs["B"]).serialising is False  # the lock-free stage beside it


@pytest.mark.parametrize("seed", SEEDS)
def test_processor_sharing_is_not_detected(seed):
    recs = simulate(N, None, seed)
    for stage in ("A", "B"):
        v = detect(recs[stage])
        assert v.serialising is False, v
        assert v.overlapped >= 30 and v.alone >= 30  # a verdict, not a lack of samples
        assert v.capacity is not None and v.capacity > 1.5, v  # overlapping requests progressed together


def test_a_lock_of_two_holders_has_capacity_two():
    for seed in range(5):  # a lock of two is held alone more often: more requests, a higher load
        v = detect(simulate(2 * N, 2, seed, load=0.8)["A"])
        assert v.serialising is True and v.lock_capacity == 2, v
        assert v.capacity is not None and 1.8 <= v.capacity <= 2.2, v


def test_too_few_requests_give_no_verdict():
    recs = simulate(40, 1, seed=3)
    v = detect(recs["A"])
    assert v.serialising is None and "needs 30 requests alone" in v.reason


def test_blocked_even_alone_is_not_serialisation():
    """An Apache thread waiting for PHP-FPM: blocked for most of its stay whether alone or not."""
    recs = []
    for i in range(100):  # one alone, then two that overlap, every second
        recs += [TimedRequest(start=t, wall=0.06, cpu=0.001, wait=0.0, blocked=0.059) for t in (i, i + 0.5, i + 0.52)]
    v = detect(recs)
    assert v.serialising is False and "even alone" in v.reason, v


def test_overlap_and_capacity_known_answers():
    s = np.array([0.0, 1.0, 1.5, 5.0, 6.0])
    e = np.array([1.0, 2.0, 3.0, 5.5, 7.0])
    assert overlapped(s, e).tolist() == [False, True, True, False, False]  # touching is not overlapping
    # busy time 1 + 2 + 0.5 + 1 = 4.5; N = 2 for 0.5 s ([1.5, 2)): ∫N = 5.0
    assert lock_capacity(s, e, 4.5) == pytest.approx((1.0, 5.0 / 4.5))
    assert lock_capacity(s, e, 5.0)[0] == pytest.approx(2.0)  # everyone progressed: the largest N
    assert lock_capacity(s, e, 4.75)[0] == pytest.approx(1.5)
    assert lock_capacity(s, e, 2.25)[0] == pytest.approx(0.5)
