"""Constrained thread policies: minimise E[N] subject to a thread budget and per-stage SLAs.

Value iteration cannot impose E[active threads] ≤ T̄ (a memory budget) or a mean sojourn target at
one stage; the occupation-measure LP (:mod:`overtake.mdp.lp`, Altman 1999, ch. 4) can:

* ``max_mean_threads``:  Σ_x π(x) K(x) ≤ T̄;
* ``stage_sla[name]``:   E[sojourn at stage i] ≤ target, i.e. (Little) E[N_i] ≤ target·λ·(1 − P_block).

The optimum may randomise — with m constraints, in at most m decision nodes of a basic solution
(Altman, Thm 3.8). The shadow price μ of a constraint is the LP dual: E[cost] falls by μ per unit
of extra budget (per thread of T̄; per request of allowed E[N_i], i.e. μ·λ_eff per second of target).

The policy artifact (:class:`overtake.mdp.policy.Policy`) is deterministic; it holds the most likely action
and ``meta["randomization"]`` lists the states whose action is random with the distribution of
the spawn vector (phase-known layout) or of the next queue to start from (phase-at-start layout).
:class:`RandomizedPolicy` draws from it; a controller needs only that table and the artifact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .caps import next_evaluation_cap, relative_change
from .errors import ModelError, TruncationError
from .lp import InfeasibleError, LinearConstraint, LPResult, occupation_lp, stage_sojourn_constraint, threads_constraint
from .model import TandemModel
from .policy import Policy
from .statespace import PhaseInfo, StateSpace, Truncation, count_states

IntArray = npt.NDArray[np.int64]
Progress = Callable[[str], None]

#: Auto-truncation refuses LPs above this many states (the LP bench's practical limit).
MAX_LP_STATES = 40_000


class ConstraintError(ModelError):
    """A constraint is malformed or cannot be met; the message names the option and the fix."""


@dataclass(frozen=True)
class Constraints:
    """The constraints of a constrained solve (``None``/empty = not imposed)."""

    max_mean_threads: float | None = None
    stage_sla: dict[str, float] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.max_mean_threads is None and not self.stage_sla

    @staticmethod
    def parse(model: TandemModel, max_mean_threads: float | None = None, stage_sla: Sequence[str] = ()) -> Constraints:
        """Validate CLI-style input: ``max_mean_threads`` > 0, ``stage_sla`` items ``NAME=SECONDS``."""
        if max_mean_threads is not None:
            t = float(max_mean_threads)
            if not math.isfinite(t) or t <= 0:
                raise ConstraintError(f"--max-mean-threads must be a number > 0, got {max_mean_threads!r}")
        names = [s.name for s in model.stages]
        sla: dict[str, float] = {}
        for item in stage_sla:
            name, sep, val = str(item).partition("=")
            name = name.strip()
            if not sep or not name:
                raise ConstraintError(f"--stage-sla {item!r}: write STAGE=SECONDS, e.g. {names[-1]}=3.0")
            if name not in names:
                raise ConstraintError(
                    f"--stage-sla {item!r}: unknown stage {name!r}; the scenario's stages are {', '.join(names)}"
                )
            try:
                target = float(val)
            except ValueError:
                raise ConstraintError(f"--stage-sla {item!r}: {val!r} is not a number of seconds") from None
            if not math.isfinite(target) or target <= 0:
                raise ConstraintError(f"--stage-sla {item!r}: the target mean sojourn must be > 0 seconds")
            if name in sla:
                raise ConstraintError(f"--stage-sla: stage {name!r} is given twice; give one target per stage")
            sla[name] = target
        return Constraints(None if max_mean_threads is None else float(max_mean_threads), sla)

    def linear(self, space: StateSpace) -> list[LinearConstraint]:
        out = []
        if self.max_mean_threads is not None:
            out.append(threads_constraint(space, self.max_mean_threads))
        names = [s.name for s in space.model.stages]
        for name, target in self.stage_sla.items():
            out.append(stage_sojourn_constraint(space, names.index(name), target))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"max_mean_threads": self.max_mean_threads, "stage_sla": dict(self.stage_sla)}


@dataclass
class ConstrainedOptimum:
    """A constrained optimum with its exact metrics, the unconstrained LP optimum on the same
    truncation, the artifact and the auto-truncation trace."""

    constraints: Constraints
    lp: LPResult
    unconstrained: LPResult
    truncation: Truncation
    policy: Policy
    trace: list[dict[str, Any]]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        m = self.lp.metrics
        u = self.unconstrained.metrics
        return {
            "constraints": self.constraints.to_dict(),
            "mean_response_time": m.mean_response_time,
            "mean_in_system": m.mean_in_system,
            "mean_threads": m.mean_threads,
            "stage_sojourn": dict(zip([s.name for s in self.lp.space.model.stages], m.stage_sojourn)),
            "blocking_probability": m.blocking_probability,
            "unconstrained": {"mean_response_time": u.mean_response_time, "mean_threads": u.mean_threads,
                              "stage_sojourn": list(u.stage_sojourn)},
            "shadow_prices": self.lp.shadow_prices,
            "lp_objective": self.lp.objective,
            "lp_objective_unconstrained": self.unconstrained.objective,
            "randomised_nodes": int(self.lp.policy.randomised_nodes.size),
            "randomised_states": len(self.policy.meta.get("randomization", {}).get("states", [])),
            "states": self.lp.space.size,
            "lp_variables": self.lp.variables,
            "truncation": {"max_requests": self.truncation.max_requests, "max_threads": self.truncation.k_max},
            "seconds": self.seconds,
        }


def randomization_table(lp: LPResult) -> dict[str, Any]:
    """The states whose action is random, in the artifact's state-vector convention."""
    space = lp.space
    pol = lp.policy
    Q = space.Q
    if space.layout.deterministic:
        R = pol.outcome_matrix().tocsr()
        counts = np.diff(R.indptr)
        states = []
        for y in np.flatnonzero(counts > 1):
            a, b = R.indptr[y], R.indptr[y + 1]
            acts = [{"spawn": (space.rows[y, :Q] - space.rows[R.indices[t], :Q]).tolist(), "prob": float(R.data[t])}
                    for t in range(a, b)]
            acts.sort(key=lambda d: -d["prob"])
            states.append({"state": space.rows[y].tolist(), "actions": acts})
        semantics = "start the threads of one action, drawn with the given probabilities"
    else:
        states = []
        for y in pol.randomised_nodes:
            acts = [{"spawn": [0] * Q, "prob": float(pol.stop[y])}] if pol.stop[y] > 0 else []
            for q in range(Q):
                if pol.spawn[y, q] > 0:
                    v = [0] * Q
                    v[q] = 1
                    acts.append({"spawn": v, "prob": float(pol.spawn[y, q])})
            acts.sort(key=lambda d: -d["prob"])
            states.append({"state": space.rows[y].tolist(), "actions": acts})
        semantics = "start at most one thread, drawn with the given probabilities; ask again after it starts"
    nodes = [{"state": space.rows[v].tolist(), "stop": float(pol.stop[v]),
              "spawn": [float(x) for x in pol.spawn[v]]} for v in pol.randomised_nodes]
    return {"semantics": semantics, "states": states, "nodes": nodes}


class RandomizedPolicy:
    """A policy artifact plus its randomisation table: :meth:`action` draws where the optimum mixes."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        table = policy.meta.get("randomization", {}).get("states", [])
        self._table: dict[tuple[int, ...], tuple[IntArray, npt.NDArray[np.float64]]] = {}
        for item in table:
            acts = np.asarray([a["spawn"] for a in item["actions"]], dtype=np.int64)
            probs = np.asarray([a["prob"] for a in item["actions"]], dtype=float)
            self._table[tuple(int(x) for x in item["state"])] = (acts, probs / probs.sum())

    @property
    def randomised_states(self) -> int:
        return len(self._table)

    def distribution(self, state: npt.ArrayLike) -> list[tuple[IntArray, float]]:
        """All actions at ``state`` with their probabilities (one action, prob 1, where deterministic)."""
        key = tuple(int(x) for x in np.asarray(state).ravel())
        if key in self._table:
            acts, probs = self._table[key]
            return [(a.copy(), float(p)) for a, p in zip(acts, probs)]
        return [(self.policy.action(state), 1.0)]

    def action(self, state: npt.ArrayLike, rng: np.random.Generator) -> IntArray:
        key = tuple(int(x) for x in np.asarray(state).ravel())
        if key in self._table:
            acts, probs = self._table[key]
            chosen: IntArray = acts[int(rng.choice(probs.size, p=probs))].copy()
            return chosen
        return self.policy.action(state)


def _explain_infeasible(space: StateSpace, constraints: Constraints) -> str:
    """One line naming the constraint that cannot be met and the best value any policy reaches."""
    lam = space.model.arrival_rate
    if constraints.max_mean_threads is not None:
        best = occupation_lp(space, cost=space.threads.astype(float))
        if best.metrics.mean_threads > constraints.max_mean_threads * (1 + 1e-9):
            return (f"--max-mean-threads {constraints.max_mean_threads:g}: no policy keeps fewer than "
                    f"{best.metrics.mean_threads:.4g} threads active on average at this load; raise it")
    names = [s.name for s in space.model.stages]
    per_stage = space.requests_per_stage()
    for name, target in constraints.stage_sla.items():
        i = names.index(name)
        best = occupation_lp(space, cost=per_stage[:, i].astype(float))
        soj = best.metrics.stage_sojourn[i]
        if soj > target * (1 + 1e-9):
            return (f"--stage-sla {name}={target:g}: no policy brings the mean sojourn at {name} below "
                    f"{soj:.4g} s at this load (arrival rate {lam:.4g}); raise the target")
    return "the constraints can each be met but not together; relax --max-mean-threads or --stage-sla"


def solve_constrained_on(space: StateSpace, constraints: Constraints) -> tuple[LPResult, LPResult]:
    """(constrained, unconstrained) LP optima on one truncated space."""
    try:
        lp = occupation_lp(space, constraints.linear(space))
    except InfeasibleError:
        raise ConstraintError(_explain_infeasible(space, constraints)) from None
    free = occupation_lp(space)
    return lp, free


def _artifact(lp: LPResult, constraints: Constraints) -> Policy:
    pol = Policy.from_decision(lp.space, lp.policy.deterministic_decision())
    pol.meta.update(
        method="lp", constraints=constraints.to_dict(), shadow_prices=lp.shadow_prices,
        metrics=lp.metrics.to_dict(), randomization=randomization_table(lp),
    )
    return pol


def solve_constrained(
    model: TandemModel,
    constraints: Constraints,
    *,
    phase_info: PhaseInfo = "full",
    truncation: Truncation | None = None,
    tol: float = 1e-3,
    start: Truncation | None = None,
    max_states: int = MAX_LP_STATES,
    progress: Progress | None = None,
) -> ConstrainedOptimum:
    """Constrained optimum; fixed ``truncation`` or grown like :func:`overtake.mdp.optimum.solve_mdp`.

    Auto-truncation: one more thread is allowed while it lowers the objective by ≥ ``tol``
    (relative); the request cap grows ×1.5 until E[W] changes by < ``tol``.
    """
    t0 = time.perf_counter()
    if constraints.empty:
        raise ConstraintError("give --max-mean-threads and/or --stage-sla for a constrained solve")
    runs = _LPRuns(model, constraints, phase_info, max_states, progress)
    if truncation is not None:
        lp, free = runs.run(truncation)
        tr = truncation
    else:
        model.check_stable(None)
        tr, lp, free = runs.grow(start or Truncation(10, min(3 + model.cores - 1, 10)), tol)
    pol = _artifact(lp, constraints)
    return ConstrainedOptimum(constraints, lp, free, tr, pol, runs.trace, time.perf_counter() - t0)


class _LPRuns:
    """The constrained LP solved on one truncation after another, each recorded in the trace."""

    def __init__(self, model: TandemModel, constraints: Constraints, phase_info: PhaseInfo, max_states: int,
                 progress: Progress | None) -> None:
        self.model, self.constraints, self.phase_info = model, constraints, phase_info
        self.max_states, self.progress = max_states, progress
        self.trace: list[dict[str, Any]] = []

    def run(self, tr: Truncation) -> tuple[LPResult, LPResult]:
        """The constrained and the free LP on ``tr``; refused beyond ``max_states`` (an LP that size
        would not finish)."""
        n = count_states(self.model, tr, self.phase_info)
        if n > self.max_states:
            raise TruncationError(
                f"the constrained LP needs more than {self.max_states} states (cap {tr.max_requests}, "
                f"{tr.k_max} threads: {n}); set truncation: {{max_requests, max_threads}} in the "
                "scenario or raise tolerance"
            )
        space = StateSpace(self.model, tr, self.phase_info)
        lp, free = solve_constrained_on(space, self.constraints)
        self.trace.append({"max_requests": tr.max_requests, "max_threads": tr.k_max, "states": space.size,
                           "objective": lp.objective, "mean_response_time": lp.metrics.mean_response_time,
                           "blocking_probability": lp.metrics.blocking_probability,
                           "lp_seconds": lp.solve_seconds + free.solve_seconds})
        if self.progress:
            self.progress(f"constrained LP: cap {tr.max_requests}, threads {tr.k_max}: {space.size} states, "
                          f"E[W] = {lp.metrics.mean_response_time:.6g} ({lp.solve_seconds:.1f} s)")
        return lp, free

    def grow(self, tr: Truncation, tol: float) -> tuple[Truncation, LPResult, LPResult]:
        """Auto-truncation from ``tr``: one more thread while it lowers the objective by ``tol`` or
        more (relative), then the request cap grows until E[W] changes by less than ``tol``."""
        lp, free = self.run(tr)
        while True:
            trK = Truncation(tr.max_requests, tr.k_max + 1)
            if trK.k_max > tr.k_max:
                lpK, freeK = self.run(trK)
                if lp.objective - lpK.objective >= tol * lp.objective:
                    tr, lp, free = trK, lpK, freeK
                    continue
            tr2 = Truncation(next_evaluation_cap(tr.max_requests), tr.k_max)
            lp2, free2 = self.run(tr2)
            change = relative_change(lp2.metrics.mean_response_time, lp.metrics.mean_response_time)
            tr, lp, free = tr2, lp2, free2
            if change < tol:
                return tr, lp, free
