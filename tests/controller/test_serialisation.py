"""The serialisation detector on known answers (overtake.controller.online.serialisation).

Records come from an exact event simulation of one core shared by processor sharing between two
stages: stage A's requests hold a lock of ``m`` holders for their whole stay (FCFS for the lock; a
waiter is blocked, off the CPU), stage B's take no lock. Every request also gets a little blocked
time independent of the others (a disk read), so alone requests are not exactly 0. Known answers:
m = 1 and m = 2 are detected with their capacities, no lock (PS) is not, and stage B never is.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from overtake.controller.online.serialisation import TimedRequest, detect, lock_capacity, overlapped

N = 400  # requests per stage at the stated sample size
LOAD = 0.6
SEEDS = range(10)


def simulate(n: int, lock: int | None, seed: int, load: float = LOAD) -> dict[str, list[TimedRequest]]:
    """One core, PS among the requests on it; stage A holds a lock of ``lock`` holders (None: none).

    Both stages: Poisson arrivals, hyperexponential CPU demands (mean 10 ms, scv 3); each request's
    own blocked time (mean 0.2 ms, exponential) is served before it joins: independent noise."""
    rng = np.random.default_rng(seed)
    mean = 0.010
    rate = load / (2 * mean)  # per stage
    jobs = []  # (arrival, stage, demand, noise)
    for stage in ("A", "B"):
        t = np.cumsum(rng.exponential(1 / rate, n))
        p = 0.5 * (1 + math.sqrt((3 - 1) / (3 + 1)))  # balanced-means H2, scv 3
        rates = (2 * p / mean, 2 * (1 - p) / mean)
        pick = rng.random(n) < p
        d = np.where(pick, rng.exponential(1 / rates[0], n), rng.exponential(1 / rates[1], n))
        noise = rng.exponential(0.0002, n)
        jobs += [(float(t[i]), stage, float(d[i]), float(noise[i])) for i in range(n)]
    jobs.sort()
    # each job: [arrival, stage, remaining, cpu, wait, blocked, ready_time (after its noise)]
    pending = [[a + z, s, d, d, 0.0, z, a] for a, s, d, z in jobs]  # enters at a + noise, blocked noise
    pending.sort(key=lambda j: j[0])
    active: list[list] = []
    lockq: list[list] = []
    holders = 0
    out: dict[str, list[TimedRequest]] = {"A": [], "B": []}
    now, i = 0.0, 0
    while i < len(pending) or active or lockq:
        k = len(active)
        t_done = now + min(j[2] for j in active) * k if k else math.inf
        t_arr = pending[i][0] if i < len(pending) else math.inf
        t = min(t_done, t_arr)
        dt = t - now
        for j in active:
            j[2] -= dt / k
            j[4] += dt * (k - 1) / k
        for j in lockq:
            j[5] += dt
        now = t
        if t_arr <= t_done:
            j = pending[i]
            i += 1
            if j[1] == "A" and lock is not None and holders >= lock:
                lockq.append(j)
            else:
                holders += j[1] == "A"
                active.append(j)
            continue
        done = min(active, key=lambda x: x[2])
        active.remove(done)
        a0 = done[6]
        out[done[1]].append(TimedRequest(start=a0, wall=now - a0, cpu=done[3], wait=done[4], blocked=done[5]))
        if done[1] == "A":
            holders -= 1
            if lockq and lock is not None:
                holders += 1
                active.append(lockq.pop(0))
    return out


def test_the_simulation_conserves_time():
    """wall = cpu + wait + blocked for every request, and the core does at most one second per second."""
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
