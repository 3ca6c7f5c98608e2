"""The sidecar's own limiter on a virtual processor-sharing CPU: a trace of transactions replayed.

van der Weij et al., "Dynamic thread assignment" §2 models one processor shared equally
(processor sharing) by the admitted requests, each transaction visiting stages 1..N in turn.
:func:`replay` runs a recorded or generated trace
(arrival times, per-stage demands and start phases, in model time units) through
:class:`overtake.controller.sidecar.limiter.Limiter` — the admission code the gateway runs — on a virtual clock,
with service by exact processor sharing and no network, kernel or Apache in the way.

Uses: the ideal counterpart of a run on Apache (bench/apache_table2.py replays the same trace on
Apache: the run minus the replay is the implementation's effect, the replay minus the model the
trace's randomness), and a check of the limiter against the MDP: over long traces the replay's
mean response time converges to the policy's exact E[W] (tests/controller/sidecar/test_twin.py).

``routing`` says when the request for stage i+1 enters: ``next`` (the stages file's ``next``:
a reservation at stage i's completion, claimed by the follow-up after a zero round trip — what
the sidecar does), ``client`` (submitted after the completion's decision, as a proxy without
``next`` sees it), ``instant`` (submitted before it: the model's routing).

``cpu_priority`` (:class:`overtake.mdp.priority.CpuPriority`) replaces equal sharing by the
CPU priority of mod_overtake_prio: each admitted request is in a level set by its attained service at the stage
(thresholds in model units) and its start phase; levels share the CPU by weight, PS within a level.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np

from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.limiter import ADMITTED, Limiter, Ticket
from overtake.controller.sidecar.policies import SpawnPolicy, load_policy
from overtake.controller.sidecar.stages import ClassifierSettings
from overtake.mdp.priority import CpuPriority

__all__ = ["ROUTINGS", "replay"]

ROUTINGS = ("next", "client", "instant")


def replay(
    trace: Mapping[str, np.ndarray],
    policy: SpawnPolicy | str,
    *,
    time_unit: float = 1.0,
    mode: str = "explicit",
    max_inflight: int = 1_000_000,
    routing: str = "next",
    cpu_priority: CpuPriority | None = None,
    dispatch_delay: float = 0.0,
) -> np.ndarray:
    """Response time of every transaction (seconds = units × ``time_unit``).

    Parameters
    ----------
    trace
        ``arrival`` (increasing, units), and per stage i ``demand{i}`` (units) and ``phase{i}``
        (0-based start phase, as the client would send it in the phase header); optionally
        ``route{i}``, the route class, asked for as ``/stage<i+1>/r<route>`` (loadgen.make_trace).
    policy
        A loaded policy or a ``--policy`` spec (file, ``pi(k)``, ``passthrough``).
    mode
        Classifier mode (``explicit`` uses the trace's phases; ``hidden`` the prior and the
        attained service; ``learned`` each route's history of demands, fed as requests complete).
    cpu_priority
        Priority levels on the virtual CPU; ``None`` is equal processor sharing.
    dispatch_delay
        Seconds from a request's admission to the start of its service (the hand-over to a
        real server: the sidecar's forward, the server's wake-up); the CPU serves the others
        meanwhile, or idles. 0 is the ideal replay.
    """
    if not (dispatch_delay >= 0.0 and np.isfinite(dispatch_delay)):
        raise ValueError(f"dispatch_delay: seconds >= 0, got {dispatch_delay!r}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing: one of {', '.join(ROUTINGS)}, got {routing!r}")
    n_stages = sum(1 for k in trace if k.startswith("demand"))
    if n_stages < 1 or "arrival" not in trace:
        raise ValueError("trace: needs 'arrival' and 'demand0', 'phase0', ... per stage")
    if cpu_priority is not None and len(cpu_priority.thresholds) != n_stages:
        raise ValueError(f"cpu_priority: thresholds for {len(cpu_priority.thresholds)} stages, the trace has {n_stages}")
    return asyncio.run(_replay(trace, policy, n_stages, time_unit, mode, max_inflight, routing, cpu_priority,
                               dispatch_delay))


async def _replay(trace: Mapping[str, np.ndarray], policy: SpawnPolicy | str, n_stages: int, unit: float,
                  mode: str, cap: int, routing: str, priority: CpuPriority | None = None,
                  delay: float = 0.0) -> np.ndarray:
    return _Replay(trace, policy, n_stages, unit, mode, cap, routing, priority, delay).run()


class _Replay:
    """One replay: the limiter on a virtual clock, the requests it admitted sharing the CPU."""

    def __init__(self, trace: Mapping[str, np.ndarray], policy: SpawnPolicy | str, n_stages: int, unit: float,
                 mode: str, cap: int, routing: str, priority: CpuPriority | None, delay: float) -> None:
        names = tuple(f"stage{i + 1}" for i in range(n_stages))
        self.pol = load_policy(policy, names) if isinstance(policy, str) else policy
        self.clf = Classifier(ClassifierSettings(mode=mode, time_unit=unit), self.pol)  # type: ignore[arg-type]
        self.now = 0.0
        self.lim = Limiter(self.pol, self.clf, stage_names=names, queue_caps=(10**9,) * n_stages, max_inflight=cap,
                           passthrough_cap=None, passthrough_queue_cap=10**9, clock=lambda: self.now)
        self.n_stages, self.unit, self.routing, self.priority, self.delay = n_stages, unit, routing, priority, delay
        self.n = len(trace["arrival"])
        self.arrival = np.asarray(trace["arrival"], dtype=float) * unit
        self.demand = [np.asarray(trace[f"demand{s}"], dtype=float) * unit for s in range(n_stages)]
        self.phase = [np.asarray(trace[f"phase{s}"], dtype=np.int64) for s in range(n_stages)]
        self.routes = [trace.get(f"route{s}") for s in range(n_stages)]
        self.out = np.full(self.n, np.nan)
        self.left: dict[Ticket, float] = {}  # in service: remaining seconds of CPU
        self.owner: dict[Ticket, tuple[int, int]] = {}  # ticket -> (transaction, stage)
        self.queued: list[Ticket] = []
        self.level: dict[Ticket, int] = {}  # with CPU priority: each request's level on the CPU
        self.pending: dict[Ticket, float] = {}  # admitted, service starts at this time (dispatch_delay)

    def run(self) -> np.ndarray:
        nxt = 0
        while nxt < self.n or self.left or self.queued or self.pending:
            k = len(self.left)
            t_arr = self.arrival[nxt] if nxt < self.n else np.inf
            t_start = min(self.pending.values()) if self.pending else np.inf
            done, t_done, demote, t_dem, rate = self._next_events(k)
            if not np.isfinite(min(t_arr, t_done, t_start)):
                raise RuntimeError(f"replay under {self.pol.name}: requests wait but none is in service")
            self._serve(min(t_arr, t_done, t_dem, t_start) - self.now, k, rate)
            if t_start < min(t_arr, t_done, t_dem):
                for t in [t for t, at in self.pending.items() if at <= t_start]:
                    del self.pending[t]
                    self._begin(t)
                continue
            if demote is not None and t_dem < min(t_arr, t_done):
                self.level[demote] += 1  # its attained service at the stage reached the level's upper threshold
                continue
            if done is not None and t_done <= t_arr:
                self._complete(done)
            else:
                self._enqueue(self.lim.submit(0, self._header_phase(nxt, 0), self._key(nxt, 0)), nxt, 0)
                nxt += 1
            self._start_admitted()
        return self.out

    def _next_events(self, k: int) -> tuple[Ticket | None, float, Ticket | None, float, dict[Ticket, float]]:
        """The next completion and the next demotion (request, time), and each request's CPU share."""
        if not k:
            return None, np.inf, None, np.inf, {}
        if self.priority is None:
            done = min(self.left, key=self.left.__getitem__)
            return done, self.now + self.left[done] * k, None, np.inf, {}
        weights = self.priority.weights
        wsum = sum(weights[lv] for lv in (self.level[t] for t in self.left))
        rate = {t: weights[self.level[t]] / wsum for t in self.left}  # weighted share, PS within a level
        done = min(self.left, key=lambda t: self.left[t] / rate[t])
        demote, t_dem = None, np.inf
        for t, rem in self.left.items():
            i, s = self.owner[t]
            d = max(self.now, self.now + (self._edge(t) - (float(self.demand[s][i]) - rem)) / rate[t])
            if d < t_dem:
                demote, t_dem = t, d
        return done, self.now + self.left[done] / rate[done], demote, t_dem, rate

    def _serve(self, step: float, k: int, rate: dict[Ticket, float]) -> None:
        """Advance the clock by ``step``, serving every request in service."""
        if k and self.priority is None:
            for t in self.left:
                self.left[t] -= step / k  # processor sharing: every admitted request at rate 1/k
        elif k:
            for t in self.left:
                self.left[t] -= step * rate[t]
        self.now += step

    def _complete(self, done: Ticket) -> None:
        """``done`` finished its stage: release it, and send its transaction on (``routing``)."""
        del self.left[done]
        self.level.pop(done, None)
        i, s = self.owner.pop(done)
        self.clf.observe(s, self._key(i, s), float(self.demand[s][i]))  # learned mode: the route's history
        lim = self.lim
        if s + 1 == self.n_stages:
            lim.release(done, "completed")
            self.out[i] = self.now - self.arrival[i]
        elif self.routing == "instant":
            self._enqueue(lim.submit(s + 1, self._header_phase(i, s + 1), self._key(i, s + 1)), i, s + 1)
            lim.release(done, "completed")
        elif self.routing == "next":
            ph = self._header_phase(i, s + 1)
            hold = lim.release(done, "completed", (s + 1, ph))
            assert hold is not None
            self._enqueue(lim.claim(hold, ph, self._key(i, s + 1)), i, s + 1)
        else:
            lim.release(done, "completed")
            self._start_admitted()
            self._enqueue(lim.submit(s + 1, self._header_phase(i, s + 1), self._key(i, s + 1)), i, s + 1)

    def _edge(self, t: Ticket) -> float:
        """Attained seconds at which t leaves its level (inf in the last)."""
        assert self.priority is not None
        lv, s = self.level[t], self.owner[t][1]
        return self.priority.thresholds[s][lv] * self.unit if lv < self.priority.levels - 1 else np.inf

    def _key(self, i: int, s: int) -> str:
        """The route key the gateway would form (method + path), "" without route classes."""
        r = self.routes[s]
        return "" if r is None else f"GET /stage{s + 1}/r{int(r[i])}"

    def _header_phase(self, i: int, s: int) -> int:
        return self.clf.start_phase(s, self._key(i, s), str(int(self.phase[s][i]) + 1).encode(), None)

    def _enqueue(self, t: Ticket | None, i: int, s: int) -> None:
        assert t is not None  # queue caps are unbounded here
        self.owner[t] = (i, s)
        self.queued.append(t)

    def _begin(self, t: Ticket) -> None:
        i, s = self.owner[t]
        self.left[t] = float(self.demand[s][i])
        if self.priority is not None:
            p = self.priority
            self.level[t] = p.start_levels[s][int(self.phase[s][i])] if p.start_levels is not None else 0

    def _start_admitted(self) -> None:
        for t in [t for t in self.queued if t.status == ADMITTED]:
            self.queued.remove(t)
            if self.delay > 0:
                self.pending[t] = self.now + self.delay
            else:
                self._begin(t)
