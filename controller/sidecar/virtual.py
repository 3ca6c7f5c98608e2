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
    names = tuple(f"stage{i + 1}" for i in range(n_stages))
    pol = load_policy(policy, names) if isinstance(policy, str) else policy
    clf = Classifier(ClassifierSettings(mode=mode, time_unit=unit), pol)  # type: ignore[arg-type]
    now = [0.0]
    lim = Limiter(pol, clf, stage_names=names, queue_caps=(10**9,) * n_stages, max_inflight=cap,
                  passthrough_cap=None, passthrough_queue_cap=10**9, clock=lambda: now[0])
    n = len(trace["arrival"])
    arrival = np.asarray(trace["arrival"], dtype=float) * unit
    demand = [np.asarray(trace[f"demand{s}"], dtype=float) * unit for s in range(n_stages)]
    phase = [np.asarray(trace[f"phase{s}"], dtype=np.int64) for s in range(n_stages)]
    out = np.full(n, np.nan)
    left: dict[Ticket, float] = {}  # in service: remaining seconds of CPU
    owner: dict[Ticket, tuple[int, int]] = {}  # ticket -> (transaction, stage)
    queued: list[Ticket] = []
    level: dict[Ticket, int] = {}  # with CPU priority: each request's level on the CPU
    rate: dict[Ticket, float] = {}
    pending: dict[Ticket, float] = {}  # admitted, service starts at this time (dispatch_delay)

    def edge(t: Ticket) -> float:
        """Attained seconds at which t leaves its level (inf in the last)."""
        assert priority is not None
        lv, s = level[t], owner[t][1]
        return priority.thresholds[s][lv] * unit if lv < priority.levels - 1 else np.inf

    routes = [trace.get(f"route{s}") for s in range(n_stages)]

    def key(i: int, s: int) -> str:
        """The route key the gateway would form (method + path), "" without route classes."""
        r = routes[s]
        return "" if r is None else f"GET /stage{s + 1}/r{int(r[i])}"

    def header_phase(i: int, s: int) -> int:
        return clf.start_phase(s, key(i, s), str(int(phase[s][i]) + 1).encode(), None)

    def enqueue(t: Ticket | None, i: int, s: int) -> None:
        assert t is not None  # queue caps are unbounded here
        owner[t] = (i, s)
        queued.append(t)

    def begin(t: Ticket) -> None:
        i, s = owner[t]
        left[t] = float(demand[s][i])
        if priority is not None:
            start = priority.start_levels[s][int(phase[s][i])] if priority.start_levels is not None else 0
            level[t] = start

    def start_admitted() -> None:
        for t in [t for t in queued if t.status == ADMITTED]:
            queued.remove(t)
            if delay > 0:
                pending[t] = now[0] + delay
            else:
                begin(t)

    nxt = 0
    while nxt < n or left or queued or pending:
        k = len(left)
        t_arr = arrival[nxt] if nxt < n else np.inf
        t_start = min(pending.values()) if pending else np.inf
        done, t_done = None, np.inf
        demote, t_dem = None, np.inf
        if k and priority is None:
            done = min(left, key=left.__getitem__)
            t_done = now[0] + left[done] * k
        elif k:
            assert priority is not None
            wsum = sum(priority.weights[lv] for lv in (level[t] for t in left))
            rate = {t: priority.weights[level[t]] / wsum for t in left}  # weighted share, PS within a level
            done = min(left, key=lambda t: left[t] / rate[t])
            t_done = now[0] + left[done] / rate[done]
            for t, rem in left.items():
                i, s = owner[t]
                d = max(now[0], now[0] + (edge(t) - (float(demand[s][i]) - rem)) / rate[t])
                if d < t_dem:
                    demote, t_dem = t, d
        if not np.isfinite(min(t_arr, t_done, t_start)):
            raise RuntimeError(f"replay under {pol.name}: requests wait but none is in service")
        step = min(t_arr, t_done, t_dem, t_start) - now[0]
        if k and priority is None:
            for t in left:
                left[t] -= step / k  # processor sharing: every admitted request at rate 1/k
        elif k:
            for t in left:
                left[t] -= step * rate[t]
        now[0] += step
        if t_start < min(t_arr, t_done, t_dem):
            for t in [t for t, at in pending.items() if at <= t_start]:
                del pending[t]
                begin(t)
            continue
        if demote is not None and t_dem < min(t_arr, t_done):
            level[demote] += 1  # its attained service at the stage reached the level's upper threshold
            continue
        if done is not None and t_done <= t_arr:
            del left[done]
            level.pop(done, None)
            i, s = owner.pop(done)
            clf.observe(s, key(i, s), float(demand[s][i]))  # learned mode: the route's history
            last = s + 1 == n_stages
            if last:
                lim.release(done, "completed")
                out[i] = now[0] - arrival[i]
            elif routing == "instant":
                enqueue(lim.submit(s + 1, header_phase(i, s + 1), key(i, s + 1)), i, s + 1)
                lim.release(done, "completed")
            elif routing == "next":
                ph = header_phase(i, s + 1)
                hold = lim.release(done, "completed", (s + 1, ph))
                assert hold is not None
                enqueue(lim.claim(hold, ph, key(i, s + 1)), i, s + 1)
            else:
                lim.release(done, "completed")
                start_admitted()
                enqueue(lim.submit(s + 1, header_phase(i, s + 1), key(i, s + 1)), i, s + 1)
        else:
            enqueue(lim.submit(0, header_phase(nxt, 0), key(nxt, 0)), nxt, 0)
            nxt += 1
        start_admitted()
    return out
