"""The wiki on one core with SQLite's own locking: a trace-driven model of what the bench measures.

:mod:`class_model` and :mod:`lock_model` treat a preview as holding a write lock of capacity 1 for
its whole run, handed over at once. On the bench's wiki (strace of Apache's children) SQLite does
more: the main database is in rollback-journal mode, where

* a request first runs PHP's and MediaWiki's start-up, touching no lock (the calibration's
  intercept: the idle time of the smallest request);
* a preview then takes the RESERVED lock (``BEGIN IMMEDIATE``; one writer at a time) and, at its
  commit, the EXCLUSIVE lock, which it gets only when no reader holds a SHARED lock; while it
  waits it holds PENDING, which keeps new readers out;
* a view holds a SHARED lock for the rest of its run (its read transaction);
* a request that finds a lock taken sleeps in SQLite's busy handler and tries again after 1, 2,
  5, 10, 15, 20, 25, 25, 25, 50, 50 ms, then every 100 ms (``sqliteDefaultBusyCallback``), so a
  freed lock idles until some waiter's next try.

:func:`simulate` replays a trace under that locking on one processor shared by weight among the
requests that run (blocked ones use no CPU), each request's CPU demand its article's idle time
times ``demand`` (the CPU per transaction measured under load over the idle one), with the arms'
admission: every request at once (prefork), at most ``workers`` in PHP (php-fpm's children, a
FIFO queue), and the sidecar's ``lock: 1`` on previews (one in Apache at a time, the next by
response ratio). ``simple=True`` drops the start-up phase, the readers and the polling: the
capacity-1 lock handed over first come first served of :mod:`class_model`, which the tests
check it against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .class_model import NICE0, NICE19

__all__ = ["BUSY_DELAYS", "simulate"]

#: SQLite's busy-handler sleeps (s) between tries, the last repeated (sqlite3.c, sqliteDefaultBusyCallback)
BUSY_DELAYS = (0.001, 0.002, 0.005, 0.010, 0.015, 0.020, 0.025, 0.025, 0.025, 0.050, 0.050, 0.100)

_START, _WANT_RESERVED, _LOCKED, _COMMIT, _WANT_SHARED, _SHARED = range(6)
_BLOCKED = (_WANT_RESERVED, _COMMIT, _WANT_SHARED)


@dataclass(eq=False)
class _Req:
    tx: int
    preview: bool
    rem: float  #: CPU seconds left in the current phase
    after: float  #: CPU seconds of the locked phase that follows the start-up
    weight: float
    phase: int = _START
    tries: int = 0
    retry: float = np.inf  #: next busy-handler try while blocked


@dataclass
class _State:
    t: float = 0.0
    writer: _Req | None = None  #: holds RESERVED (and PENDING while it waits to commit)
    pending: bool = False
    readers: int = 0
    running: list[_Req] = field(default_factory=list)  #: in PHP, on the CPU or blocked in SQLite
    fpm_queue: list[tuple[int, bool]] = field(default_factory=list)
    gate_queue: list[int] = field(default_factory=list)  #: previews the sidecar holds
    in_gate: int = 0


def simulate(arrival: np.ndarray, article: np.ndarray, preview_s: np.ndarray, view_s: np.ndarray, *,
             startup: tuple[float, float] = (0.0, 0.0), demand: float = 1.0, workers: int | None = None,
             gate: bool = False, low: np.ndarray | None = None, simple: bool = False, wal: bool = False) -> np.ndarray:
    """Response time of every transaction (arrival to its view's end), seconds, from an idle server.

    ``startup``: CPU seconds of a preview's and a view's start-up (no lock), capped at 90 % of the
    request; ``workers``: PHP workers (None: as many as requests); ``gate``: the sidecar's lock on
    previews; ``low``: per article, whether its views start at nice 19 once one has completed;
    ``wal``: the database in write-ahead-log mode, where readers read a snapshot: a commit waits
    for no reader and no reader waits for a committing writer (writers still take turns, with the
    busy handler's polling).
    """
    if not demand > 0:
        raise ValueError(f"demand: CPU per transaction under load over the idle one, > 0, got {demand!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers: PHP workers, >= 1 or None, got {workers!r}")
    n = len(arrival)
    rt = np.full(n, np.nan)
    seen = np.zeros(len(view_s), bool)
    s = _State()
    cost = (np.asarray(preview_s, float) * demand, np.asarray(view_s, float) * demand)

    def enter(tx: int, preview: bool) -> None:
        if workers is not None and len(s.running) >= workers:
            s.fpm_queue.append((tx, preview))
            return
        a = int(article[tx])
        total = float(cost[0][a] if preview else cost[1][a])
        first = 0.0 if simple else min(startup[0] if preview else startup[1], 0.9 * total)
        demoted = not preview and low is not None and bool(low[a]) and bool(seen[a])
        r = _Req(tx, preview, first, total - first, NICE19 if demoted else NICE0)
        s.running.append(r)
        if first <= 0:
            locks(r)

    def leave(r: _Req) -> None:
        s.running.remove(r)
        if s.fpm_queue:
            enter(*s.fpm_queue.pop(0))

    def admit() -> None:
        if s.in_gate or not s.gate_queue:
            return
        ratio = [(s.t - arrival[i] + cost[0][article[i]]) / cost[0][article[i]] for i in s.gate_queue]
        s.in_gate = 1
        enter(s.gate_queue.pop(int(np.argmax(ratio))), True)

    def locks(r: _Req) -> None:
        """``r`` ended a CPU phase: its next lock step (taken now, or blocked until a try succeeds)."""
        r.phase = {_START: _WANT_RESERVED if r.preview else _WANT_SHARED, _LOCKED: _COMMIT}[r.phase]
        r.tries = 0
        attempt(r)

    def attempt(r: _Req) -> None:
        if granted(r):
            r.retry = np.inf
        elif simple:
            r.retry = np.inf  # woken first come first served when the holder ends (handover)
        else:
            r.retry = s.t + BUSY_DELAYS[min(r.tries, len(BUSY_DELAYS) - 1)]
            r.tries += 1

    def granted(r: _Req) -> bool:
        if r.phase == _WANT_RESERVED:
            if s.writer is not None:
                return False
            s.writer, r.phase, r.rem = r, _LOCKED, r.after
            return True
        if r.phase == _WANT_SHARED:
            if s.pending and not (simple or wal):
                return False
            s.readers += 1
            r.phase, r.rem = _SHARED, r.after
            return True
        assert r.phase == _COMMIT
        if s.readers and not (simple or wal):
            s.pending = True
            return False
        s.writer, s.pending = None, False
        leave(r)
        enter(r.tx, False)
        if gate:
            s.in_gate = 0
            admit()
        if simple:
            handover()
        return True

    def handover() -> None:
        waiting = [q for q in s.running if q.phase == _WANT_RESERVED]
        if waiting:
            attempt(min(waiting, key=lambda q: q.tx))

    nxt = 0
    while nxt < n or s.running or s.gate_queue or s.fpm_queue:
        ta = float(arrival[nxt]) if nxt < n else np.inf
        cpu = [r for r in s.running if r.phase not in _BLOCKED]
        total = sum(r.weight for r in cpu)
        tc = s.t + min(r.rem * total / r.weight for r in cpu) if cpu else np.inf
        tr = min((r.retry for r in s.running), default=np.inf)
        tn = min(ta, tc, tr)
        if tn == np.inf:
            raise RuntimeError("sqlite_model: nothing can move (a bug: every request blocked)")
        for r in cpu:
            r.rem -= (tn - s.t) * r.weight / total
        s.t = tn
        if tn == ta:
            if gate:
                s.gate_queue.append(nxt)
                admit()
            else:
                enter(nxt, True)
            nxt += 1
        elif tn == tr:
            attempt(next(r for r in s.running if r.retry == tr))
        else:
            r = min(cpu, key=lambda q: q.rem * total / q.weight)
            if r.phase == _SHARED:
                s.readers -= 1
                leave(r)
                rt[r.tx] = s.t - arrival[r.tx]
                seen[article[r.tx]] = True
            else:
                locks(r)
    return rt
