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
   lightest route (least expected work) started first.
   One local search from each, the best result kept; a larger solve cap starts from the best two
   of the previous cap's table and the baselines.
2. Improve: the weighted-Q step of :meth:`ObservationSpace.propose` in every class; accept it
   only if the exact gain is lower. If not, try the changed classes with the largest first-order
   gains (a quarter of them, a sixteenth, …, one), then single classes in that order; stop when
   no step lowers the exact gain or no class proposes a change. Every step is recorded. The
   starting tables and the trials are screened by their stationary gain alone
   (:meth:`ObservationSpace.stationary_gain`, exact, warm-started from the current law): only
   the starts searched from and the trials not clearly worse are evaluated in full (bias and
   law), and a step is accepted on that full evaluation's gain.
3. Auto-truncation as for π* (:mod:`overtake.mdp.optimum`, :mod:`overtake.mdp.caps`): the table,
   extended beyond its cap by :class:`overtake.mdp.Policy`'s projection, is evaluated exactly on
   request caps C, 1.5C, … until E[W] moves by less than ``tol``; the solve cap grows by 1.25
   (warm start: the previous table) until the re-solved table's E[W] moves by less than ``tol``.
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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .baselines import Baseline
from .caps import EVALUATION_GROWTH, ladder_cap, next_solve_cap, relative_change, settle
from .chain import build_chain
from .errors import TruncationError
from .evaluate import PolicyMetrics, stationary_distribution
from .heuristic import overtaking_heuristic
from .lock import Locks
from .model import TandemModel
from .observation import ExactEvaluation, ObservationSpace, evaluate_observed
from .policy import Policy
from .routes import RouteSplit
from .rule_evaluation import Evaluation, evaluate_baseline
from .statespace import Layout, StateSpace, Truncation, count_states, transitions

__all__ = ["Improvement", "ObservedOptimum", "ObservedSolve", "holds_at_locks", "improve", "observed_baselines",
           "solve_observed"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
Progress = Callable[[str], None]
Observed = Literal["none", "route"]


def observed_baselines(n_stages: int) -> list[str]:
    """The baselines every observation policy is checked against: π(1), π(2), π(4), π(∞), π(1,…,1)."""
    names = ["pi(1)", "pi(2)", "pi(4)", "pi(inf)", "pi(" + ",".join(["1"] * n_stages) + ")"]
    return list(dict.fromkeys(Baseline.parse(n, n_stages).name for n in names))


def holds_at_locks(model: TandemModel, name: str) -> bool:
    """Whether baseline ``name`` never starts a thread into a full lock: its cap at every locked
    stage (π(k): k; π(k1,…,kN): k_i) is at most the lock's capacity, so its table is its rule
    (:mod:`overtake.mdp.observation`); π(∞), Apache's default, blocks threads at the lock."""
    b = Baseline.parse(name, model.n_stages)
    for i, m in enumerate(model.locks or ()):
        cap = b.total if b.per_stage is None else b.per_stage[i]
        if m is not None and (cap is None or cap > m):
            return False
    return True


# ---- starting tables ---------------------------------------------------------------------------
def _stage_rule(model: TandemModel, name: str) -> Callable[[IntArray], IntArray]:
    """A baseline as a rule on ``none`` observation rows (waiting per stage, threads per stage)."""
    b = Baseline.parse(name, model.n_stages)
    lay = Layout.build(model, "start")
    rule = b.rule(lay.queue_stage, model.coord_stage())
    N = model.n_stages

    def on_obs(obs: IntArray) -> IntArray:
        rows = np.zeros((obs.shape[0], N + model.n_coords), dtype=np.int64)
        rows[:, :N] = obs[:, :N]
        for i in range(N):  # baselines read threads per stage only: put them in the first phase
            rows[:, N + model.offsets[i]] = obs[:, N + i]
        return np.asarray(rule(rows), dtype=np.int64)

    return on_obs


def _stage_view(osp: ObservationSpace) -> IntArray:
    """Each class's ``none`` observation: waiting summed over a stage's routes, threads per stage."""
    N, Q = osp.N, osp.Q
    out = np.zeros((osp.n_classes, 2 * N), dtype=np.int64)
    for q in range(Q):
        out[:, osp.layout.queue_stage[q]] += osp.classes[:, q]
    out[:, N:] = osp.classes[:, Q:]
    return out


def _lift(osp: ObservationSpace, per_stage: IntArray) -> IntArray:
    """Per-stage thread counts → per-queue counts, the routes with the least expected work first."""
    model = osp.model
    means = np.concatenate([st.phase_means() for st in model.stages])  # per coordinate
    work = np.array([sum(p * means[d] for d, p in osp.layout.spawn[q]) for q in range(osp.Q)])
    out = np.zeros((osp.n_classes, osp.Q), dtype=np.int64)
    for i in range(osp.N):
        qs = [q for q in np.argsort(work, kind="stable") if osp.layout.queue_stage[q] == i]
        left = per_stage[:, i].copy()
        for q in qs:
            take = np.minimum(osp.classes[:, q], left)
            out[:, q] = take
            left -= take
    return out


def _heuristic_table(osp: ObservationSpace, fallback: IntArray) -> IntArray:
    """The overtaking heuristic restricted to the ``none`` observation (module docstring, step 1)."""
    model = osp.model
    h = overtaking_heuristic(model)
    full = Layout.build(model, "full")
    ch = build_chain(model, full, h.actions, max_requests=osp.cap, max_threads=osp.k_max)
    reach, pi = stationary_distribution(ch.P)
    rows = ch.rows[reach]
    s, pre, rate = transitions(model, full, rows, osp.cap)
    # blocked threads of a locked stage count among its threads (:mod:`overtake.mdp.lock`)
    fold = Locks.build(model, full.n_queues).fold
    rows, pre = fold(rows), fold(pre)
    D, N = model.n_coords, model.n_stages
    cs = model.coord_stage()

    def none_obs(r: IntArray) -> IntArray:
        o = np.zeros((r.shape[0], 2 * N), dtype=np.int64)
        for d in range(D):
            o[:, cs[d]] += r[:, d]
            o[:, N + cs[d]] += r[:, D + d]
        return o

    o_pre = none_obs(pre)
    seen = np.any(o_pre != none_obs(rows)[s], axis=1)  # decision epochs of an observation policy
    act = h.actions(pre[seen], max_threads=osp.k_max)
    per_stage = np.zeros((act.shape[0], N), dtype=np.int64)
    for d in range(D):
        per_stage[:, cs[d]] += act[:, d]
    cls = np.searchsorted(osp.keys, osp.ranker.rank(o_pre[seen]))
    weight = pi[s[seen]] * rate[seen]
    base = osp.cap + 1
    code = cls * base**N + (per_stage * base ** np.arange(N - 1, -1, -1)).sum(axis=1)
    uc, inv = np.unique(code, return_inverse=True)
    tot = np.bincount(inv.ravel(), weights=weight)
    order = np.lexsort((-tot, uc // base**N))  # per class, the heaviest action first
    first = np.ones(order.size, dtype=bool)
    first[1:] = (uc[order][1:] // base**N) != (uc[order][:-1] // base**N)
    win = uc[order][first]
    table = fallback.copy()
    c = win // base**N
    for i in range(N):
        table[c, i] = (win // base ** (N - 1 - i)) % base
    return osp.repair(table)


def _starting_tables(
    osp: ObservationSpace, baselines: Sequence[str], heuristic: bool, extra: dict[str, IntArray]
) -> dict[str, IntArray]:
    out: dict[str, IntArray] = {}
    view = _stage_view(osp)
    routed = osp.layout.phase_info == "route"
    for name in baselines:
        per_stage = _stage_rule(osp.model, name)(view)
        t = _lift(osp, per_stage) if routed else per_stage
        out[name + (" (lightest route first)" if routed else "")] = osp.repair(t)
    if heuristic and not routed:
        best = out[baselines[0]] if baselines else osp.repair(np.zeros((osp.n_classes, osp.Q), np.int64))
        out["heuristic (restricted)"] = _heuristic_table(osp, best)
    out.update({k: osp.repair(v) for k, v in extra.items()})
    return out


# ---- improvement -------------------------------------------------------------------------------
#: a trial whose stationary gain exceeds the current gain by this much (relative) is rejected
#: unevaluated: far above the stationary solve's error (residual 1e-12), far below any step's gain
_SCREEN_MARGIN = 1e-8


@dataclass(eq=False)
class Improvement:
    """Result of :func:`improve`: the table, its exact evaluation and the recorded steps."""

    actions: IntArray
    evaluation: ExactEvaluation
    history: list[dict[str, Any]]
    converged: bool
    evaluations: int

    @property
    def steps(self) -> int:
        return sum(1 for h in self.history if h.get("accepted"))


def improve(
    osp: ObservationSpace,
    actions: IntArray,
    *,
    start: str = "",
    max_iter: int = 200,
    max_singles: int = 4,
    max_evaluations: int = 150,
    min_progress: float = 1e-5,
    window: int = 10,
    evaluation: ExactEvaluation | None = None,
    progress: Progress | None = None,
) -> Improvement:
    """Observation-restricted policy improvement with an exact acceptance test (module docstring, step 2).

    Every accepted step lowers the exact gain on ``osp``'s truncated chain; ``history`` holds one
    entry per iteration: the gain and E[W] after it, the classes proposed, the subset accepted (or
    none) and the exact evaluations it took. The trials of one iteration: every proposed class,
    then the quarter, sixteenth, … with the largest first-order gains, then the single best, then
    ``max_singles`` single classes. The search stops when no trial lowers the gain, when
    ``window`` steps together lowered it by less than ``min_progress`` (relative: late steps move
    single rare classes by 1e-7 each, far below any reported accuracy), or after
    ``max_evaluations`` exact evaluations (``converged`` is then False).
    """
    A = osp.repair(actions)
    ev = evaluation or osp.evaluate(A)
    n_eval = 1 if evaluation is None else 0
    history: list[dict[str, Any]] = [{"iteration": 0, "start": start, "gain": ev.gain,
                                      "mean_response_time": ev.metrics.mean_response_time}]
    converged = False
    for it in range(1, max_iter + 1):
        prop = osp.propose(A, ev)
        diff = np.any(prop.actions != A, axis=1)
        reached = np.flatnonzero(diff & (prop.mass > 0))
        if reached.size == 0:
            converged = True
            history.append({"iteration": it, "proposed": 0, "accepted": None, "stop": "no class proposes a change"})
            break
        order = reached[np.argsort(prop.advantage[reached], kind="stable")]  # largest first-order gain first
        unreached = np.flatnonzero(diff & (prop.mass == 0))
        trials: list[tuple[str, IntArray]] = [("all", np.concatenate([order, unreached]))]
        k = order.size // 4
        while k >= 1:
            trials.append((f"top {k}", order[:k]))
            k //= 4
        if order.size > 1:
            trials.append(("top 1", order[:1]))
        for j in order[1:1 + max_singles]:
            trials.append((f"class {osp.classes[j].tolist()}", np.array([j])))
        trials = list({lab: (lab, sel) for lab, sel in trials}.values())  # "top 1" at most once
        accepted: str | None = None
        tried = 0
        for label, sel in trials:
            B = A.copy()
            B[sel] = prop.actions[sel]
            tried += 1
            # screen: a trial whose stationary gain is clearly worse is rejected without solving
            # for its bias; the others are accepted or not on the full evaluation's gain, as before
            g_screen, _ = osp.stationary_gain(B, start=ev.post)
            if g_screen >= ev.gain + _SCREEN_MARGIN * abs(ev.gain):
                continue
            evB = osp.evaluate(B, near=ev)  # the current factor preconditions the trial's solves
            if evB.gain < ev.gain - 1e-12 * abs(ev.gain):
                accepted = label
                A, ev = B, evB
                break
        n_eval += tried
        history.append({"iteration": it, "proposed": int(order.size), "accepted": accepted,
                        "changed": int(np.any(A != prop.actions, axis=1).sum()) if accepted is None else int(
                            sel.size), "evaluations": tried, "gain": ev.gain,
                        "mean_response_time": ev.metrics.mean_response_time,
                        "first_order_gain": float(prop.advantage[order].sum() * osp.space.rate)})
        if progress:
            progress(f"pi*: observation policy step {it}: {accepted or 'no step improves'}; g = {ev.gain:.8g}")
        if accepted is None:
            converged = True
            history[-1]["stop"] = "no step lowers the exact gain"
            break
        if n_eval >= max_evaluations:
            history[-1]["stop"] = f"{max_evaluations} exact evaluations spent"
            break
        if it >= window and history[-1 - window]["gain"] - ev.gain < min_progress * abs(ev.gain):
            converged = True
            history[-1]["stop"] = f"the last {window} steps lowered the gain by less than {min_progress:g} (relative)"
            break
    return Improvement(A, ev, history, converged, n_eval)


# ---- the solver --------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ObservedSolve:
    """The solve record (the role :class:`overtake.mdp.SolveResult` has for π*).

    ``gain`` is the returned table's exact gain on its solve truncation. ``gain_bounds`` is
    ``(None, gain)``: a memoryless policy of a partially observed chain has no Bellman lower bound.
    """

    space: StateSpace
    gain: float
    gain_bounds: tuple[float | None, float]
    n_iter: int
    sweeps: int
    converged: bool
    seconds: float
    history: list[dict[str, Any]]
    method: str = "observation policy improvement"


@dataclass(eq=False)
class ObservedOptimum:
    """The best observation policy found, as :class:`overtake.mdp.optimum.Optimum` for π*.

    ``source`` is ``"improved"`` (the local search's table), a baseline name, or ``"none"`` (for
    ``route``: the best policy without routes); ``candidates`` the exact E[W] of each; ``baselines``
    their evaluations (reused by :func:`overtake.mdp.compare`).
    """

    policy: Policy
    solve: ObservedSolve
    metrics: PolicyMetrics
    truncation: Truncation
    trace: list[dict[str, Any]]
    seconds: float
    sweeps: int
    source: str
    candidates: dict[str, float]
    baselines: dict[str, Evaluation] = field(default_factory=dict)


def _thread_cap(model: TandemModel, layout: Layout, C: int, max_threads: int | None, budget: int) -> int:
    """The largest thread cap K ≤ C (and ≤ max_threads) whose chain has at most ``budget`` states."""
    K = C if max_threads is None else min(C, max_threads)
    while K > 1 and count_states(model, Truncation(C, K), layout) > budget:
        K -= 1
    return K


def solve_observed(
    model: TandemModel, *, phase_info: Observed = "none", routes: RouteSplit | None = None,
    truncation: Truncation | None = None, tol: float = 1e-3, baselines: Sequence[str] | None = None,
    heuristic: bool = True, start: int = 10, max_threads: int | None = None, max_states: int = 40_000,
    cap_growth: float | None = None, max_eval_states: int = 1_500_000, starts: int = 3,
    evaluated: dict[str, Evaluation] | None = None, none_optimum: ObservedOptimum | None = None,
    progress: Progress | None = None,
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
    evaluated
        Baseline evaluations already made (name → :class:`Evaluation`), reused.
    none_optimum
        ``route`` only: the ``none`` optimum already solved for this model (else it is solved).
    """
    t0 = time.perf_counter()
    if phase_info not in ("none", "route"):
        raise ValueError(f"phase_info must be 'none' or 'route' here, got {phase_info!r}")
    model.check_stable(None if truncation is None else truncation.k_max)
    if phase_info == "route":
        if routes is None or routes.trivial:
            raise ValueError("phase_info 'route' needs a route split with several routes at some stage "
                             "(scenario stages[].routes)")
        layout = routes.layout(model)
    else:
        routes = None
        layout = Layout.build(model, "none")
    names = list(baselines) if baselines is not None else observed_baselines(model.n_stages)
    trace: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    n_steps = 0
    n_evals = 0
    none_opt: ObservedOptimum | None = None
    evaluated = dict(evaluated or {})
    if phase_info == "route" and none_optimum is not None:
        none_opt = none_optimum
        evaluated.update(none_opt.baselines)
    elif phase_info == "route":
        if progress:
            progress("pi*: the best policy without routes first")
        none_opt = solve_observed(model, phase_info="none", truncation=truncation, tol=tol, baselines=names,
                                  heuristic=heuristic, start=start, max_threads=max_threads, starts=starts, evaluated=evaluated,
                                  progress=progress)
        evaluated.update(none_opt.baselines)

    def optimise(tr: Truncation, warm: Policy | None) -> tuple[ObservationSpace, Improvement]:
        nonlocal n_steps, n_evals
        osp = ObservationSpace(model, tr, layout)
        extra: dict[str, IntArray] = {}
        if none_opt is not None:
            extra["none optimum (lightest route first)"] = _lift(osp, none_opt.policy.actions(_stage_view(osp)))
        if warm is not None:  # a larger cap: the previous table (its documented projection) and the baselines
            extra["previous cap"] = warm.actions(osp.classes)
        tables = _starting_tables(osp, names, heuristic and warm is None, extra)
        # the starting tables are ranked by their stationary gains; only those the searches start
        # from are evaluated in full (bias included), the best first: its factor preconditions the rest
        screened = {k: osp.stationary_gain(A)[0] for k, A in tables.items()}
        ranked = sorted(screened, key=lambda k: screened[k])[:starts if warm is None else min(starts, 2)]
        evs: dict[str, ExactEvaluation] = {}
        for k in ranked:
            evs[k] = osp.evaluate(tables[k], near=evs.get(ranked[0]))
        if progress:
            progress(f"pi*: cap {tr.max_requests}, threads {osp.k_max}: {osp.size} states, {osp.n_classes} classes; "
                     f"start from {', '.join(ranked)} (g = {evs[ranked[0]].gain:.8g})")
        runs = {k: improve(osp, tables[k], start=k, evaluation=evs[k], progress=progress) for k in ranked}
        first = min(runs, key=lambda k: runs[k].evaluation.gain)
        imp = runs[first]
        for r in runs.values():
            n_steps += r.steps
            n_evals += r.evaluations
            history.extend({"max_requests": tr.max_requests, **h} for h in r.history)
        n_evals += len(screened) + len(evs)
        trace.append({"max_requests": tr.max_requests, "max_threads": osp.k_max, "states": osp.size,
                      "classes": osp.n_classes, "start": first,
                      "starting_gains": screened,
                      "improved_gains": {k: r.evaluation.gain for k, r in runs.items()}, "steps": imp.steps,
                      "evaluations": sum(r.evaluations for r in runs.values()), "gain": imp.evaluation.gain,
                      "mean_response_time": imp.evaluation.metrics.mean_response_time,
                      "blocking_probability": imp.evaluation.metrics.blocking_probability})
        return osp, imp

    def meta(osp: ObservationSpace, source: str) -> dict[str, Any]:
        seen = "waiting per queue, active threads per stage"
        if model.has_lock:
            seen += "; a locked stage's threads are its lock's holders (none starts while the lock is full)"
        return {"source": source, "observation": seen}

    def record(osp: ObservationSpace, imp: Improvement, m: PolicyMetrics, source: str,
               cands: dict[str, float], base: dict[str, Evaluation], pol: Policy) -> ObservedOptimum:
        solve = ObservedSolve(osp.space, imp.evaluation.gain, (None, imp.evaluation.gain), n_steps, n_evals,
                              imp.converged, time.perf_counter() - t0, history)
        return ObservedOptimum(pol, solve, m, osp.space.trunc, trace, time.perf_counter() - t0, n_steps,
                               source, cands, base)

    factor = cap_growth or (1.25 if phase_info == "route" else EVALUATION_GROWTH)

    def truncation_for(C: int) -> Truncation:
        return Truncation(C, _thread_cap(model, layout, C, max_threads, max_states))

    if truncation is not None:
        tr = Truncation(truncation.max_requests, truncation.max_threads if max_threads is None else
                        min(max_threads, truncation.k_max))
        osp, imp = optimise(tr, None)
        pol = osp.policy(imp.actions, routes=routes, meta=meta(osp, "improved"))
        cands = {"improved": imp.evaluation.metrics.mean_response_time}
        m, source = imp.evaluation.metrics, "improved"
        if none_opt is not None and none_opt.solve.gain < imp.evaluation.gain:
            pol, m, source = none_opt.policy, none_opt.metrics, "none"
            cands["none"] = none_opt.metrics.mean_response_time
        return record(osp, imp, m, source, cands, {}, pol)

    def extended(pol: Policy, C: int, solve_cap: int) -> PolicyMetrics | None:
        if count_states(model, Truncation(C, pol.max_threads), layout) > 4 * max_eval_states:
            return None  # certainly beyond the budget: do not even start the search
        try:
            m = evaluate_observed(model, layout, pol.actions, max_requests=C, max_threads=None,
                                  max_states=max_eval_states)
        except TruncationError:
            return None
        trace.append({"check": "evaluation cap", "solve_cap": solve_cap, "max_requests": C, "states": m.states,
                      "mean_response_time": m.mean_response_time, "blocking_probability": m.blocking_probability})
        return m

    def limit(pol: Policy, C: int, solve_cap: int, first: PolicyMetrics | None = None) -> tuple[PolicyMetrics, int]:
        """E[W] of the extended table on ladder caps from C on, until one step moves it < tol or
        the next chain is beyond the evaluation budget (then the last E[W], recorded as unsettled)."""
        first = first or extended(pol, C, solve_cap)
        if first is None:
            raise TruncationError(f"observation policy: the chain at cap {C} exceeds {max_eval_states} states")

        def step(cap: int, m: PolicyMetrics, change: float) -> None:
            if progress:
                progress(f"pi*: evaluated on cap {cap}: E[W] = {m.mean_response_time:.6g} (change {change:.2e})")

        out = settle(lambda c: extended(pol, c, solve_cap), C, tol=tol, factor=factor, first=first, max_cap=2000,
                     step=step)
        if out.stop == "max_cap":
            raise RuntimeError(f"observation policy: E[W] still changes at max_requests = {out.cap}")
        if out.stop == "budget":
            trace.append({"check": "evaluation cap", "solve_cap": solve_cap, "max_requests": out.refused,
                          "settled": False,
                          "reason": f"the chain exceeds {max_eval_states} states; E[W] of cap {out.cap} reported"})
            if progress:
                progress(f"pi*: cap {out.refused} exceeds {max_eval_states} states: E[W] of cap {out.cap} reported, "
                         "unsettled")
        return out.metrics, out.cap

    tr = truncation_for(start)
    osp, imp = optimise(tr, None)
    pol = osp.policy(imp.actions, routes=routes)
    C0 = tr.max_requests
    lim, Ce = limit(pol, C0, C0, imp.evaluation.metrics)
    while True:  # solve cap: does re-solving on a larger cap change the table's E[W]?
        tr2 = truncation_for(next_solve_cap(tr.max_requests))
        if tr2.k_max < tr.k_max:
            # the larger cap fits the state budget only with fewer threads: keep this table (its
            # E[W] is exact all the same; only its optimality on a larger cap is left unchecked)
            trace.append({"check": "solve cap", "max_requests": tr2.max_requests, "previous": tr.max_requests,
                          "settled": False, "reason": f"needs a thread cap {tr2.k_max} < {tr.k_max} "
                                                      f"to fit {max_states} states"})
            if progress:
                progress(f"pi*: solve cap {tr2.max_requests} would need {tr2.k_max} threads to fit {max_states} "
                         f"states: the cap-{tr.max_requests} table is kept")
            break
        osp2, imp2 = optimise(tr2, pol)
        pol2 = osp2.policy(imp2.actions, routes=routes)
        C = ladder_cap(C0, Ce, tr2.max_requests, factor)
        lim2, Ce2 = limit(pol2, C, tr2.max_requests, imp2.evaluation.metrics if C == tr2.max_requests else None)
        if Ce2 != Ce:  # compare both on one evaluation cap: the larger if it fits the budget
            for cap in (max(Ce, Ce2), min(Ce, Ce2)):
                a1 = lim if cap == Ce else extended(pol, cap, tr.max_requests)
                b1 = lim2 if cap == Ce2 else extended(pol2, cap, tr2.max_requests)
                if a1 is not None and b1 is not None:
                    lim, lim2, Ce = a1, b1, cap
                    break
        change = relative_change(lim2.mean_response_time, lim.mean_response_time)
        trace.append({"check": "solve cap", "max_requests": tr2.max_requests, "previous": tr.max_requests,
                      "evaluation_cap": Ce, "relative_change": change})
        if progress:
            progress(f"pi*: solve cap {tr.max_requests} -> {tr2.max_requests}: E[W] {lim.mean_response_time:.6g} -> "
                     f"{lim2.mean_response_time:.6g} (change {change:.2e}) on evaluation cap {Ce}")
        better = lim2.mean_response_time < lim.mean_response_time
        if better or change >= tol:
            tr, osp, imp, pol, lim = tr2, osp2, imp2, pol2, lim2
        if change < tol:
            break
    pol.meta.update(meta(osp, "improved"), metrics_truncation={"max_requests": Ce, "max_threads": None})
    # The answer: the best of the improved table and the baselines, each exactly evaluated (for
    # route: of the improved table and the none optimum, itself the best of its own and the baselines).
    base: dict[str, Evaluation] = {}
    cands = {"improved": lim.mean_response_time}
    if none_opt is not None:
        base = none_opt.baselines
        cands["none"] = none_opt.metrics.mean_response_time
    else:
        for name in names:
            if name not in evaluated:
                evaluated[name] = evaluate_baseline(model, name, tol=tol, progress=progress)
            base[name] = evaluated[name]
            cands[name] = evaluated[name].metrics.mean_response_time
    source = min(cands, key=lambda k: cands[k])
    m = lim
    if source in base and not holds_at_locks(model, source):
        # its table holds at the lock the requests the rule blocks (module docstring): the sidecar
        # runs that table, so it is weighed by its own exact E[W]
        held = osp.policy(osp.table(_stage_rule(model, source)), meta={**meta(osp, source), "baseline": source})
        m_held, C_held = limit(held, tr.max_requests, tr.max_requests)
        cands[f"{source} held at the lock"] = m_held.mean_response_time
        if m_held.mean_response_time < lim.mean_response_time:
            held.meta.update(metrics_truncation={"max_requests": C_held, "max_threads": None})
            source, m, pol = f"{source} held at the lock", m_held, held
        else:
            source = "improved"
    elif source in base:
        m = base[source].metrics
        # the baseline's table within the cap; meta names it so an enforcer can run the rule itself
        pol = osp.policy(osp.table(_stage_rule(model, source)), meta={**meta(osp, source), "baseline": source})
    elif source == "none":
        assert none_opt is not None
        m, pol = none_opt.metrics, none_opt.policy
        source = "none" if none_opt.source == "improved" else f"none: {none_opt.source}"
    if progress:
        progress(f"pi*: best observation policy: {source}, E[W] = {m.mean_response_time:.6g}")
    return record(osp, imp, m, source, cands, base, pol)

