"""Optimal thread-spawn policies for the N-stage two-layered tandem (paper 004).

Pure library: no file I/O beyond the policy artifact's save/load, no environment reads.

The names below are imported from their modules on first use (PEP 562), so ``import
overtake.mdp.errors`` — the CLI's start, the sidecar's — does not pay for numba, scipy's solvers
and cvxpy. Three names are also module names (``compare``, ``simulate``, ``solve``): the package
attribute stays the function even after its module is imported.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .baselines import Baseline
    from .compare import compare, default_baselines
    from .constrained import ConstrainedOptimum, ConstraintError, Constraints, RandomizedPolicy, solve_constrained
    from .errors import MDPError, ModelError, OvertakeError, PolicyFileError, SolverError, TruncationError
    from .evaluate import PolicyMetrics, stationary_distribution
    from .heuristic import OvertakingHeuristic, evaluate_heuristic, overtaking_heuristic
    from .lever import LeverPrediction, predict_lever
    from .lp import LinearConstraint, LPResult, NodePolicy, occupation_lp
    from .model import Stage, TandemModel
    from .observation import ObservationSpace
    from .observed import ObservedOptimum, solve_observed
    from .policy import Policy
    from .priority import (
        CpuPriority,
        age_priority,
        choose_tandem_thresholds,
        choose_thresholds,
        class_priority,
        level_weights,
    )
    from .routes import Route, RouteSplit
    from .rules import OvertakingRules, overtaking_rule
    from .scenario import Scenario, parse_scenario
    from .simulate import SimulationResult, service_from_spec, simulate
    from .solve import SolveResult, policy_iteration, relative_value_iteration, solve
    from .statespace import Layout, StateSpace, Truncation, count_states
    from .sweep import SweepPoint, parse_grid, run_sweep
    from .truncation import Evaluation, Optimum, evaluate_baseline, solve_optimal

_MODULES: dict[str, tuple[str, ...]] = {
    "baselines": ("Baseline",),
    "compare": ("compare", "default_baselines"),
    "constrained": ("ConstrainedOptimum", "ConstraintError", "Constraints", "RandomizedPolicy", "solve_constrained"),
    "errors": ("MDPError", "ModelError", "OvertakeError", "PolicyFileError", "SolverError", "TruncationError"),
    "evaluate": ("PolicyMetrics", "stationary_distribution"),
    "heuristic": ("OvertakingHeuristic", "evaluate_heuristic", "overtaking_heuristic"),
    "lever": ("LeverPrediction", "predict_lever"),
    "lp": ("LPResult", "LinearConstraint", "NodePolicy", "occupation_lp"),
    "model": ("Stage", "TandemModel"),
    "observation": ("ObservationSpace",),
    "observed": ("ObservedOptimum", "solve_observed"),
    "policy": ("Policy",),
    "priority": (
        "CpuPriority", "age_priority", "choose_tandem_thresholds", "choose_thresholds", "class_priority", "level_weights",
    ),
    "routes": ("Route", "RouteSplit"),
    "rules": ("OvertakingRules", "overtaking_rule"),
    "scenario": ("Scenario", "parse_scenario"),
    "simulate": ("SimulationResult", "service_from_spec", "simulate"),
    "solve": ("SolveResult", "policy_iteration", "relative_value_iteration", "solve"),
    "statespace": ("Layout", "StateSpace", "Truncation", "count_states"),
    "sweep": ("SweepPoint", "parse_grid", "run_sweep"),
    "truncation": ("Evaluation", "Optimum", "evaluate_baseline", "solve_optimal"),
}
_HOME = {name: mod for mod, names in _MODULES.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    mod = _HOME.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Importing submodule ``solve`` sets package attribute ``solve``; keep the function there."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _HOME.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
