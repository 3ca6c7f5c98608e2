"""π* of the MDP whose state the policy sees (``phase_info`` full or start), with auto-truncation.

A truncated MDP has two caps, and the answer must depend on neither:

* Request cap C: the computed policy is evaluated exactly on caps C, 1.5·C, … (states beyond the
  solve cap answered by the policy's documented extension) until E[W] settles
  (:mod:`overtake.mdp.caps`); the solve cap grows by 1.25 while the re-solved policy's settled E[W]
  moves by ``tol`` or more.
* Thread cap K_max: the MDP is re-solved with K_max + 1; K_max grows while that improves E[W] by
  ``tol`` or more. Once two threads have been added, a probe whose improvement the last two
  extrapolate to less than ``tol``/2 is not solved (:func:`predicted_thread_gain`).

Each re-solve is warm-started from the previous value function, mapped onto the larger space.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .average_cost import SolveResult, induced_matrix, solve_space
from .caps import ladder_cap, next_solve_cap, relative_change, settle
from .errors import TruncationError
from .evaluate import PolicyMetrics
from .model import TandemModel
from .policy import Policy
from .rule_evaluation import WarmStarts, evaluate_rule
from .statespace import Layout, PhaseInfo, StateSpace, Truncation, count_states

__all__ = ["PREDICT_MARGIN", "Optimum", "auto_start", "estimate_states", "predicted_thread_gain", "solve_mdp"]

FloatArray = npt.NDArray[np.float64]
Progress = Callable[[str], None]
#: ``beside(fn, *args)`` runs ``fn(*args)`` in another process; ``.result()`` of what it returns waits for it
Beside = Callable[..., Any]


@dataclass
class Optimum:
    """π* with its solve record, exact metrics, truncation and the auto-truncation trace."""

    policy: Policy
    solve: SolveResult
    metrics: PolicyMetrics
    truncation: Truncation
    trace: list[dict[str, Any]]
    seconds: float
    sweeps: int


def _warm_values(old: StateSpace, V: FloatArray, new: StateSpace) -> FloatArray:
    """Map a value function onto a larger space: project each new state into the old one."""
    rows = new.rows.copy()
    Q = new.Q
    # move surplus threads back to their queue, largest coordinate first
    surplus = rows[:, Q:].sum(axis=1) - old.k_max
    queue_of = np.array([next(q for q in range(Q) if any(d == c for c, _ in new.layout.spawn[q]))
                         for d in range(new.D)])
    while np.any(surplus > 0):
        sel = np.flatnonzero(surplus > 0)
        d = np.argmax(rows[sel, Q:], axis=1)
        rows[sel, Q + d] -= 1
        rows[sel, queue_of[d]] += 1
        surplus[sel] -= 1
    excess = rows.sum(axis=1) - old.cap
    # a state beyond the old cap costs about one more request's worth of bias per extra request:
    # extrapolate by the mean step of V between the old cap's last two levels (the plain
    # projection starts the solve no better than zeros)
    n_old = old.rows.sum(axis=1)
    top, below = n_old == old.cap, n_old == old.cap - 1
    slope = float(V[top].mean() - V[below].mean()) if top.any() and below.any() else 0.0
    lift = slope * np.maximum(excess, 0)
    while np.any(excess > 0):
        sel = np.flatnonzero(excess > 0)
        q = np.argmax(rows[sel, :Q], axis=1)
        rows[sel, q] -= 1
        excess[sel] -= 1
    idx = old.find(rows)
    out = np.where(idx >= 0, V[np.maximum(idx, 0)], 0.0) + lift
    shifted: FloatArray = out - out[0]
    return shifted


def auto_start(model: TandemModel) -> Truncation:
    """Where auto-truncation starts: 10 requests, ``cores + 2`` threads (at most 10)."""
    return Truncation(10, min(model.cores + 2, 10))


def estimate_states(model: TandemModel, truncation: Truncation | None = None, phase_info: PhaseInfo = "full") -> int:
    """States of the largest MDP :func:`solve_mdp` is expected to solve, without solving.

    A fixed ``truncation`` is solved once: the count is exact (:func:`count_states`). Auto-truncation
    solves on its start (C0, K0) (:func:`auto_start`), grows the thread cap while one more thread
    helps, then always re-solves once on the next solve cap C1 (:func:`next_solve_cap`) with the
    thread cap it settled on, K ≥ K0. So the largest solve holds at least ``count(C1, K0)`` states;
    the estimate is ``count(C1, K0 + 1)``, one thread more, where non-exponential stages settle
    (van der Weij, Bhulai and van der Mei, "Dynamic thread assignment", Table 1: within 1.5× of the
    largest solve on every case). It is at most ``count(C1, K0 + 1) / count(C1, K0)`` (1.35 to 1.6
    for two stages of one to four phases in all) above the largest solve; it falls short when K
    grows by three or more or C grows past C1.
    """
    if truncation is not None:
        return count_states(model, truncation, phase_info)
    tr = auto_start(model)
    c1 = next_solve_cap(tr.max_requests)
    return count_states(model, Truncation(c1, min(tr.k_max + 1, c1)), phase_info)


#: A thread-cap probe is skipped when the improvement :func:`predicted_thread_gain` extrapolates is
#: below this fraction of ``tol`` (0 probes every thread cap).
PREDICT_MARGIN = 0.5


def predicted_thread_gain(gains: list[float]) -> float | None:
    """The relative E[W] improvement one more thread is predicted to bring, from the last two.

    ``gains`` are the improvements of the threads added so far (each probe of :func:`solve_mdp`
    that moved E[W] by ``tol`` or more). They fall roughly geometrically, as the chance that the
    thread cap binds falls with each thread (on the Table 1 cases that add two threads, each is a
    tenth to a fifth of the one before), so the next is predicted as g_K·(g_K/g_{K−1}); None
    (probe) unless both improved and the ratio is at most one half. The probe it saves is a solve
    on the largest space at the first request cap, whose result would be discarded.
    """
    if len(gains) < 2:
        return None
    prev, last = gains[-2], gains[-1]
    if not (prev > 0 and last > 0 and last <= 0.5 * prev):
        return None
    return last * last / prev


class _Search:
    """The state of one auto-truncated solve: its trace, its sweeps and its warm starts."""

    def __init__(self, model: TandemModel, phase_info: PhaseInfo, method: str, rtol: float, tol: float,
                 progress: Progress | None, max_states: int | None = None) -> None:
        self.model, self.phase_info, self.method = model, phase_info, method
        self.rtol, self.tol, self.progress = rtol, tol, progress
        self.max_states = max_states
        self.layout = Layout.build(model, phase_info)
        self.trace: list[dict[str, Any]] = []
        self.sweeps = 0
        self.warm = WarmStarts()  # every exact evaluation of a candidate starts from the nearest law known

    def solve_on(self, tr: Truncation, prev: tuple[StateSpace, SolveResult] | None,
                 loose: bool = False) -> tuple[StateSpace, SolveResult]:
        """Solve on ``tr``, warm-started from ``prev``; ``loose``: a check, to ten times ``rtol``."""
        space = StateSpace(self.model, tr, self.phase_info)
        V0 = _warm_values(prev[0], prev[1].bias, space) if prev is not None and self.method != "pi" else None
        res = solve_space(space, method=self.method, tol=self.rtol * 10 if loose else self.rtol, V0=V0,
                          progress=self.progress)
        self.sweeps += res.sweeps
        self.trace.append({"max_requests": tr.max_requests, "max_threads": tr.k_max, "states": space.size,
                           "sweeps": res.sweeps, "loose": loose, "gain_bounds": list(res.gain_bounds)})
        return space, res

    def solved(self, space: StateSpace, res: SolveResult, extra: str = "") -> None:
        if self.progress:
            self.progress(f"pi*: cap {space.cap}, threads {space.k_max}: {space.size} states, "
                          f"{res.sweeps} {res.method} steps{extra}")

    def run(self, tr: Truncation, prev: tuple[StateSpace, SolveResult] | None,
            loose: bool = False) -> tuple[StateSpace, SolveResult, PolicyMetrics]:
        """:meth:`solve_on`, and the policy's exact metrics on its own truncation (in its trace entry)."""
        space, res = self.solve_on(tr, prev, loose)
        return space, res, self.measured(space, res)

    def measured(self, space: StateSpace, res: SolveResult) -> PolicyMetrics:
        """The exact metrics of the policy just solved (the trace's last entry) on its own truncation."""
        P = induced_matrix(space, res.decision)
        m = self.warm.law(space.cap, space.rows, P, space.layout.queue_stage, space.model)
        self.trace[-1].update(mean_response_time=m.mean_response_time, blocking_probability=m.blocking_probability)
        self.solved(space, res, f", E[W] = {m.mean_response_time:.6g}")
        return m

    def extended(self, pol: Policy, tr: Truncation, C: int) -> PolicyMetrics:
        """The policy, extended beyond its solve cap, evaluated exactly on request cap ``C``."""
        m = evaluate_rule(self.model, self.layout, pol.actions, max_requests=C, max_threads=tr.k_max, warm=self.warm)
        self.trace.append({"check": "evaluation cap", "solve_cap": tr.max_requests, "max_requests": C,
                           "max_threads": tr.k_max, "states": m.states, "mean_response_time": m.mean_response_time,
                           "blocking_probability": m.blocking_probability})
        return m

    def limit(self, pol: Policy, tr: Truncation, C: int,
              first: PolicyMetrics | None = None) -> tuple[PolicyMetrics, int]:
        """E[W] of the extended policy on ladder caps from C on, until one step moves it < tol."""
        def step(cap: int, m: PolicyMetrics, change: float) -> None:
            if self.progress:
                self.progress(f"pi*: evaluated on cap {cap}: E[W] = {m.mean_response_time:.6g} (change {change:.2e})")

        out = settle(lambda c: self.extended(pol, tr, c), C, tol=self.tol, first=first, step=step)
        return out.metrics, out.cap

    def limit_beside(self, beside: Beside, pol: Policy, tr: Truncation, C: int,
                     first: PolicyMetrics) -> Callable[[int], tuple[PolicyMetrics, int]]:
        """:meth:`limit` started in a worker (``beside``); the returned call waits for it and merges
        its trace entries (before the trace's entry ``at``), stationary laws and progress lines
        here, as if :meth:`limit` had run here first."""
        # a copy with its own trace and laws: the worker's additions come back through join
        mine = copy.copy(self)
        mine.trace, mine.warm = [], self.warm.copy()
        pending = beside(_limit_elsewhere, mine, pol, tr, C, first)

        def join(at: int) -> tuple[PolicyMetrics, int]:
            lim, Ce, entries, laws, lines = pending.result()
            self.trace[at:at] = entries
            for cap, (rows, pi) in laws.items():
                self.warm.record(cap, rows, pi)
            for line in lines:
                if self.progress:
                    self.progress(line)
            return lim, Ce

        return join

    def thread_cap(self, tr: Truncation) -> tuple[Truncation, StateSpace, SolveResult, PolicyMetrics]:
        """Solve on ``tr``, then add threads while one more improves E[W] by ``tol`` or more."""
        space, res, m = self.run(tr, None)
        gains: list[float] = []  # relative E[W] improvement of each thread added so far
        while True:
            trK = Truncation(tr.max_requests, tr.k_max + 1)
            if trK.k_max == tr.k_max:
                break
            if self.max_states is not None and (n := count_states(self.model, trK, self.phase_info)) > self.max_states:
                self.trace.append({"check": "budget", "max_requests": tr.max_requests, "max_threads": trK.k_max,
                                   "states": n, "max_states": self.max_states, "solved": False})
                if self.progress:
                    self.progress(f"pi*: threads {trK.k_max} not probed: {n} states, over --max-states {self.max_states}")
                break
            predicted = predicted_thread_gain(gains)
            if predicted is not None and predicted < PREDICT_MARGIN * self.tol:
                # the probe would be discarded: its own E[W] would not be reported (see the function)
                self.trace.append({"check": "thread cap", "max_requests": tr.max_requests, "max_threads": trK.k_max,
                                   "predicted_change": predicted, "gains": list(gains), "solved": False})
                if self.progress:
                    self.progress(f"pi*: threads {trK.k_max} not probed: predicted E[W] change {predicted:.2e}")
                break
            # a check like the solve-cap one: tol/10 on the gain bounds its sub-optimality, ten
            # times finer than the tol it is judged by
            spK, resK, mK = self.run(trK, (space, res), loose=True)
            if relative_change(mK.mean_response_time, m.mean_response_time) < self.tol:
                break
            gains.append((m.mean_response_time - mK.mean_response_time) / m.mean_response_time)
            tr, space, res, m = trK, spK, resK, mK
        return tr, space, res, m


    def next_cap(self, tr: Truncation) -> Truncation:
        """The next solve cap, refused when its MDP would exceed ``max_states`` (the answer would
        still move at the current cap, so stopping there silently would report an unsettled E[W])."""
        tr2 = Truncation(next_solve_cap(tr.max_requests), tr.k_max)
        if self.max_states is not None and (n := count_states(self.model, tr2, self.phase_info)) > self.max_states:
            raise TruncationError(
                f"pi*: E[W] still moves at solve cap {tr.max_requests}; the next cap {tr2.max_requests} needs "
                f"{n:,} states, over --max-states {self.max_states:,}; raise --max-states or fit fewer phases")
        return tr2

    def auto(self, start: Truncation, beside: Beside | None,
             candidate: Callable[[Policy, SolveResult], None] | None) -> tuple[Policy, SolveResult, PolicyMetrics, Truncation]:
        """Auto-truncation (:func:`solve_mdp`): the thread cap on ``start``, then solve caps until the
        re-solved policy's E[W] settles; the better of the last two policies."""
        tr, space, res, m = self.thread_cap(start)
        pol = Policy.from_decision(space, res.decision)
        C0 = tr.max_requests
        lim, Ce, ahead = self.first_ladder(pol, tr, space, res, m, beside)
        cur = _Candidate(tr, space, res, pol, lim, Ce)
        while True:  # solve cap: does re-solving on a larger cap change the policy's E[W]?
            nxt = self.resolve(cur, C0, ahead, candidate if cur.tr == tr else None)
            ahead = None
            if self.compare(cur, nxt) < self.tol:
                # both policies are exactly evaluated on the same cap: report the better one
                best = nxt if nxt.lim.mean_response_time < cur.lim.mean_response_time else cur
                best.pol.meta["metrics_truncation"] = {"max_requests": nxt.cap, "max_threads": best.tr.k_max}
                return best.pol, best.res, best.lim, best.tr
            cur = nxt

    def first_ladder(self, pol: Policy, tr: Truncation, space: StateSpace, res: SolveResult, m: PolicyMetrics,
                     beside: Beside | None) -> tuple[PolicyMetrics, int, tuple[StateSpace, SolveResult] | None]:
        """The first policy's settled E[W] and evaluation cap, and the first re-solve when it ran
        ahead: that re-solve always happens and needs nothing of the first policy's ladder, so with
        a worker the two run side by side."""
        if beside is None:
            lim, Ce = self.limit(pol, tr, tr.max_requests, m)
            return lim, Ce, None
        tr2 = self.next_cap(tr)
        join = self.limit_beside(beside, pol, tr, tr.max_requests, m)
        at = len(self.trace)
        ahead = self.solve_on(tr2, (space, res), loose=True)
        lim, Ce = join(at)
        return lim, Ce, ahead

    def resolve(self, cur: _Candidate, C0: int, ahead: tuple[StateSpace, SolveResult] | None,
                candidate: Callable[[Policy, SolveResult], None] | None) -> _Candidate:
        """Re-solve on the next solve cap (or take the solve that ran ahead) and settle the new
        policy's E[W] from the ladder cap below ``cur``'s evaluation cap that is >= the new solve cap."""
        tr2 = self.next_cap(cur.tr)
        C = ladder_cap(C0, cur.cap, tr2.max_requests)
        # a check, not the answer: tol/10 bounds this policy's sub-optimality on its truncation;
        # its metrics on its own cap only where the settling test starts there (off the ladder
        # C0, 1.5·C0, … it never does, and they would only be recorded)
        first: PolicyMetrics | None = None
        space2, res2 = ahead if ahead is not None else self.solve_on(tr2, (cur.space, cur.res), loose=True)
        if C == tr2.max_requests:
            first = self.measured(space2, res2)
        else:
            self.solved(space2, res2)
        pol2 = Policy.from_decision(space2, res2.decision)
        if candidate is not None:
            candidate(pol2, res2)
        lim2, Ce2 = self.limit(pol2, tr2, C, first)
        return _Candidate(tr2, space2, res2, pol2, lim2, Ce2)

    def compare(self, cur: _Candidate, nxt: _Candidate) -> float:
        """Evaluate both policies on the same (the larger) evaluation cap, record the check and
        return the relative change of E[W] from ``cur`` to ``nxt``."""
        if nxt.cap > cur.cap:
            cur.lim = self.extended(cur.pol, cur.tr, nxt.cap)
        elif nxt.cap < cur.cap:
            nxt.lim, nxt.cap = self.extended(nxt.pol, nxt.tr, cur.cap), cur.cap
        cur.cap = nxt.cap
        change = relative_change(nxt.lim.mean_response_time, cur.lim.mean_response_time)
        self.trace.append({"check": "solve cap", "max_requests": nxt.tr.max_requests, "previous": cur.tr.max_requests,
                           "evaluation_cap": nxt.cap, "relative_change": change})
        if self.progress:
            self.progress(f"pi*: solve cap {cur.tr.max_requests} -> {nxt.tr.max_requests}: E[W] "
                          f"{cur.lim.mean_response_time:.6g} -> {nxt.lim.mean_response_time:.6g} (change {change:.2e}) "
                          f"on evaluation cap {nxt.cap}")
        return change


@dataclass
class _Candidate:
    """A policy of the solve-cap search: its truncation, its solve, and its settled metrics on
    evaluation cap ``cap``."""

    tr: Truncation
    space: StateSpace
    res: SolveResult
    pol: Policy
    lim: PolicyMetrics
    cap: int


def _limit_elsewhere(search: _Search, pol: Policy, tr: Truncation, C: int, first: PolicyMetrics) -> tuple[
        PolicyMetrics, int, list[dict[str, Any]], dict[int, tuple[npt.NDArray[np.int64], FloatArray]], list[str]]:
    """:meth:`_Search.limit` in a worker: its answer, the trace entries and stationary laws it added
    (by request cap) and its progress lines, for :meth:`_Search.limit_beside` to merge."""
    lines: list[str] = []
    search.progress = lines.append
    n = len(search.trace)
    lim, Ce = search.limit(pol, tr, C, first)
    entries = search.trace[n:]
    laws = {e["max_requests"]: search.warm.recorded(e["max_requests"]) for e in entries}
    return lim, Ce, entries, laws, lines


def solve_mdp(
    model: TandemModel,
    *,
    phase_info: Literal["full", "start"] = "full",
    truncation: Truncation | None = None,
    tol: float = 1e-3,
    method: str = "anderson",
    rvi_tol: float | None = None,
    start: Truncation | None = None,
    progress: Progress | None = None,
    max_states: int | None = None,
    beside: Beside | None = None,
    candidate: Callable[[Policy, SolveResult], None] | None = None,
) -> Optimum:
    """π* for the model; fixed ``truncation``, or auto-truncation to relative accuracy ``tol``.

    Auto-truncation separates the two caps a truncated MDP has:

    * the *solve* cap C_s (and thread cap K): the MDP is solved on it, with blocked arrivals
      charged (StateSpace.cost) so the optimum does not exploit the cap;
    * the *evaluation* cap C_e ≥ C_s: the computed policy, extended beyond C_s by its documented
      projection, is evaluated exactly on caps C_s, 1.5·C_s, … until E[W] moves by less than
      ``tol`` — that E[W] is the one reported, within ``tol`` of its limit.

    K grows while one more thread improves E[W] by ``tol`` or more (a probe the last two
    improvements predict to bring less than ``PREDICT_MARGIN``·``tol`` is not solved, recorded as a
    ``"thread cap"`` check in the trace); C_s grows by 1.25× while the re-solved policy's E[W] (on
    the same evaluation cap) moves by ``tol`` or more; of the last two policies, both exactly
    evaluated on that cap, the better is returned. The stopping tolerance ``rvi_tol`` (default
    ``tol``/100) bounds the policy's sub-optimality on its truncation: g(π) ≤ max(TV − V)
    (Odoni), so it is far inside ``tol``.

    ``max_states`` bounds the ladder: a thread cap whose MDP would exceed it is not probed (a
    ``"budget"`` check in the trace: the optimum under that many threads is returned), and a solve
    cap that would exceed it stops the solve with a :class:`TruncationError` naming the budget.

    ``beside(fn, *args)``: runs ``fn(*args)`` in another process and returns a handle whose
    ``result()`` waits for it (:func:`overtake.api.beside.start`). With it, the first policy's
    evaluation ladder runs there while the next solve cap is solved here: the two do not depend on
    each other, and the ladder's trace entries and stationary laws are merged back before anything
    reads them, so the answer and the trace are the same as without it.

    ``candidate(policy, result)`` is called with the first re-solved policy before it is evaluated:
    the answer more often than not, so a caller may start what it does with the answer on it (in
    another process) and keep that work if :attr:`Optimum.policy` is that very object.
    """
    t0 = time.perf_counter()
    model.check_stable(None if truncation is None else truncation.k_max)
    rtol = tol * 1e-2 if rvi_tol is None else rvi_tol
    s = _Search(model, phase_info, method, rtol, tol, progress, max_states)
    if truncation is not None:
        space, res, m = s.run(truncation, None)
        pol, tr = Policy.from_decision(space, res.decision), truncation
    else:
        pol, res, m, tr = s.auto(start or auto_start(model), beside, candidate)
    return Optimum(pol, res, m, tr, s.trace, time.perf_counter() - t0, s.sweeps)
