"""What an observation-policy solve (:mod:`overtake.mdp.observed`) returns, and the baselines it
checks its answer against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .baselines import Baseline
from .evaluate import PolicyMetrics
from .model import TandemModel
from .policy import Policy
from .rule_evaluation import Evaluation
from .statespace import StateSpace, Truncation

__all__ = ["ObservedOptimum", "ObservedSolve", "holds_at_locks", "observed_baselines"]


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
