"""Known-answer records for the serialisation detector: an exact simulation of a lock on one core.

One core shared by processor sharing between two stages: stage A's requests hold a lock of ``m``
holders for their whole stay (FCFS for the lock; a waiter is blocked, off the CPU), stage B's take
no lock. Every request also gets a little blocked time independent of the others (a disk read)
before it starts, so requests alone are not exactly 0.
"""

from __future__ import annotations

import math

import numpy as np

from overtake.controller.online.serialisation import TimedRequest

__all__ = ["LOAD", "simulate"]

LOAD = 0.6


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
