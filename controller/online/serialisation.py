"""Is a stage serialised? Evidence from where its requests' time went.

Under processor sharing a request's wall time is its CPU time plus the time it waited, runnable,
for a core. A request waiting for a lock (a database write lock, a session file) is off the CPU and
not runnable: *blocked*. When the lock is held by another request of the same stage, a request is
blocked only while such a request runs beside it, and not when it runs alone. mod_overtake_prio
notes each request's split (``OvertakeRequestTimes``, :data:`overtake.controller.log_format.TIMES_FORMAT`);
:func:`detect` decides from a stage's recent requests:

* **overlap**: a request *overlapped* when another request of its stage was in its handler at some
  moment of its own stay, else it ran *alone*;
* **test**: a request's blocked share of its wall time is larger when overlapped than alone
  (one-sided Mann-Whitney U test at level ``alpha``), the overlapped requests' blocked share of
  their time exceeds the alone ones' by at least ``min_gap``, and the alone ones' stays below
  ``alone_max``; with fewer than ``min_samples`` requests in either group there is no verdict;
* **capacity**: with N(t) the stage's requests in their handlers and P the stage's total
  unblocked time Σ(wall − blocked), the lock capacity m is the solution of
  ∫ min(N(t), m) dt = P: with a lock of m holders at most m requests progress at once (and one
  always does while any is present), so m = 1 for a lock no two requests hold together; without a
  lock every present request progresses and m reaches the largest N seen.

A stage blocked for most of its time even alone waits for something other than its own kind (disk
or network I/O, an application server such as PHP-FPM behind Apache, whose CPU the Apache thread
does not see): it is reported, not called serialised. A lock whose waiters sleep between tries
(SQLite's busy handler) leaves it free meanwhile: m then comes out below 1, and the lock's
capacity is reported as 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["ALONE_MAX", "ALPHA", "MIN_GAP", "MIN_SAMPLES", "TimedRequest", "Verdict", "detect", "lock_capacity",
           "overlapped"]

FloatArray = npt.NDArray[np.float64]

#: requests needed alone and overlapped (each) before a verdict
MIN_SAMPLES = 30
#: level of the one-sided test
ALPHA = 0.01
#: smallest rise of the mean blocked share (overlapped − alone) that counts as serialisation
MIN_GAP = 0.1
#: largest blocked share alone of a stage that waits mainly for its own kind: requests alone may
#: still write a journal or read a file (SQLite's commit alone blocks about a tenth of a short
#: transaction); beyond half their time, they wait mainly for something else
ALONE_MAX = 0.5


@dataclass(frozen=True)
class TimedRequest:
    """One request's stay in its handler and its split, in seconds (any origin for ``start``
    shared by the records compared)."""

    start: float
    wall: float
    cpu: float
    wait: float  #: runnable, waiting for a CPU
    blocked: float  #: off the CPU and not runnable


@dataclass(frozen=True)
class Verdict:
    """A stage's verdict and its evidence."""

    serialising: bool | None  #: None: too few requests to decide
    lock_capacity: int | None  #: the lock's holders (round(capacity), at least 1) when serialising
    capacity: float | None  #: m solving ∫ min(N, m) dt = Σ(wall − blocked); None without overlaps
    requests: int
    alone: int
    overlapped: int
    blocked_alone: float | None  #: blocked share of the wall time of the requests alone
    blocked_overlapped: float | None  #: ... and of those overlapped
    p_value: float | None  #: one-sided Mann-Whitney U, overlapped > alone
    concurrency: float | None  #: mean requests of the stage in their handlers while any is
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def overlapped(start: FloatArray, end: FloatArray) -> npt.NDArray[np.bool_]:
    """For each interval [start, end), does another one intersect it?"""
    n = start.size
    out = np.zeros(n, dtype=bool)
    if n < 2:
        return out
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    # an earlier-starting interval still open at this start ...
    prev_end = np.maximum.accumulate(e)
    hit = np.zeros(n, dtype=bool)
    hit[1:] = prev_end[:-1] > s[1:]
    # ... or the next-starting one begins before this end (any later overlap implies it)
    hit[:-1] |= s[1:] < e[:-1]
    out[order] = hit
    return out


def _occupancy(start: FloatArray, end: FloatArray) -> FloatArray:
    """T[k] = time with exactly k intervals open (k = 0 .. max), over [min start, max end]."""
    times = np.concatenate([start, end])
    steps = np.concatenate([np.ones(start.size), -np.ones(end.size)])
    order = np.lexsort((steps, times))  # at a tie, ends (-1) before starts: touching is not overlap
    t, d = times[order], steps[order]
    level = np.cumsum(d)[:-1].astype(int)
    dt = np.diff(t)
    occ = np.zeros(int(level.max(initial=0)) + 1)
    np.add.at(occ, level, dt)
    return occ


def lock_capacity(start: FloatArray, end: FloatArray, progress: float) -> tuple[float, float] | None:
    """(m, mean concurrency while busy): m solves ∫ min(N(t), m) dt = ``progress`` (m ≤ 1 when the
    progress does not fill the busy time, m = the largest N when it reaches ∫ N dt). None without
    busy time."""
    occ = _occupancy(start, end)
    k = np.arange(occ.size)
    busy = float(occ[1:].sum())
    if busy <= 0:
        return None
    concurrency = float((k * occ).sum()) / busy
    if progress <= busy:
        return progress / busy, concurrency
    f = busy  # ∫ min(N, j) dt at j = 1
    for j in range(1, occ.size - 1):
        above = float(occ[j + 1:].sum())  # time with N > j: where raising m by one adds progress
        if f + above >= progress:
            return j + (progress - f) / above, concurrency
        f += above
    return float(occ.size - 1), concurrency


def _mann_whitney_greater(x: FloatArray, y: FloatArray) -> float:
    """p-value of the one-sided test that x tends to exceed y."""
    if np.ptp(np.concatenate([x, y])) == 0:
        return 1.0  # all equal: no evidence either way (the normal approximation is undefined)
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(x, y, alternative="greater").pvalue)


def detect(records: Sequence[TimedRequest], *, min_samples: int = MIN_SAMPLES, alpha: float = ALPHA,
           min_gap: float = MIN_GAP, alone_max: float = ALONE_MAX) -> Verdict:
    """The verdict on one stage from its requests (see the module docstring)."""
    recs = [r for r in records if r.wall > 0]
    n = len(recs)
    start = np.fromiter((r.start for r in recs), float, n)
    wall = np.fromiter((r.wall for r in recs), float, n)
    blocked = np.fromiter((r.blocked for r in recs), float, n)
    share = np.clip(blocked / wall, 0.0, 1.0) if n else wall
    over = overlapped(start, start + wall)
    a, o = share[~over], share[over]
    # the shares of the groups' time (not means of per-request shares, which a few tiny requests
    # with a little I/O would dominate); the test ranks the per-request shares
    ba = float(blocked[~over].sum() / wall[~over].sum()) if a.size else None
    bo = float(blocked[over].sum() / wall[over].sum()) if o.size else None
    cap = lock_capacity(start, start + wall, float((wall - np.minimum(blocked, wall)).sum())) if n else None
    capacity, concurrency = cap if cap is not None else (None, None)
    if capacity is not None and concurrency is not None and concurrency <= 1.0:
        capacity = None  # no two requests ever overlapped: nothing to estimate

    def verdict(serialising: bool | None, m: int | None, p: float | None, reason: str) -> Verdict:
        return Verdict(serialising, m, capacity, n, int(a.size), int(o.size), ba, bo, p, concurrency, reason)

    if ba is None or bo is None or a.size < min_samples or o.size < min_samples:
        return verdict(None, None, None, f"needs {min_samples} requests alone and {min_samples} overlapping "
                                         f"another of the stage; has {a.size} and {o.size}")
    p = _mann_whitney_greater(o, a)
    if ba > alone_max:
        return verdict(False, None, p, f"blocked {ba:.0%} of the time even alone: the requests wait for "
                                       "something other than each other (I/O, an application server outside Apache)")
    if p < alpha and bo - ba >= min_gap:
        m = max(1, round(capacity)) if capacity is not None else 1
        return verdict(True, m, p, f"blocked {bo:.0%} of the time when another request of the stage ran beside "
                                   f"it, {ba:.0%} alone (p = {p:.2g}); at most {capacity or 1:.2f} progress together")
    return verdict(False, None, p, f"blocked {bo:.0%} overlapped vs {ba:.0%} alone (p = {p:.2g}): not "
                                   f"{min_gap:.0%} higher at level {alpha:g}")
