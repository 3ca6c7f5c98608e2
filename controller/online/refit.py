"""The refit job: fit a PH per stage, re-solve π*, evaluate the running policy under the new model.

Runs in the online loop's worker process (:class:`overtake.controller.online.OnlineLoop`), so
everything it needs travels in one picklable :class:`RefitJob` and the heavy imports
(:mod:`overtake.fitting`, :mod:`overtake.mdp`) happen in the worker. The method is van der Weij et al.'s:
the average-cost MDP of the fitted tandem solved by value iteration
(:func:`overtake.mdp.solve`), compared with the running policy's exact E[W]
(:func:`overtake.mdp.rule_evaluation.evaluate_rule`) on one evaluation cap.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["SOLVER_NICE", "RefitJob", "carry_routes", "lower_priority", "refit_job", "warm_up"]

#: The worker's nice value: refits run on the machine that runs Apache and take only the CPU its
#: threads leave idle (the kernel weighs nice 19 at 15/1024 of nice 0).
SOLVER_NICE = 19

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class RefitJob:
    """Everything the worker process needs (picklable). Times in model units."""

    stage_names: tuple[str, ...]
    samples: tuple[FloatArray, ...]
    arrival_rate: float
    cores: int
    overhead: float
    orders: tuple[int | None, ...]  #: pinned PH order per stage, None = BIC over 1..max_order
    max_order: int
    phase_info: str
    current: str | Any  #: baseline name (e.g. "pi(1)") or the running mdp.Policy
    tolerance: float
    out: str  #: where to write the new policy
    margin: float = 0.01  #: the swap margin (decides when a common evaluation cap is needed)
    seed: int = 0
    time_unit: float = 1.0  #: seconds per model unit of the samples: stored in the policy (controller.sidecar.units)
    #: also choose age-priority thresholds for the refitted model (the sidecar's control file)
    age_thresholds: bool = False
    routes: Any = None  #: the running route policy's mdp.RouteSplit (phase_info "route")
    #: each stage's lock capacity (the stages file's ``lock``), None for none: the model's locks
    locks: tuple[int | None, ...] | None = None
    #: coupled stages: per pair of consecutive stages, the (n, 2) demands of linked transactions
    #: (model units) or None (independent); None: no routing in the model
    pairs: tuple[FloatArray | None, ...] | None = None


def lower_priority() -> None:
    """The worker process's initializer: run at :data:`SOLVER_NICE` (never the sidecar's own process)."""
    os.setpriority(os.PRIO_PROCESS, 0, max(SOLVER_NICE, os.getpriority(os.PRIO_PROCESS, 0)))


def warm_up() -> None:
    """Import fitting and mdp in the worker now, not at the first refit (seconds under load)."""
    from overtake import fitting, mdp  # noqa: F401


def _fit_stage(x: FloatArray, order: int | None, max_order: int, seed: int) -> dict[str, Any]:
    from overtake.fitting import fit

    scv = float(np.var(x) / np.mean(x) ** 2)
    best = None
    tried = []
    for k in ([order] if order else range(1, max_order + 1)):
        structure = "cf1" if k == 1 or scv <= 1 else "hyperexp"
        r = fit(x, structure=structure, order=k, preserve_mean=True, random_state=seed)
        tried.append({"order": k, "structure": structure, "bic": r.bic})
        if best is None or r.bic < best.bic:
            best = r
    assert best is not None
    # phases by mean, as `overtake fit` writes them (phase 1 the shortest): clients' phase headers
    # and the running policy's phase indices keep one meaning across refits
    ordered = best.ph.by_mean()
    a = np.asarray(ordered.alpha, dtype=float)
    T = np.asarray(ordered.T, dtype=float)
    return {"alpha": a, "T": T, "mean": float(best.ph.mean()), "order": int(a.size), "scv": scv,
            "structure": best.structure, "bic": tried, "n": int(x.size)}


def _couple(fits: list[dict[str, Any]], pairs: tuple[FloatArray | None, ...]) -> tuple[list[Any], list[float | None]]:
    """The routing between consecutive fitted stages from linked transactions' demand pairs
    (:func:`overtake.fitting.coupled.fit_routing`, the stages' PHs held), each later stage's alpha
    set to the start law it implies; unpaired stages independent. The pairs are the sidecar's
    attained demands while the marginals may be Apache's CPU notes: each side is rescaled to its
    stage's fitted mean first (the routing is about which phase, not the clock it was timed on)."""
    from overtake.fitting.coupled import fit_routing
    from overtake.fitting.phase_type import PhaseType

    routing: list[Any] = []
    corr: list[float | None] = []
    for i, P in enumerate(pairs):
        a, b = fits[i], fits[i + 1]
        if P is None:
            routing.append(np.tile(b["alpha"], (a["alpha"].size, 1)))
            corr.append(None)
            continue
        x = P[:, 0] * (a["mean"] / P[:, 0].mean())
        y = P[:, 1] * (b["mean"] / P[:, 1].mean())
        cf = fit_routing(PhaseType(a["alpha"], a["T"]), PhaseType(b["alpha"], b["T"]), x, y)
        routing.append(cf.model.routing)
        b["alpha"] = np.asarray(cf.model.second.alpha, dtype=float)  # the start law the routing implies
        corr.append(cf.model.correlation())
    return routing, corr


def carry_routes(routes: Any, old: Any, new: Any) -> Any:
    """The running policy's route classes on the refitted stages.

    Only the stages' samples are refitted, not each route's, so each route keeps what it knew of
    the phases relative to the stage: its likelihood ratio α_r[j]/α[j]. With the new prior α',
    α'_r[j] ∝ α_r[j]·α'[j]/α[j] and the route's share p'_r = p_r Σ_j α_r[j]α'[j]/α[j], so that
    Σ_r p'_r α'_r = α' again (phases are matched by index: both fits order them by mean).
    """
    from overtake.mdp.routes import RouteSplit

    stages = []
    for rs, st_old, st_new in zip(routes.stages, old.stages, new.stages):
        a_old = np.asarray(st_old.alpha, dtype=float)
        a_new = np.asarray(st_new.alpha, dtype=float)
        ratio = np.divide(a_new, a_old, out=np.zeros_like(a_new), where=a_old > 0)
        triples = []
        for r in rs:
            w = np.asarray(r.alpha, dtype=float) * ratio
            mass = float(w.sum())
            triples.append((r.name, float(r.weight) * mass, w / mass if mass > 0 else a_new))
        total = sum(t[1] for t in triples)
        stages.append([(n, p / total, a) for n, p, a in triples])
    return RouteSplit.build(new, stages)


def _grow(evaluate: Callable[[int], Any], start: int, tol: float) -> Any:
    from overtake.mdp.rule_evaluation import grow_requests

    return grow_requests(evaluate, start, tol, "current policy")[0]


def _solve(model: Any, phase_info: str, tol: float, routes: Any) -> tuple[Any, Any, str | None]:
    """π* of ``model``; where the solver takes no lock with this phase information, π* of the
    model without its locks (the refit's model before locks existed), and why."""
    from overtake.mdp import solve
    from overtake.mdp.errors import ModelError

    try:
        return solve(model, phase_info=phase_info, tol=tol, routes=routes), model, None
    except ModelError as exc:
        if not model.has_lock:
            raise
        model = replace(model, locks=None)
        return solve(model, phase_info=phase_info, tol=tol, routes=routes), model, str(exc)


def _fitted_model(job: RefitJob, fits: list[dict[str, Any]], routing: list[Any] | None) -> tuple[Any, Any]:
    """The tandem of the fitted stages (with the fitted routing between them, if any), and for a
    route re-solve the running route split carried over."""
    from overtake.mdp.model import Stage, TandemModel

    locks = job.locks if job.locks is not None and any(m is not None for m in job.locks) else None
    model = TandemModel(job.arrival_rate, tuple(Stage(n, f["alpha"], f["T"]) for n, f in zip(job.stage_names, fits)),
                        cores=job.cores, overhead=job.overhead, locks=locks,
                        routing=None if routing is None else tuple(tuple(map(tuple, R)) for R in routing))
    if job.phase_info != "route":
        return model, None
    if job.routes is None or isinstance(job.current, str):
        raise ValueError("a route re-solve needs the running route policy and its route split")
    return model, carry_routes(job.routes, job.current.model, model)


def _current_policy(job: RefitJob, model: Any, routes: Any, new: Any) -> tuple[Any, Callable[[int], Any]]:
    """The running policy's E[W] under the new model (grown to its own cap), and its evaluation on
    a given cap."""
    from overtake.mdp.baselines import Baseline
    from overtake.mdp.observed_chain import evaluate_observed
    from overtake.mdp.policy import Policy
    from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule
    from overtake.mdp.statespace import Layout

    if isinstance(job.current, str):
        b = Baseline.parse(job.current, model.n_stages)
        lay = Layout.build(model, "start")
        rule = b.rule(lay.queue_stage, model.coord_stage())

        def ev(C: int) -> Any:
            return evaluate_rule(model, lay, rule, max_requests=C, max_threads=b.max_threads)

        return evaluate_baseline(model, job.current, tol=job.tolerance).metrics, ev
    old: Policy = job.current
    if tuple(s.phases for s in old.model.stages) != tuple(s.phases for s in model.stages):
        raise ValueError("the running policy's phase counts differ from the refitted model's")
    lay = routes.layout(model) if routes is not None else Layout.build(model, old.phase_info)

    def ev_old(C: int) -> Any:
        if old.observed:  # a table over counts: its own chain (mdp.observation)
            return evaluate_observed(model, lay, old.actions, max_requests=C, max_threads=None)
        return evaluate_rule(model, lay, old.actions, max_requests=C, max_threads=old.max_threads)

    return _grow(ev_old, max(new.max_requests, old.max_requests), job.tolerance), ev_old


def _on_one_cap(job: RefitJob, model: Any, routes: Any, opt: Any, cur: Any, ev: Callable[[int], Any]) -> tuple[Any, Any]:
    """Each E[W] is within tol of its limit on its own cap. Where that could decide the swap, both
    evaluated on one cap, the larger (their truncation residues then largely cancel): (current, new)."""
    from overtake.mdp.observed_chain import evaluate_observed
    from overtake.mdp.rule_evaluation import evaluate_rule
    from overtake.mdp.statespace import Layout

    new = opt.metrics
    C = max(cur.max_requests, new.max_requests)
    if cur.mean_response_time >= new.mean_response_time * (1.0 + job.margin + 2.0 * job.tolerance):
        return cur, new
    if cur.max_requests < C:
        cur = ev(C)
    if new.max_requests < C:
        lay_new = (routes.layout(model) if routes is not None
                   else Layout.build(model, job.phase_info))  # type: ignore[arg-type]
        new = (evaluate_observed(model, lay_new, opt.policy.actions, max_requests=C, max_threads=None)
               if opt.policy.observed else
               evaluate_rule(model, lay_new, opt.policy.actions, max_requests=C, max_threads=opt.truncation.k_max))
    return cur, new


def _age_thresholds(model: Any) -> dict[str, Any]:
    """The policy file's ``cpu_priority`` entry: one common set of age thresholds, as the solve's
    age priority chooses it (the module applies one row); a locked stage is exempt there (never
    demoted: the sidecar sends its requests exempt)."""
    from overtake.mdp.thresholds import choose_tandem_thresholds

    thr = choose_tandem_thresholds(model, common=True)
    return {"age": {"thresholds": [list(r) for r in thr.priority.thresholds],
                    "visit_model_mean_response_time": thr.mean_response_time}}


def refit_job(job: RefitJob) -> dict[str, Any]:
    """Fit, solve π*, evaluate the current policy under the new model; write π* to ``job.out``.

    Runs in the worker process. Returns the fitted stages, both predicted E[W] (model units, on a
    common evaluation cap) and timings."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    fits = [_fit_stage(np.asarray(x, dtype=float), o, job.max_order, job.seed)
            for x, o in zip(job.samples, job.orders)]
    t_fit = time.perf_counter() - t0
    routing, corr = _couple(fits, job.pairs) if job.pairs is not None else (None, None)
    model, routes = _fitted_model(job, fits, routing)
    opt, model, lock_ignored = _solve(model, job.phase_info, job.tolerance, routes)
    t_solve = time.perf_counter() - t0 - t_fit
    cur_name = job.current if isinstance(job.current, str) else str(job.current.meta.get("hash", job.current.digest()))
    new, cur_w, cur_error = _current_against_new(job, model, routes, opt)
    t_eval = time.perf_counter() - t0 - t_fit - t_solve
    pol = opt.policy
    pol.meta.update(
        metrics=new.to_dict(), method=opt.solve.method, gain_bounds=list(opt.solve.gain_bounds),
        time_unit=job.time_unit,
        online={"arrival_rate": job.arrival_rate, "samples": [f["n"] for f in fits],
                "current": cur_name, "current_mean_response_time": cur_w},
    )
    t_thr = time.perf_counter()
    if job.age_thresholds:
        pol.meta["cpu_priority"] = _age_thresholds(model)
    t_thr = time.perf_counter() - t_thr
    pol.save(job.out)
    seconds = {"fit": t_fit, "solve": t_solve, "evaluate": t_eval, "thresholds": t_thr, "total": time.perf_counter() - t0}
    return {
        **_summary(job, fits, model, opt, new, (cur_name, cur_w, cur_error)),
        "seconds": seconds,
        # CPU (user + system) of this process for the whole job: what the refit took from Apache
        "cpu_seconds": time.process_time() - c0,
        "kind": job.phase_info,
        "locks": list(model.locks) if model.locks is not None else None,
        "lock_ignored": lock_ignored,
        "routing": None if routing is None else [np.asarray(R).tolist() for R in routing],
        "routing_correlation": corr,
        "pid": os.getpid(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }


def _current_against_new(job: RefitJob, model: Any, routes: Any, opt: Any) -> tuple[Any, float, str | None]:
    """π*'s metrics and the current policy's E[W] under the new model, on one evaluation cap, and
    why the current one could not be evaluated (None when it was)."""
    new = opt.metrics
    try:
        cur, ev = _current_policy(job, model, routes, new)
        cur, new = _on_one_cap(job, model, routes, opt, cur, ev)
        return new, float(cur.mean_response_time), None
    except Exception as exc:  # unstable or unevaluable under the new model: any stable π* is better
        return new, math.inf, f"{type(exc).__name__}: {exc}"


def _summary(job: RefitJob, fits: list[dict[str, Any]], model: Any, opt: Any, new: Any,
             current: tuple[str, float, str | None]) -> dict[str, Any]:
    """The refit's result about the new model and both policies: the fitted stages, the load, both
    predicted E[W] on the common evaluation cap (the current one's name and error), π*'s
    truncation, hash and file."""
    pol = opt.policy
    cur_name, cur_w, cur_error = current
    return {
        "stages": [{"name": n, "mean": f["mean"], "order": f["order"], "scv": f["scv"], "structure": f["structure"],
                    "bic": f["bic"], "n": f["n"], "alpha": f["alpha"].tolist(), "T": f["T"].tolist()}
                   for n, f in zip(job.stage_names, fits)],
        "arrival_rate": job.arrival_rate,
        "load": job.arrival_rate * model.mean_service() / job.cores,
        # the new policy's age thresholds (model units), None without: the loop compares them with the running one's
        "age_thresholds": (pol.meta.get("cpu_priority") or {}).get("age", {}).get("thresholds"),
        "predicted_new": float(new.mean_response_time),
        "predicted_current": cur_w,
        "current": cur_name,
        "current_error": cur_error,
        "evaluation_cap": int(new.max_requests),
        "states": int(opt.solve.space.size),
        "truncation": [opt.truncation.max_requests, opt.truncation.k_max],
        "hash": pol.digest(),
        "path": job.out,
    }
