"""Optimal thread-spawn policies for the N-stage two-layered tandem.

The model and the MDP are van der Weij, Bhulai and van der Mei's ("Dynamic thread assignment in
web server performance optimization"). Pure library: no file I/O beyond the policy artifact's
save/load, no environment reads. The entry to the solvers is :func:`solve`
(:mod:`overtake.mdp.solver`).

The names below are imported from their modules on first use (PEP 562), so ``import
overtake.mdp.errors`` — the CLI's start, the sidecar's — does not pay for numba, scipy's solvers
and cvxpy. No name is also a module's name, so importing a module never hides a function.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .average_cost import SolveResult
    from .baselines import Baseline
    from .comparison import compare, default_baselines
    from .constrained import ConstrainedOptimum, ConstraintError, Constraints, RandomizedPolicy, solve_constrained
    from .errors import MDPError, ModelError, OvertakeError, PolicyFileError, SolverError, TruncationError
    from .evaluate import PolicyMetrics, stationary_distribution
    from .heuristic import OvertakingHeuristic, evaluate_heuristic, overtaking_heuristic
    from .layout import Layout
    from .lp import LinearConstraint, LPResult, NodePolicy, occupation_lp
    from .model import Stage, TandemModel
    from .observation import ObservationSpace
    from .observed import ObservedOptimum
    from .optimum import Optimum
    from .policy import Policy
    from .priority import CpuPriority, age_priority, class_priority, level_weights
    from .priority_classes import ClassChoice
    from .priority_prediction import PriorityPrediction, predict_priority
    from .routes import Route, RouteSplit
    from .rule_evaluation import Evaluation, evaluate_baseline
    from .rules import OvertakingRules, overtaking_rule
    from .scenario import Scenario, parse_scenario
    from .simulation import SimulationResult, service_from_spec, simulate
    from .solver import solve
    from .statespace import StateSpace, Truncation, count_states
    from .sweep import SweepPoint, parse_grid, run_sweep
    from .thresholds import choose_tandem_thresholds, choose_thresholds

__all__ = [
    "Baseline",
    "ClassChoice",
    "ConstrainedOptimum",
    "ConstraintError",
    "Constraints",
    "CpuPriority",
    "Evaluation",
    "LPResult",
    "Layout",
    "LinearConstraint",
    "MDPError",
    "ModelError",
    "NodePolicy",
    "ObservationSpace",
    "ObservedOptimum",
    "Optimum",
    "OvertakeError",
    "OvertakingHeuristic",
    "OvertakingRules",
    "Policy",
    "PolicyFileError",
    "PolicyMetrics",
    "PriorityPrediction",
    "RandomizedPolicy",
    "Route",
    "RouteSplit",
    "Scenario",
    "SimulationResult",
    "SolveResult",
    "SolverError",
    "Stage",
    "StateSpace",
    "SweepPoint",
    "TandemModel",
    "Truncation",
    "TruncationError",
    "age_priority",
    "choose_tandem_thresholds",
    "choose_thresholds",
    "class_priority",
    "compare",
    "count_states",
    "default_baselines",
    "evaluate_baseline",
    "evaluate_heuristic",
    "level_weights",
    "occupation_lp",
    "overtaking_heuristic",
    "overtaking_rule",
    "parse_grid",
    "parse_scenario",
    "predict_priority",
    "run_sweep",
    "service_from_spec",
    "simulate",
    "solve",
    "solve_constrained",
    "stationary_distribution",
]

#: the module of each name in ``__all__``
_HOME: dict[str, str] = {
    "Baseline": "baselines",
    "ClassChoice": "priority_classes",
    "ConstrainedOptimum": "constrained",
    "ConstraintError": "constrained",
    "Constraints": "constrained",
    "CpuPriority": "priority",
    "Evaluation": "rule_evaluation",
    "LPResult": "lp",
    "Layout": "layout",
    "LinearConstraint": "lp",
    "MDPError": "errors",
    "ModelError": "errors",
    "NodePolicy": "lp",
    "ObservationSpace": "observation",
    "ObservedOptimum": "observed",
    "Optimum": "optimum",
    "OvertakeError": "errors",
    "OvertakingHeuristic": "heuristic",
    "OvertakingRules": "rules",
    "Policy": "policy",
    "PolicyFileError": "errors",
    "PolicyMetrics": "evaluate",
    "PriorityPrediction": "priority_prediction",
    "RandomizedPolicy": "constrained",
    "Route": "routes",
    "RouteSplit": "routes",
    "Scenario": "scenario",
    "SimulationResult": "simulation",
    "SolveResult": "average_cost",
    "SolverError": "errors",
    "Stage": "model",
    "StateSpace": "statespace",
    "SweepPoint": "sweep",
    "TandemModel": "model",
    "Truncation": "statespace",
    "TruncationError": "errors",
    "age_priority": "priority",
    "choose_tandem_thresholds": "thresholds",
    "choose_thresholds": "thresholds",
    "class_priority": "priority",
    "compare": "comparison",
    "count_states": "statespace",
    "default_baselines": "comparison",
    "evaluate_baseline": "rule_evaluation",
    "evaluate_heuristic": "heuristic",
    "level_weights": "priority",
    "occupation_lp": "lp",
    "overtaking_heuristic": "heuristic",
    "overtaking_rule": "rules",
    "parse_grid": "sweep",
    "parse_scenario": "scenario",
    "predict_priority": "priority_prediction",
    "run_sweep": "sweep",
    "service_from_spec": "simulation",
    "simulate": "simulation",
    "solve": "solver",
    "solve_constrained": "constrained",
    "stationary_distribution": "evaluate",
}


def __getattr__(name: str) -> Any:
    mod = _HOME.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
