"""``compare``: π* against the baselines on one scenario (van der Weij et al., "Dynamic thread assignment", §4.1, Table 1).

Gain of π* over a policy π: (E W(π) − E W(π*)) / E W(π*), as a fraction. With ``phase_info``
``none`` or ``route``, π* is the best policy that sees counts only (and routes),
:func:`overtake.mdp.observed.solve_observed`, never worse than a baseline by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .baselines import Baseline
from .errors import ModelError
from .evaluate import PolicyMetrics
from .model import TandemModel
from .optimum import Optimum, solve_mdp
from .routes import RouteSplit
from .rule_evaluation import evaluate_baseline, evaluate_rule
from .statespace import Layout, PhaseInfo, Truncation

if TYPE_CHECKING:
    from .observed import ObservedOptimum

Progress = Callable[[str], None]


def default_baselines(n_stages: int) -> list[str]:
    """π(1), π(4), π(∞) and the all-ones per-stage cap (π(1,1) for two stages)."""
    ones = "pi(" + ",".join(["1"] * n_stages) + ")"
    names = ["pi(1)", "pi(4)", "pi(inf)", ones]
    out: list[str] = []
    for n in names:
        b = Baseline.parse(n, n_stages).name
        if b not in out:
            out.append(b)
    return out


def _on_common_cap(
    model: TandemModel, opt: Optimum, name: str, star: PolicyMetrics, base: PolicyMetrics
) -> tuple[PolicyMetrics, PolicyMetrics]:
    C = max(star.max_requests, base.max_requests)
    layout = Layout.build(model, opt.policy.phase_info)
    if star.max_requests < C:
        star = evaluate_rule(model, layout, opt.policy.actions, max_requests=C, max_threads=opt.truncation.k_max)
    if base.max_requests < C:
        b = Baseline.parse(name, model.n_stages)
        lay = Layout.build(model, "start")
        base = evaluate_rule(model, lay, b.rule(lay.queue_stage, model.coord_stage()), max_requests=C,
                             max_threads=b.max_threads)
    return star, base


def compare(
    model: TandemModel,
    *,
    policies: Sequence[str] = (),
    phase_info_start: bool = False,
    tol: float = 1e-3,
    truncation: Truncation | None = None,
    progress: Progress | None = None,
    optimum: Optimum | ObservedOptimum | None = None,
    phase_info: PhaseInfo = "full",
    routes: RouteSplit | None = None,
    method: str = "anderson",
    max_states: int | None = None,
) -> dict[str, Any]:
    """Solve π* and evaluate the baselines; returns the JSON document of ``overtake compare``.

    ``method`` is π*'s average-cost solver (:func:`overtake.mdp.solver.solve`): "anderson"
    (default; BENCHMARKS.md ``cli-table1``), "rvi" or "pi".

    ``max_states`` bounds π*'s auto-truncation ladder (:func:`overtake.mdp.optimum.solve_mdp`).

    ``phase_info`` ``none`` or ``route`` (with ``routes``): π* is the best observation policy,
    and the document gains an ``observation`` entry (where π* came from, the candidates' E[W]
    and the improvement steps).
    """
    t0 = time.perf_counter()
    if model.coupled and phase_info in ("none", "route"):
        raise ModelError(f"routing: coupled stages are compared with phase_info full or start (the observation "
                         f"solves draw each stage's start phase independently); got phase_info {phase_info!r}")
    names = _baseline_names(model, policies)
    # observed.py (scipy's iterative solvers, the heuristic's kernels) only when it is used
    if phase_info in ("none", "route") or (optimum is not None and not isinstance(optimum, Optimum)):
        return _compare_observed(model, names, phase_info, routes, tol, truncation, progress, optimum, t0)
    opt = optimum or solve_mdp(model, truncation=truncation, tol=tol, method=method, progress=progress,
                               max_states=max_states)
    out: dict[str, Any] = {"policies": {"pi*": opt.metrics.to_dict()}}
    start_opt = None
    if phase_info_start:
        start_opt = solve_mdp(model, phase_info="start", truncation=truncation, tol=tol, method=method,
                              progress=progress, max_states=max_states)
        out["policies"]["pi*(phase at start)"] = start_opt.metrics.to_dict()
    star = _add_baselines(out["policies"], model, opt, names, tol, truncation, progress)
    out["policies"]["pi*"] = star.to_dict()
    _summary(out, model, opt, star.mean_response_time)
    if start_opt is not None:
        out["phase_at_start"] = {"states": start_opt.solve.space.size, "iterations": start_opt.sweeps,
                                 "truncation": {"max_requests": start_opt.truncation.max_requests,
                                                "max_threads": start_opt.truncation.k_max}}
    out["seconds"] = time.perf_counter() - t0
    return out


def _baseline_names(model: TandemModel, policies: Sequence[str]) -> list[str]:
    """The default baselines, then the caller's (each checked against the stage count) not among them."""
    names = default_baselines(model.n_stages)
    for p in policies:
        b = Baseline.parse(p, model.n_stages).name
        if b not in names:
            names.append(b)
    return names


def _add_baselines(table: dict[str, Any], model: TandemModel, opt: Optimum, names: list[str], tol: float,
                   truncation: Truncation | None, progress: Progress | None) -> PolicyMetrics:
    """Evaluate each baseline into ``table``; returns π*'s metrics, moved to a common cap with any
    baseline that seems to beat it."""
    star = opt.metrics
    for name in names:
        ev = evaluate_baseline(model, name, tol=tol, progress=progress)
        base = ev.metrics
        if truncation is None and base.mean_response_time < star.mean_response_time:
            # Both are within tol of their limits, but on different caps; where a baseline is the
            # optimum (exponential stages: π* = π(1)) the caps' residues decide the sign. Compare
            # the two on one cap, the larger of theirs.
            star, base = _on_common_cap(model, opt, name, star, base)
        table[ev.name] = base.to_dict()
    return star


def _compare_observed(
    model: TandemModel, names: list[str], phase_info: str, routes: RouteSplit | None, tol: float,
    truncation: Truncation | None, progress: Progress | None, optimum: Optimum | ObservedOptimum | None, t0: float,
) -> dict[str, Any]:
    """The document of :func:`compare` with π* the best observation policy (it reuses its baselines)."""
    from .observed import ObservedOptimum, observed_baselines, solve_observed

    if optimum is not None and not isinstance(optimum, ObservedOptimum):
        raise ValueError("compare: an optimum for phase_info 'none'/'route' must come from solve_observed")
    opt = optimum or solve_observed(model, phase_info=phase_info, routes=routes, truncation=truncation,  # type: ignore[arg-type]
                                    tol=tol, baselines=list(dict.fromkeys([*observed_baselines(model.n_stages), *names])),
                                    progress=progress)
    out: dict[str, Any] = {"policies": {"pi*": opt.metrics.to_dict()}}
    for name in names:
        ev = opt.baselines.get(name) or evaluate_baseline(model, name, tol=tol, progress=progress)
        out["policies"][ev.name] = ev.metrics.to_dict()
    ew_star = opt.metrics.mean_response_time
    _summary(out, model, opt, ew_star)
    out["observation"] = {"phase_info": phase_info if phase_info in ("none", "route") else opt.policy.phase_info,
                          "policy_phase_info": opt.policy.phase_info, "source": opt.source,
                          "candidates": opt.candidates, "history": opt.solve.history}
    out["seconds"] = time.perf_counter() - t0
    return out


def _summary(out: dict[str, Any], model: TandemModel, opt: Any, ew_star: float) -> None:
    """The document's fields after the policies: gains over π*, load, π*'s solve and truncation."""
    out["gains"] = {
        k: (v["mean_response_time"] - ew_star) / ew_star for k, v in out["policies"].items() if k != "pi*"
    }
    out["arrival_rate"] = model.arrival_rate
    out["load"] = model.arrival_rate * model.mean_service()
    out["states"] = opt.solve.space.size
    out["iterations"] = opt.sweeps
    out["method"] = opt.solve.method
    out["gain_bounds"] = list(opt.solve.gain_bounds)
    out["truncation"] = {"max_requests": opt.truncation.max_requests, "max_threads": opt.truncation.k_max,
                         "trace": opt.trace}
