"""The best thread policy for what a sidecar can see: observation-restricted policy improvement.

π* (van der Weij, Bhulai and van der Mei, "Dynamic thread assignment") needs every request's phase.
Without phase labels a sidecar sees the counts of :mod:`overtake.mdp.observation` (waiting per
queue, active threads per stage); with route classes (:mod:`overtake.mdp.routes`) it also sees each
waiting request's route. The problem is then partially observed: the chain keeps the phases, the
policy may not look at them. We optimise over deterministic observation policies (one action per
observation class), every one evaluated exactly on the full chain:

1. Start from the best few (three), by exact gain on the truncated chain, of the baselines π(1), π(2), π(4),
   π(∞), π(1,…,1) and the overtaking heuristic restricted to the observation (per class, the
   action the heuristic takes most often there, weighted by its own stationary law of decision
   epochs), each as a table; for ``route`` also the ``none`` optimum and the baselines with the
   lightest route (least expected work) started first (:mod:`overtake.mdp.observed_tables`).
   One local search from each, the best result kept; a larger solve cap starts from the best two
   of the previous cap's table and the baselines. With ``presearch``, a first solve cap whose
   chain is large (at least :data:`PRESEARCH_STATES` states) is first solved so on a smaller cap
   (the largest with at most a quarter of its states), and is then searched from that table
   alone: the starts' long searches run on a chain whose evaluations cost a fraction of the
   large one's, and the one search on the large chain starts near its end (where the searches
   are cut by their evaluation budget, it may end in a worse local optimum than the best of the
   starts' searches on the large chain). The searches are independent: each starts from
   the solver state the starting evaluations left (preconditioner, work budget), so that with a
   second process (``beside``) each runs in whichever process is free first, with the same answers.
2. Improve: the weighted-Q step of :meth:`ObservationSpace.propose` in every class; accept it
   only if the exact gain is lower. If not, try the changed classes with the largest first-order
   gains (a quarter of them, a sixteenth, …, one), then single classes in that order; stop when
   no step lowers the exact gain or no class proposes a change. Every step is recorded. The
   starting tables and the trials are screened by their stationary gain alone
   (:meth:`ObservationSpace.stationary_gain`, exact, warm-started from the current law): only
   the starts searched from and the trials not clearly worse are evaluated in full (bias and
   law, an iterative law solve started from the screen's), and a step is accepted on that full
   evaluation's gain (:mod:`overtake.mdp.observed_improve`).
   A trial that changes the decision rows of a few states is evaluated in full at once, by a
   low-rank update of the current table's factorization (:meth:`ObservationSpace.evaluate`).
3. Auto-truncation as for π* (:mod:`overtake.mdp.optimum`, :mod:`overtake.mdp.caps`): the table,
   extended beyond its cap by :class:`overtake.mdp.Policy`'s projection, is evaluated exactly on
   request caps C, 1.5C, … until E[W] moves by less than ``tol``; the solve cap grows by 1.25
   (warm start: the previous table) until the re-solved table's E[W] moves by less than ``tol``.
   Each evaluation cap's stationary solve starts from the last table's law on that cap, or else
   from this table's law on the ladder's previous cap. Given a second process (``beside``), the
   first table's ladder runs there while the next solve cap is searched here: the search needs
   nothing of it, and its laws come back to start the next table's solves; the baselines of
   step 4 are then evaluated there while the next table's ladder runs here. Neither goes to a
   second process where the observation hides no phase: the work is too small to pay for its
   start (:func:`overtake.mdp.observed_beside.worth_a_worker`).
4. The answer is the best of the improved table and every baseline, each by its own exactly
   evaluated E[W] (and, for ``route``, the ``none`` optimum): E W(none) ≤ min over the baselines
   by construction. ``source`` names where the answer came from.

A stage with a lock (:mod:`overtake.mdp.lock`): the tables start a thread there only while the
lock has room (:mod:`overtake.mdp.observation`); a request the lock would block waits in the
sidecar. A baseline whose cap exceeds a lock's capacity (π(∞), Apache's default) starts threads
that block, each holding a thread; its table (the starting table, or the answer when it wins)
holds those requests instead and leaves their threads idle, so both run alike: a held request
starts at the release, when the blocked thread would take the lock, and no other start happens
earlier for the thread left free (the tests check E[W] to 1e-8). Where such a baseline has the
least E[W], its table is evaluated exactly all the same (candidate "π(∞) held at the lock") and
is the answer only if that E[W] is below the improved table's. What holding buys is a free
thread: the search may give it to another stage, which pays where threads are scarce.

The optimum over deterministic memoryless policies of a partially observed chain is NP-hard in
general (Littman, "Memoryless policies: theoretical limitations and practical results", 1994):
this is a local search with an exact acceptance test, not a proof of optimality, and there is no
Bellman bracket on its gain. Known answers bound it: with one phase per stage the observation is
the state, the step is Howard's, and the result is π*; and π*(full) ≤ π*(start) ≤ it.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from .caps import EVALUATION_GROWTH, ladder_cap, next_solve_cap, relative_change, settle
from .errors import TruncationError
from .evaluate import PolicyMetrics
from .model import TandemModel
from .observation import ExactEvaluation, ObservationSpace
from .observed_beside import Tickets, baselines_beside, baselines_joined, limit_elsewhere, search_elsewhere, worth_a_worker
from .observed_chain import ChainLaw, observed_law
from .observed_improve import Improvement, distinct, improve, log_searches
from .observed_result import ObservedOptimum, ObservedSolve, holds_at_locks, observed_baselines
from .observed_tables import lift, stage_rule, stage_view, starting_tables
from .policy import Policy
from .routes import RouteSplit
from .rule_evaluation import Evaluation, evaluate_baseline
from .statespace import Layout, Truncation, count_states

if TYPE_CHECKING:
    from .optimum import Beside

__all__ = ["ObservedOptimum", "ObservedSolve", "holds_at_locks", "observed_baselines", "solve_observed"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
Progress = Callable[[str], None]
Observed = Literal["none", "route"]

#: debug level: per solve cap, each local search's evaluations, steps and why it stopped
_log = logging.getLogger(__name__)


#: a first solve cap whose chain has at least this many states is searched from the improved
#: table of a smaller cap (:meth:`_Search.presearch`): each of its exact evaluations costs many
#: of the smaller chain's, and a search from a near-optimal table ends in few steps
PRESEARCH_STATES = 12_000
#: the smaller cap: the largest whose chain has at most this share of the first cap's states
PRESEARCH_SHARE = 4


# ---- the solver --------------------------------------------------------------------------------
def _thread_cap(model: TandemModel, layout: Layout, C: int, max_threads: int | None, budget: int) -> int:
    """The largest thread cap K ≤ C (and ≤ max_threads) whose chain has at most ``budget`` states."""
    K = C if max_threads is None else min(C, max_threads)
    while K > 1 and count_states(model, Truncation(C, K), layout) > budget:
        K -= 1
    return K


@dataclass(frozen=True)
class _Options:
    """The search's settings (:func:`solve_observed`'s parameters)."""

    tol: float
    names: list[str]
    heuristic: bool
    max_threads: int | None
    max_states: int
    max_eval_states: int
    starts: int
    factor: float
    presearch: bool = False
    latest_preconditioner: bool = False


class _Search:
    """One observation-policy solve: its model, layout, options and record (trace, history, counts)."""

    def __init__(self, model: TandemModel, layout: Layout, routes: RouteSplit | None, opts: _Options,
                 none_opt: ObservedOptimum | None, evaluated: dict[str, Evaluation], progress: Progress | None,
                 t0: float) -> None:
        self.t0 = t0
        self.model, self.layout, self.routes, self.opts = model, layout, routes, opts
        self.none_opt, self.evaluated, self.progress = none_opt, evaluated, progress
        self.trace: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []
        self.n_steps = 0
        self.n_evals = 0
        self.beside: Beside | None = None  # a second process: the first ladder and some searches run there
        self.laws: dict[int, ChainLaw] = {}  # the last evaluated table's law per evaluation cap
        self.last: tuple[Policy, ChainLaw] | None = None  # the last law evaluated, and its table
        self.baselines_ahead: Any = None  # the baselines' evaluations under way in a worker (baselines_beside)

    def say(self, line: str) -> None:
        if self.progress:
            self.progress(line)

    def truncation_for(self, C: int) -> Truncation:
        o = self.opts
        return Truncation(C, _thread_cap(self.model, self.layout, C, o.max_threads, o.max_states))

    # ---- one solve cap ------------------------------------------------------------------------
    def optimise(self, tr: Truncation, warm: Policy | None, *,
                 only_warm: bool = False) -> tuple[ObservationSpace, Improvement]:
        """The improved table on ``tr``: local searches from the best starting tables (module
        docstring, steps 1-2); ``warm`` is the previous solve cap's table, and the only start
        where ``only_warm`` (a pre-searched cap: the starts were searched on the smaller cap)."""
        o = self.opts
        osp = ObservationSpace(self.model, tr, self.layout)
        osp.exact.follow = o.latest_preconditioner
        evs: dict[str, Any] = {}
        if only_warm and warm is not None:
            tables = {"previous cap": osp.repair(warm.actions(osp.classes))}
            ranked = list(tables)
            evs["previous cap"] = osp.evaluate(tables["previous cap"])
            screened: dict[str, float] = {}
            starting = {"previous cap": evs["previous cap"].gain}
        else:
            extra: dict[str, IntArray] = {}
            if self.none_opt is not None:
                extra["none optimum (lightest route first)"] = lift(osp, self.none_opt.policy.actions(stage_view(osp)))
            if warm is not None:  # a larger cap: the previous table (its documented projection) and the baselines
                extra["previous cap"] = warm.actions(osp.classes)
            tables = starting_tables(osp, o.names, o.heuristic and warm is None, extra)
            # the starting tables are ranked by their stationary gains; only those the searches start
            # from are evaluated in full (bias included), the best first: its factor preconditions the rest
            screened = starting = {k: osp.stationary_gain(A)[0] for k, A in tables.items()}
            ranked = sorted(screened, key=lambda k: screened[k])[:o.starts if warm is None else min(o.starts, 2)]
            ranked = list(distinct({k: tables[k] for k in ranked}))
            for k in ranked:
                evs[k] = osp.evaluate(tables[k], near=evs.get(ranked[0]))
        self.say(f"pi*: cap {tr.max_requests}, threads {osp.k_max}: {osp.size} states, {osp.n_classes} classes; "
                 f"start from {', '.join(ranked)} (g = {evs[ranked[0]].gain:.8g})")
        t_search = time.perf_counter()
        runs = self.searches(osp, tables, evs, ranked)
        if _log.isEnabledFor(logging.DEBUG):
            log_searches(_log, self.layout.phase_info, tr.max_requests, osp, runs, len(screened),
                         time.perf_counter() - t_search)
        first = min(runs, key=lambda k: runs[k].evaluation.gain)
        imp = runs[first]
        for r in runs.values():
            self.n_steps += r.steps
            self.n_evals += r.evaluations
            self.history.extend({"max_requests": tr.max_requests, **h} for h in r.history)
        self.n_evals += len(screened) + len(evs)
        self.trace.append({"max_requests": tr.max_requests, "max_threads": osp.k_max, "states": osp.size,
                           "classes": osp.n_classes, "start": first, "starting_gains": starting,
                           "improved_gains": {k: r.evaluation.gain for k, r in runs.items()}, "steps": imp.steps,
                           "evaluations": sum(r.evaluations for r in runs.values()), "gain": imp.evaluation.gain,
                           "mean_response_time": imp.evaluation.metrics.mean_response_time,
                           "blocking_probability": imp.evaluation.metrics.blocking_probability})
        return osp, imp

    def searches(self, osp: ObservationSpace, tables: dict[str, IntArray], evs: dict[str, ExactEvaluation],
                 ranked: list[str]) -> dict[str, Improvement]:
        """One local search from each of the ``ranked`` tables, each from the space's solver state
        as the starting evaluations left it (not as an earlier search left it): the searches are
        independent, so with a second process (``beside``) each is run by whichever of the two
        processes is free first, with the same answers."""
        state = osp.exact.state()
        tickets = Tickets(len(ranked)) if self.beside is not None and 1 < len(ranked) < 256 and worth_a_worker(osp) else None
        pending = None
        if tickets is not None:
            assert self.beside is not None
            self.join_baselines()
            pending = self.beside(search_elsewhere, osp, state, tickets, ranked, tables, evs)
        runs: dict[str, Improvement] = {}
        while (j := tickets.take() if tickets is not None else len(runs)) is not None and j < len(ranked):
            k = ranked[j]
            osp.exact.restore(state)
            runs[k] = improve(osp, tables[k], start=k, evaluation=evs[k], progress=self.progress)
        if pending is not None and tickets is not None:
            found, lines = pending.result()
            tickets.close()
            for line in lines:
                self.say(line)
            for k, (actions, ev, history, converged, n_eval) in found.items():
                # the worker's last evaluation comes back without its LU (it does not pickle); the
                # search's starting factor stands in, a factor of this space as any evaluation's is
                runs[k] = Improvement(actions, ExactEvaluation(**ev, factor=evs[k].factor), history, converged, n_eval)
        for k in ranked:  # a worker that died took its searches with it: they run here
            if k not in runs:
                osp.exact.restore(state)
                runs[k] = improve(osp, tables[k], start=k, evaluation=evs[k], progress=self.progress)
        return {k: runs[k] for k in ranked}

    def join_baselines(self) -> None:
        """The baselines' evaluations started in a worker (:func:`baselines_beside`), waited for:
        before the answer, and before another worker starts (one at a time)."""
        if self.baselines_ahead is not None:
            self.evaluated.update(baselines_joined(self.baselines_ahead, self.say))
            self.baselines_ahead = None

    def meta(self, source: str) -> dict[str, Any]:
        seen = "waiting per queue, active threads per stage"
        if self.model.has_lock:
            seen += "; a locked stage's threads are its lock's holders (none starts while the lock is full)"
        return {"source": source, "observation": seen}

    def record(self, osp: ObservationSpace, imp: Improvement, m: PolicyMetrics, source: str,
               cands: dict[str, float], base: dict[str, Evaluation], pol: Policy) -> ObservedOptimum:
        seconds = time.perf_counter() - self.t0
        solve = ObservedSolve(osp.space, imp.evaluation.gain, (None, imp.evaluation.gain), self.n_steps,
                              self.n_evals, imp.converged, seconds, self.history)
        return ObservedOptimum(pol, solve, m, osp.space.trunc, self.trace, seconds, self.n_steps, source, cands, base)

    def fixed(self, truncation: Truncation) -> ObservedOptimum:
        """A fixed truncation: the improved table on it (or the ``none`` optimum where better)."""
        mt = self.opts.max_threads
        tr = Truncation(truncation.max_requests, truncation.max_threads if mt is None else min(mt, truncation.k_max))
        osp, imp = self.optimise(tr, None)
        pol = osp.policy(imp.actions, routes=self.routes, meta=self.meta("improved"))
        cands = {"improved": imp.evaluation.metrics.mean_response_time}
        m, source = imp.evaluation.metrics, "improved"
        if self.none_opt is not None and self.none_opt.solve.gain < imp.evaluation.gain:
            pol, m, source = self.none_opt.policy, self.none_opt.metrics, "none"
            cands["none"] = self.none_opt.metrics.mean_response_time
        return self.record(osp, imp, m, source, cands, {}, pol)

    # ---- evaluation caps ----------------------------------------------------------------------
    def extended(self, pol: Policy, C: int, solve_cap: int) -> PolicyMetrics | None:
        """The table's exact metrics on request cap ``C`` (None: beyond the evaluation budget)."""
        budget = self.opts.max_eval_states
        if count_states(self.model, Truncation(C, pol.max_threads), self.layout) > 4 * budget:
            return None  # certainly beyond the budget: do not even start the search
        # the last table's law on this cap starts the solve: a larger solve cap's table differs
        # from it in a few classes, and its ladder ends on the same caps; else this table's law on
        # the ladder's previous cap, which holds nearly all of the mass
        warm = self.laws.get(C)
        if warm is None and self.last is not None and self.last[0] is pol and self.last[1].cap < C:
            warm = self.last[1]
        try:
            m, law = observed_law(self.model, self.layout, pol.actions, max_requests=C, max_threads=None,
                                  max_states=budget, warm=warm)
        except TruncationError:
            return None
        self.laws[C] = law
        self.last = (pol, law)
        self.trace.append({"check": "evaluation cap", "solve_cap": solve_cap, "max_requests": C, "states": m.states,
                           "mean_response_time": m.mean_response_time, "blocking_probability": m.blocking_probability})
        return m

    def limit(self, pol: Policy, C: int, solve_cap: int, first: PolicyMetrics | None = None) -> tuple[PolicyMetrics, int]:
        """E[W] of the extended table on ladder caps from C on, until one step moves it < tol or
        the next chain is beyond the evaluation budget (then the last E[W], recorded as unsettled)."""
        first = first or self.extended(pol, C, solve_cap)
        budget = self.opts.max_eval_states
        if first is None:
            raise TruncationError(f"observation policy: the chain at cap {C} exceeds {budget} states")

        def step(cap: int, m: PolicyMetrics, change: float) -> None:
            self.say(f"pi*: evaluated on cap {cap}: E[W] = {m.mean_response_time:.6g} (change {change:.2e})")

        out = settle(lambda c: self.extended(pol, c, solve_cap), C, tol=self.opts.tol, factor=self.opts.factor,
                     first=first, max_cap=2000, step=step)
        if out.stop == "max_cap":
            raise RuntimeError(f"observation policy: E[W] still changes at max_requests = {out.cap}")
        if out.stop == "budget":
            self.trace.append({"check": "evaluation cap", "solve_cap": solve_cap, "max_requests": out.refused,
                               "settled": False,
                               "reason": f"the chain exceeds {budget} states; E[W] of cap {out.cap} reported"})
            self.say(f"pi*: cap {out.refused} exceeds {budget} states: E[W] of cap {out.cap} reported, unsettled")
        return out.metrics, out.cap

    def limit_beside(self, beside: Beside, pol: Policy, C: int,
                     first: PolicyMetrics) -> Callable[[int], tuple[PolicyMetrics, int]]:
        """:meth:`limit` (solve cap ``C``) started in a worker (``beside``); the returned call waits
        for it and merges its trace entries (before the trace's entry ``at``), stationary laws and
        progress lines here, as if :meth:`limit` had run here first."""
        self.join_baselines()
        mine = copy.copy(self)  # its own trace and laws: the worker's additions come back through join
        mine.trace, mine.laws = [], dict(self.laws)
        pending = beside(limit_elsewhere, mine, pol, C, first)

        def join(at: int) -> tuple[PolicyMetrics, int]:
            lim, Ce, entries, laws, last, lines = pending.result()
            self.trace[at:at] = entries
            self.laws.update(laws)
            if last is not None:  # the worker's copy of ``pol`` is not ``pol``: the warm start keys on identity
                self.last = (pol, last)
            for line in lines:
                self.say(line)
            return lim, Ce

        return join

    # ---- solve caps ---------------------------------------------------------------------------
    def grow(self, start: int) -> tuple[ObservationSpace, Improvement, Policy, PolicyMetrics, int, int]:
        """Solve on growing solve caps until the re-solved table's settled E[W] moves by less than
        ``tol`` (module docstring, step 3): (space, improvement, policy, E[W], evaluation cap, solve cap).
        With a second process (``beside``) the first table's evaluation ladder runs there while
        the next cap is searched."""
        tr = self.truncation_for(start)
        pre = self.presearch(tr)
        osp, imp = self.optimise(tr, pre, only_warm=pre is not None)
        pol = osp.policy(imp.actions, routes=self.routes)
        C0 = tr.max_requests
        tr2 = self.truncation_for(next_solve_cap(tr.max_requests))
        ahead = None
        if self.beside is not None and tr2.k_max >= tr.k_max and worth_a_worker(osp):
            # the first table's ladder needs nothing of the next cap's search, which always runs
            join = self.limit_beside(self.beside, pol, C0, imp.evaluation.metrics)
            at = len(self.trace)
            ahead = self.optimise(tr2, pol)
            lim, Ce = join(at)
            if self.none_opt is None:  # the answer's baselines, while the next table's ladder runs here
                self.baselines_ahead = baselines_beside(self.beside, self.model, self.opts.names, self.opts.tol,
                                                        self.evaluated)
        else:
            lim, Ce = self.limit(pol, C0, C0, imp.evaluation.metrics)
        while True:  # solve cap: does re-solving on a larger cap change the table's E[W]?
            tr2 = self.truncation_for(next_solve_cap(tr.max_requests))
            if tr2.k_max < tr.k_max:
                self._thread_capped(tr, tr2)
                break
            osp2, imp2 = ahead or self.optimise(tr2, pol)
            ahead = None
            pol2 = osp2.policy(imp2.actions, routes=self.routes)
            C = ladder_cap(C0, Ce, tr2.max_requests, self.opts.factor)
            lim2, Ce2 = self.limit(pol2, C, tr2.max_requests, imp2.evaluation.metrics if C == tr2.max_requests else None)
            if Ce2 != Ce:
                lim, lim2, Ce = self._common_cap(pol, pol2, (lim, Ce, tr), (lim2, Ce2, tr2))
            change = relative_change(lim2.mean_response_time, lim.mean_response_time)
            self.trace.append({"check": "solve cap", "max_requests": tr2.max_requests, "previous": tr.max_requests,
                               "evaluation_cap": Ce, "relative_change": change})
            self.say(f"pi*: solve cap {tr.max_requests} -> {tr2.max_requests}: E[W] {lim.mean_response_time:.6g} -> "
                     f"{lim2.mean_response_time:.6g} (change {change:.2e}) on evaluation cap {Ce}")
            if lim2.mean_response_time < lim.mean_response_time or change >= self.opts.tol:
                tr, osp, imp, pol, lim = tr2, osp2, imp2, pol2, lim2
            if change < self.opts.tol:
                break
        return osp, imp, pol, lim, Ce, tr.max_requests

    def presearch(self, tr: Truncation) -> Policy | None:
        """The improved table of a smaller solve cap, the warm start of a large first cap
        (module docstring, step 1); None without ``presearch`` or where the first cap's chain is small."""
        if not self.opts.presearch:
            return None  # the default: no state count on a solve's path
        size = count_states(self.model, tr, self.layout)
        if size < PRESEARCH_STATES:
            return None
        C = tr.max_requests - 1
        while C > 2 and PRESEARCH_SHARE * count_states(self.model, self.truncation_for(C), self.layout) > size:
            C -= 1
        small = self.truncation_for(C)
        osp, imp = self.optimise(small, None)
        self.trace[-1]["presearch"] = True
        return osp.policy(imp.actions, routes=self.routes)

    def _thread_capped(self, tr: Truncation, tr2: Truncation) -> None:
        # the larger cap fits the state budget only with fewer threads: keep this table (its E[W]
        # is exact all the same; only its optimality on a larger cap is left unchecked)
        budget = self.opts.max_states
        self.trace.append({"check": "solve cap", "max_requests": tr2.max_requests, "previous": tr.max_requests,
                           "settled": False, "reason": f"needs a thread cap {tr2.k_max} < {tr.k_max} "
                                                       f"to fit {budget} states"})
        self.say(f"pi*: solve cap {tr2.max_requests} would need {tr2.k_max} threads to fit {budget} "
                 f"states: the cap-{tr.max_requests} table is kept")

    def _common_cap(self, pol: Policy, pol2: Policy, a: tuple[PolicyMetrics, int, Truncation],
                    b: tuple[PolicyMetrics, int, Truncation]) -> tuple[PolicyMetrics, PolicyMetrics, int]:
        """Both tables' E[W] on one evaluation cap: the larger of their settled caps if it fits the budget."""
        (lim, Ce, tr), (lim2, Ce2, tr2) = a, b
        for cap in (max(Ce, Ce2), min(Ce, Ce2)):
            a1 = lim if cap == Ce else self.extended(pol, cap, tr.max_requests)
            b1 = lim2 if cap == Ce2 else self.extended(pol2, cap, tr2.max_requests)
            if a1 is not None and b1 is not None:
                return a1, b1, cap
        return lim, lim2, Ce

    # ---- the answer ---------------------------------------------------------------------------
    def candidates(self, lim: PolicyMetrics) -> tuple[dict[str, float], dict[str, Evaluation]]:
        """The exact E[W] of every candidate answer and the baselines' evaluations (module docstring, step 4)."""
        cands = {"improved": lim.mean_response_time}
        self.join_baselines()
        if self.none_opt is not None:
            cands["none"] = self.none_opt.metrics.mean_response_time
            return cands, self.none_opt.baselines
        base: dict[str, Evaluation] = {}
        for name in self.opts.names:
            if name not in self.evaluated:
                self.evaluated[name] = evaluate_baseline(self.model, name, tol=self.opts.tol, progress=self.progress)
            base[name] = self.evaluated[name]
            cands[name] = self.evaluated[name].metrics.mean_response_time
        return cands, base

    def answer(self, osp: ObservationSpace, imp: Improvement, pol: Policy, lim: PolicyMetrics, Ce: int,
               solve_cap: int) -> ObservedOptimum:
        """The best of the improved table and every baseline (for ``route``: the ``none`` optimum)."""
        pol.meta.update(self.meta("improved"), metrics_truncation={"max_requests": Ce, "max_threads": None})
        cands, base = self.candidates(lim)
        source = min(cands, key=lambda k: cands[k])
        m = lim
        if source in base and not holds_at_locks(self.model, source):
            # its table holds at the lock the requests the rule blocks (module docstring): the
            # sidecar runs that table, so it is weighed by its own exact E[W]
            held = self.baseline_table(osp, source)
            m_held, C_held = self.limit(held, solve_cap, solve_cap)
            cands[f"{source} held at the lock"] = m_held.mean_response_time
            if m_held.mean_response_time < lim.mean_response_time:
                held.meta.update(metrics_truncation={"max_requests": C_held, "max_threads": None})
                source, m, pol = f"{source} held at the lock", m_held, held
            else:
                source = "improved"
        elif source in base:
            # the baseline's table within the cap; meta names it so an enforcer can run the rule itself
            m, pol = base[source].metrics, self.baseline_table(osp, source)
        elif source == "none":
            assert self.none_opt is not None
            m, pol = self.none_opt.metrics, self.none_opt.policy
            source = "none" if self.none_opt.source == "improved" else f"none: {self.none_opt.source}"
        self.say(f"pi*: best observation policy: {source}, E[W] = {m.mean_response_time:.6g}")
        return self.record(osp, imp, m, source, cands, base, pol)

    def baseline_table(self, osp: ObservationSpace, name: str) -> Policy:
        return osp.policy(osp.table(stage_rule(self.model, name)), meta={**self.meta(name), "baseline": name})


def _layout(model: TandemModel, phase_info: str, routes: RouteSplit | None) -> tuple[Layout, RouteSplit | None]:
    if phase_info not in ("none", "route"):
        raise ValueError(f"phase_info must be 'none' or 'route' here, got {phase_info!r}")
    if phase_info == "none":
        return Layout.build(model, "none"), None
    if routes is None or routes.trivial:
        raise ValueError("phase_info 'route' needs a route split with several routes at some stage "
                         "(scenario stages[].routes)")
    return routes.layout(model), routes


def solve_observed(
    model: TandemModel, *, phase_info: Observed = "none", routes: RouteSplit | None = None,
    truncation: Truncation | None = None, tol: float = 1e-3, baselines: Sequence[str] | None = None,
    heuristic: bool = True, start: int = 10, max_threads: int | None = None, max_states: int = 40_000,
    cap_growth: float | None = None, max_eval_states: int = 1_500_000, starts: int = 3, presearch: bool = False,
    latest_preconditioner: bool = False,
    evaluated: dict[str, Evaluation] | None = None, none_optimum: ObservedOptimum | None = None,
    progress: Progress | None = None, beside: Beside | None = None,
) -> ObservedOptimum:
    """The best deterministic observation policy (module docstring) for ``phase_info`` none or route.

    Parameters
    ----------
    routes
        The route split (``route`` only; stages without routes have one).
    truncation
        A fixed truncation (no auto-truncation): the table is optimised and evaluated on it, and
        the baselines enter as starting tables only.
    tol
        Relative accuracy of every reported E[W] (auto-truncation).
    baselines
        Baselines to start from and to beat (default :func:`observed_baselines`).
    max_threads
        Thread cap of the solve chains (default: none beyond the request cap).
    max_states
        State budget of a solve chain: its thread cap is lowered until the chain fits (the table
        then starts no thread beyond it; the baselines are evaluated without it). The solve cap
        stops growing where the next one would need a lower thread cap (trace: ``settled`` False).
    cap_growth
        Growth factor of the evaluation caps (default 1.5 for ``none`` as for π*, 1.25 for
        ``route``, whose chains grow faster with the cap).
    max_eval_states
        State budget of an evaluation chain; a ladder that would exceed it stops, and the last
        E[W] is reported with ``settled`` False in its trace entry.
    starts
        Local searches at the first solve cap, one from each of the best ``starts`` starting
        tables (the search is local: π(∞) is a local optimum on small caps where a table near
        π(2) is better); the best result is kept. Larger caps run two, from the best two of the
        previous cap's table and the baselines.
    presearch
        A first solve cap of at least :data:`PRESEARCH_STATES` states runs the starts' searches on
        a smaller cap instead, then one search from their best table (module docstring, step 1):
        two to three times faster on the larger route solves, but that one search may end in
        another local optimum, whose E[W] differs by up to about 1e-4 (relative), either way.
    latest_preconditioner
        A large chain's iterative solves are preconditioned by the latest factorization (the
        searched table's, which a trial differs from in some classes) and never given up on
        (:attr:`ExactSolver.follow <overtake.mdp.observation_exact.ExactSolver>`): exact all the
        same, fewer factorizations, but rounding then differs and may break a tie otherwise.
    evaluated
        Baseline evaluations already made (name → :class:`Evaluation`), reused.
    none_optimum
        ``route`` only: the ``none`` optimum already solved for this model (else it is solved).
    beside
        ``beside(fn, *args)`` runs ``fn(*args)`` in another process and returns a handle whose
        ``result()`` waits for it (:func:`overtake.api.beside.start`): the first table's evaluation
        ladder then runs there while the next solve cap is searched here, and each cap's local
        searches run in whichever process is free first (the same table, figures and trace as in
        one process).
    """
    t0 = time.perf_counter()
    layout, routes = _layout(model, phase_info, routes)
    model.check_stable(None if truncation is None else truncation.k_max)
    names = list(baselines) if baselines is not None else observed_baselines(model.n_stages)
    factor = cap_growth or (1.25 if phase_info == "route" else EVALUATION_GROWTH)
    opts = _Options(tol, names, heuristic, max_threads, max_states, max_eval_states, starts, factor, presearch,
                    latest_preconditioner)
    evaluated = dict(evaluated or {})
    none_opt = None
    if phase_info == "route":
        none_opt = none_optimum or _none_first(model, opts, truncation, start, evaluated, progress, beside)
        _log.debug("route: the none optimum first took %.2f s (E[W] %.9g)", time.perf_counter() - t0,
                   none_opt.metrics.mean_response_time)
        evaluated.update(none_opt.baselines)
    search = _Search(model, layout, routes, opts, none_opt, evaluated, progress, t0)
    search.beside = beside
    if truncation is not None:
        return search.fixed(truncation)
    return search.answer(*search.grow(start))


def _none_first(model: TandemModel, opts: _Options, truncation: Truncation | None, start: int,
                evaluated: dict[str, Evaluation], progress: Progress | None, beside: Beside | None) -> ObservedOptimum:
    """The ``none`` optimum a ``route`` solve starts from and is checked against (its default caps)."""
    if progress:
        progress("pi*: the best policy without routes first")
    return solve_observed(model, phase_info="none", truncation=truncation, tol=opts.tol, baselines=opts.names,
                          heuristic=opts.heuristic, start=start, max_threads=opts.max_threads, starts=opts.starts,
                          evaluated=evaluated, progress=progress, beside=beside,
                          latest_preconditioner=opts.latest_preconditioner)
