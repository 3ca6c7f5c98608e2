"""Optimal thread-spawn policies for the N-stage two-layered tandem (paper 004).

Pure library: no file I/O beyond the policy artifact's save/load, no environment reads.
"""

from .baselines import Baseline
from .compare import compare, default_baselines
from .constrained import ConstrainedOptimum, ConstraintError, Constraints, RandomizedPolicy, solve_constrained
from .errors import MDPError, ModelError, OvertakeError, PolicyFileError, SolverError, TruncationError
from .evaluate import PolicyMetrics, stationary_distribution
from .heuristic import OvertakingHeuristic, evaluate_heuristic, overtaking_heuristic
from .lp import LinearConstraint, LPResult, NodePolicy, occupation_lp
from .model import Stage, TandemModel
from .policy import Policy
from .priority import (
    CpuPriority,
    age_priority,
    choose_tandem_thresholds,
    choose_thresholds,
    class_priority,
    level_weights,
)
from .rules import OvertakingRules, overtaking_rule
from .scenario import Scenario, parse_scenario
from .simulate import SimulationResult, service_from_spec, simulate
from .solve import SolveResult, policy_iteration, relative_value_iteration, solve
from .statespace import Layout, StateSpace, Truncation, count_states
from .sweep import SweepPoint, parse_grid, run_sweep
from .truncation import Evaluation, Optimum, evaluate_baseline, solve_optimal

__all__ = sorted([
    "Baseline", "Evaluation", "Layout", "MDPError", "ModelError", "Optimum", "OvertakeError",
    "OvertakingRules", "Policy", "PolicyFileError", "PolicyMetrics", "Scenario", "SolveResult",
    "SolverError", "Stage", "StateSpace", "TandemModel", "Truncation", "TruncationError",
    "compare", "count_states", "default_baselines", "evaluate_baseline", "overtaking_rule",
    "parse_scenario", "policy_iteration", "relative_value_iteration", "solve", "solve_optimal",
    "stationary_distribution",
    "OvertakingHeuristic", "SimulationResult", "evaluate_heuristic", "overtaking_heuristic",
    "service_from_spec", "simulate",
    "ConstrainedOptimum", "ConstraintError", "Constraints", "LPResult", "LinearConstraint", "NodePolicy",
    "RandomizedPolicy", "SweepPoint", "occupation_lp", "parse_grid", "run_sweep", "solve_constrained",
    "CpuPriority", "age_priority", "choose_tandem_thresholds", "choose_thresholds", "class_priority",
    "level_weights",
])
