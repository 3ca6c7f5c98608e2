"""Estimators of the online loop: service demand per stage request, and the arrival rate.

:class:`DemandRecorder` is the :class:`overtake.controller.sidecar.limiter.LimiterListener` the sidecar
subscribes to its limiter with ``--online``: it turns ticket events into arrival counts and
attained-service samples, and holds the latest samples per (stage, source) for the refit
(package docstring: :mod:`overtake.controller.online`).
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from overtake.controller.online.serialisation import TimedRequest
from overtake.controller.online.settings import SOURCES, OnlineSettings
from overtake.controller.sidecar.limiter import ADMITTED, PASSTHROUGH, LimiterListener, Ticket
from overtake.controller.sidecar.stages import StageTable
from overtake.mdp.model import capacity

__all__ = ["AccessLogTail", "ArrivalRate", "AttainedService", "DemandRecorder", "LogEntry"]

FloatArray = npt.NDArray[np.float64]

_READ_MAX = 4 << 20  # bytes of access log parsed per poll (the rest at the next poll)


class AttainedService:
    """Attained service under processor sharing: S = ∫ c(K(t))/K(t) dt over the request's stay.

    One virtual clock V(t) = ∫ c(K)/K dt advanced at every change of K; a request's attained
    service is V(done) − V(admit) (K constant between events, so this is exact)."""

    def __init__(self, cores: int = 1, overhead: float = 0.0) -> None:
        self.cores = cores
        self.overhead = overhead
        self.k = 0
        self.v = 0.0
        self._t: float | None = None
        self._start: dict[int, float] = {}
        self._c: dict[int, float] = {}  # c(K) by K: a dict look-up on the request path, not numpy

    def _advance(self, now: float) -> None:
        if self._t is not None and self.k:
            c = self._c.get(self.k)
            if c is None:
                c = self._c[self.k] = float(capacity(self.k, self.cores, self.overhead))
            self.v += (now - self._t) * c / self.k
        self._t = now

    def admit(self, key: int, now: float) -> None:
        self._advance(now)
        self._start[key] = self.v
        self.k += 1

    def release(self, key: int, now: float) -> float | None:
        """End ``key``'s stay; its attained service (None if it was never admitted here)."""
        start = self._start.pop(key, None)
        if start is None:
            return None
        self._advance(now)
        self.k -= 1
        return self.v - start


class ArrivalRate:
    """Arrivals per second over a sliding window, from counts in ``buckets`` equal buckets."""

    def __init__(self, window: float, start: float | None = None, buckets: int = 64) -> None:
        self.window = window
        self.width = window / buckets
        self.buckets = buckets
        self.start = start  # None: from the first arrival (no bias from an idle start-up)
        self.total = 0
        self._counts: deque[list[int]] = deque()  # [bucket index, count], oldest first

    def add(self, now: float, n: int = 1) -> None:
        if self.start is None:
            self.start = now
        b = int((now - self.start) // self.width)
        if self._counts and self._counts[-1][0] == b:
            self._counts[-1][1] += n
        else:
            self._counts.append([b, n])
        self.total += n
        self._trim(b)

    def _trim(self, b: int) -> None:
        while self._counts and self._counts[0][0] <= b - self.buckets:
            self._counts.popleft()

    def rate(self, now: float) -> float | None:
        """λ over the window ending at ``now`` (whole buckets plus the current partial one);
        None before any arrival or time has passed."""
        if self.start is None:
            return None
        b = int((now - self.start) // self.width)
        self._trim(b)
        span = min(now - self.start, (now - self.start) - (b - self.buckets + 1) * self.width)
        if span <= 0:
            return None
        return sum(c for _, c in self._counts) / span


@dataclass(frozen=True)
class LogEntry:
    """One access-log line of a stage: its status, its CPU demand (seconds; None when the line
    gives none, see :meth:`AccessLogTail.poll_entries`) and mod_overtake_prio's time split (None
    without ``OvertakeRequestTimes``)."""

    stage: int
    cpu: float | None
    times: TimedRequest | None
    status: int = 200


class AccessLogTail:
    """New lines of Apache's access log since the last read: (stage index, CPU seconds)."""

    def __init__(self, path: str | os.PathLike[str], table: StageTable) -> None:
        from overtake.controller.log_format import LineParser

        self.path = Path(path)
        self.table = table
        self.parser = LineParser()
        try:  # only requests from now on: a long history would stall the first read
            self.offset = self.path.stat().st_size
        except FileNotFoundError:
            self.offset = 0
        self.bad_lines = 0
        #: per stage name: its lines read, and its 200 answers whose line gave no demand
        self.lines: Counter[str] = Counter()
        self.no_demand: Counter[str] = Counter()
        self.with_demand: Counter[str] = Counter()  #: per stage name: lines that gave a demand
        #: per stage name: whether its last 200 answer without a demand carried the module's CPU note
        self.noted: dict[str, bool] = {}
        #: where a stage's work runs, by its name (module mode: the module's counts of where each
        #: stage's requests were served); ``apache`` lets the module's thread-CPU note stand for a
        #: demand where no stage handler noted one (a real application's handler in Apache's
        #: threads, e.g. mod_php). None: only the stage handler's notes are demands.
        self.runs_in: Callable[[str], str | None] | None = None

    @property
    def no_cpu(self) -> int:
        """200 answers, all stages, whose line gave no demand."""
        return sum(self.no_demand.values())

    def poll(self) -> list[tuple[int, float | None]]:
        """(stage, CPU seconds or None) of every new line of a stage (see :meth:`poll_entries`)."""
        return [(e.stage, e.cpu) for e in self.poll_entries()]

    def poll_entries(self) -> list[LogEntry]:
        """The new lines of the stages, whatever their answer: each is an arrival (a request the
        module dropped because its client left, 499, or an error arrived as much as one answered).
        A demand only from a 200 answer: the stage handler's CPU note, or else the module's
        thread-CPU note (``OvertakeRequestTimes``) of a stage whose work runs in Apache's threads
        (:attr:`runs_in`); behind PHP-FPM or a proxy that note is only Apache's wait."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # rotated or truncated
            self.offset = 0
        if size == self.offset:
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(min(size - self.offset, _READ_MAX))
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        out = []
        for line in data[:end].decode("utf-8", errors="replace").split("\n"):
            if not line:
                continue
            try:
                e = self.parser.parse(line)
            except ValueError:  # a foreign line; counted, not fatal
                self.bad_lines += 1
                continue
            method, _, rest = str(e["%r"]).partition(" ")
            path, _, query = rest.rsplit(" ", 1)[0].partition("?")
            routed = self.table.route(method, path, query)
            if routed is None:
                continue
            status, times = int(e["%>s"]), _timed(e)
            name = self.table.names[routed[0]]
            cpu = self._demand(e, name, times) if status == 200 else None
            self.lines[name] += 1
            if cpu is not None:
                self.with_demand[name] += 1
            elif status == 200:
                self.no_demand[name] += 1
                self.noted[name] = times is not None
            out.append(LogEntry(routed[0], cpu, times, status))
        return out

    def _demand(self, e: dict[str, Any], name: str, times: TimedRequest | None) -> float | None:
        note = e["%{stage_cpu_us}n"]
        if note is not None:
            return int(note) / 1e6
        if times is not None and self.runs_in is not None and self.runs_in(name) == "apache":
            return times.cpu
        return None

    def why_no_demand(self, name: str) -> str:
        """Why stage ``name``'s last answered line without a demand gave none, and what gives one."""
        where = self.runs_in(name) if self.runs_in is not None else None
        if where in ("fcgi", "proxy", "cgi"):
            return (f"its work runs in {where}, where Apache's thread only waits: its CPU note is no demand "
                    "(no lever of Apache's threads reaches that work either)")
        if not self.noted.get(name):
            return ("its lines carry no CPU note: give Apache `OvertakeRequestTimes On` and log with the "
                    "sidecar's LogFormat (overtake.controller.log_format.LOG_FORMAT)")
        return ("where its work runs is not known yet: the module's status has counted none of its "
                "requests served (overtake_stage_served_total)")


def _timed(e: dict[str, Any]) -> TimedRequest | None:
    """The line's time split, its start in seconds since the epoch."""
    from overtake.controller.log_format import request_times

    t = request_times(e)
    if t is None:
        return None
    return TimedRequest(start=(int(e["%{begin:usec}t"]) + t.start_us) / 1e6, wall=t.wall_us / 1e6,
                        cpu=t.cpu_us / 1e6, wait=t.wait_us / 1e6, blocked=t.blocked_us / 1e6)


@dataclass
class _StageEstimates:
    reservoirs: dict[str, deque[float]]
    observed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))


class DemandRecorder(LimiterListener):
    """Demand samples and arrivals per stage, fed by the limiter's events and the access log.

    Demands are stored in model time units (seconds / ``time_unit``); the latest
    ``settings.reservoir`` per (stage, source) are kept. Passthrough requests are ignored.
    Every method runs on the event loop and is O(1) (the reservoirs are not shared with threads).
    """

    def __init__(self, settings: OnlineSettings, table: StageTable, *, time_unit: float, cores: int,
                 overhead: float, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.time_unit = time_unit
        self.clock = clock
        self.attained = AttainedService(cores, overhead)
        self.arrivals = [ArrivalRate(settings.arrival_window) for _ in table.names]
        self.stages = [_StageEstimates({s: deque(maxlen=settings.reservoir) for s in SOURCES}) for _ in table.names]
        self.tail = AccessLogTail(settings.access_log, table) if settings.access_log else None
        #: per pair of consecutive stages (i, i+1) that the stages file links (``next``): the
        #: attained demands of one transaction's two requests, the link the limiter made (the
        #: follow-up claimed the reservation the first one's completion left on its connection)
        self.pairs: list[deque[tuple[float, float]]] = [deque(maxlen=settings.reservoir) for _ in table.names[1:]]
        self.linked = tuple(table.next_stage[i] == i + 1 for i in range(len(table.names) - 1))
        self._done: tuple[Ticket, float] | None = None  # the last completed ticket and its demand
        self._first: dict[int, tuple[int, float]] = {}  # id(reservation) -> (stage, first demand)

    def set_time_unit(self, seconds: float) -> None:
        """Keep the held demands in a new model unit (rescaled, none dropped)."""
        f = self.time_unit / seconds
        for st in self.stages:
            for src, r in st.reservoirs.items():
                st.reservoirs[src] = deque((x * f for x in r), maxlen=r.maxlen)
        self.pairs = [deque(((x * f, y * f) for x, y in p), maxlen=p.maxlen) for p in self.pairs]
        self.time_unit = seconds

    # ---- the limiter's events --------------------------------------------------------------
    def on_arrival(self, ticket: Ticket, now: float) -> None:
        if ticket.stage != PASSTHROUGH:
            self.add_arrival(ticket.stage, now)

    def on_admit(self, ticket: Ticket, now: float) -> None:
        if ticket.stage != PASSTHROUGH:
            self.attained.admit(id(ticket), now)

    def on_release(self, ticket: Ticket, now: float, outcome: str) -> None:
        if ticket.stage == PASSTHROUGH:
            return
        s = self.attained.release(id(ticket), now)
        first = self._first.pop(id(ticket), None)
        self._done = None
        if s is not None and outcome == "completed" and s > 0:
            self.add_demand(ticket.stage, s, "attained")
            self._done = (ticket, s)
            if first is not None and first[0] + 1 == ticket.stage:
                self.pairs[first[0]].append((first[1] / self.time_unit, s / self.time_unit))

    def on_reject(self, ticket: Ticket, reason: str) -> None:
        self._first.pop(id(ticket), None)

    def on_follow(self, ticket: Ticket, hold: Ticket, now: float) -> None:
        # release() tells its listeners of the completion, then of the reservation it leaves
        if (self._done is not None and self._done[0] is ticket and ticket.stage < len(self.linked)
                and self.linked[ticket.stage]):
            self._first[id(hold)] = (ticket.stage, self._done[1])
        self._done = None

    def on_claim(self, ticket: Ticket, now: float) -> None:
        self.add_arrival(ticket.stage, ticket.t_arrive)  # the follow-up's arrival is its claim
        if ticket.status == ADMITTED:  # attained service counts from the claim, not the reservation
            self.attained.release(id(ticket), ticket.t_admit)
            self.attained.admit(id(ticket), ticket.t_admit)

    # ---- samples ---------------------------------------------------------------------------
    def add_arrival(self, stage: int, now: float) -> None:
        """One arrival to ``stage`` at ``now`` (seconds)."""
        self.arrivals[stage].add(now)

    def add_demand(self, stage: int, seconds: float, source: str) -> None:
        """One service-demand sample (seconds) of ``stage`` from ``source``."""
        st = self.stages[stage]
        st.reservoirs[source].append(seconds / self.time_unit)
        st.observed[source] += 1

    def poll_log(self, recs: list[tuple[int, float | None]] | None = None) -> int:
        """Add access-log lines (read now, or ``recs`` read by :meth:`AccessLogTail.poll`): each a
        demand sample when it has one, and an arrival with ``arrivals_from_log``; lines added."""
        if self.tail is None:
            return 0
        if recs is None:
            recs = self.tail.poll()
        now = self.clock()
        for stage, cpu in recs:
            if cpu is not None and cpu > 0:
                self.add_demand(stage, cpu, "access_log")
            if self.settings.arrivals_from_log:  # at the poll: λ's window is far longer than log_poll
                self.add_arrival(stage, now)
        return len(recs)

    # ---- what the refit uses ---------------------------------------------------------------
    def paired(self, i: int) -> FloatArray:
        """The (stage i, stage i+1) demand pairs of linked transactions, model units, shape (n, 2)."""
        return np.array(self.pairs[i], dtype=float).reshape(-1, 2)

    def arrival_rate(self) -> float | None:
        """λ (per second) of transactions: arrivals to the first stage in the window."""
        return self.arrivals[0].rate(self.clock())

    def choose(self, stage: int) -> tuple[str, FloatArray]:
        """The source whose samples the refit of ``stage`` uses, and those samples (model units)."""
        res = self.stages[stage].reservoirs
        log = np.fromiter(res["access_log"], dtype=float)
        if log.size >= self.settings.min_samples:
            return "access_log", log
        # With an access log the log is the source: the attained estimate is biased whenever other
        # work shares Apache's cores. Its lines arrive a poll later than completions, so wait for
        # them; fall back only if the log has given nothing while 2 × min_samples requests completed
        # (a wrong --access-log path or format).
        if self.tail is not None and (log.size > 0 or len(res["attained"]) < 2 * self.settings.min_samples):
            return "access_log", log
        return "attained", np.fromiter(res["attained"], dtype=float)
