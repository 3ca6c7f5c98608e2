"""The average-cost MDP as an occupation-measure linear programme.

The MDP is van der Weij et al.'s ("Dynamic thread assignment", §2); the programme is Puterman's
(*Markov Decision Processes*, §8.8) and Altman's (*Constrained Markov Decision Processes*, ch. 4).

The spawn decision at a pre-decision state y is a box of actions (start any number of threads from
each queue). Enumerating the box per state makes the LP explode, so the decision is written as the
chain of *instantaneous single-thread spawns* that :meth:`overtake.mdp.bellman.ActionIndex.spawn_minimum`
already uses: at every node v (a state of the truncated space) the controller either stops — v is
then the post-decision state held until the next event — or starts one thread from a queue q and
decides again at the neighbour. Its optimality equation H(y) = min(V(y), min_q Σ_j α_qj H(y_qj)) is
the box minimum of §2, so the LP is exact, with at most S·(1 + Q) variables:

    z(x) ≥ 0      stationary probability of post-decision state x (never an idle state: bellman.py)
    u(v, q) ≥ 0   frequency, per uniformized event, of starting one thread from queue q at node v

    balance at every node v:  Σ_x z(x) P_E(x, v) + Σ_(y,q) p(y, q → v) u(y, q) = z(v) + Σ_q u(v, q)
    Σ_x z(x) = 1,           minimise  Σ_x n(x) z(x) = E[N]  (= λ_eff·E[W], Little)

plus any linear constraints Σ_x d(x) z(x) ≤ D (constrained MDP; the set of achievable z is the same
as for randomised box policies, since flows on the acyclic spawn graph decompose into box choices
and back). A solution is read as a randomised policy on nodes: at v, stop or spawn from q with
probability proportional to z(v) and u(v, q). Nodes without flow take the action of least reduced
cost (greedy against the dual values). Every policy is then evaluated exactly
(:func:`overtake.mdp.evaluate.stationary_distribution` on P_E·R): at its default tolerances HiGHS
can return an objective below the optimum with a worse policy, so tolerances are 1e-10 and the
exact figures — not the LP objective — are what callers report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .errors import SolverError
from .evaluate import PolicyMetrics, metrics, stationary_distribution
from .statespace import StateSpace

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: HiGHS options: interior point then crossover to a basic (hence minimally randomised) solution,
#: at 1e-10 tolerances. Dual simplex alone is slower, the more so the larger the space.
HIGHS_OPTIONS: dict[str, Any] = {
    "solver": "ipm",
    "run_crossover": "on",
    "primal_feasibility_tolerance": 1e-10,
    "dual_feasibility_tolerance": 1e-10,
}

#: Routing probabilities below this (relative to the node's flow) are solver noise and dropped.
_NOISE = 1e-9


@dataclass(frozen=True)
class LinearConstraint:
    """Σ_x coeff(x)·π(x) ≤ rhs over the stationary law π of post-decision states."""

    name: str
    coeff: FloatArray
    rhs: float


@dataclass(frozen=True, eq=False)
class NodePolicy:
    """A (possibly randomised) spawn policy on the nodes of a state space.

    ``stop[v]`` is the probability of stopping at node v; ``spawn[v, q]`` that of starting one
    thread from queue q there and deciding again. Rows sum to 1.
    """

    space: StateSpace
    stop: FloatArray
    spawn: FloatArray

    @property
    def randomised_nodes(self) -> IntArray:
        """Nodes where more than one action has positive probability."""
        k = (self.stop > 0).astype(int) + (self.spawn > 0).sum(axis=1)
        return np.flatnonzero(k > 1)

    def outcome_matrix(self) -> sp.csr_matrix:
        """R(y, x): probability that the spawn chain started at pre-decision y stops at x."""
        sp_ = self.space
        S = sp_.size
        rows, cols, vals = [], [], []
        for q in range(sp_.Q):
            sel = np.flatnonzero(self.spawn[:, q] > 0)
            for nb, p in sp_.spawn_neighbours[q]:
                if np.any(nb[sel] < 0):
                    raise SolverError("a node policy starts a thread where none can start")
                rows.append(sel)
                cols.append(nb[sel])
                vals.append(self.spawn[sel, q] * p)
        B = sp.csr_matrix(
            (np.concatenate(vals) if vals else np.zeros(0),
             (np.concatenate(rows) if rows else np.zeros(0, np.int64),
              np.concatenate(cols) if cols else np.zeros(0, np.int64))),
            shape=(S, S),
        )
        Sd = sp.diags(self.stop).tocsr()
        R = Sd
        # each spawn raises the thread count, so B is nilpotent: R = Σ_t B^t·Sd after ≤ K_max + 1 terms
        for _ in range(sp_.k_max + 1):
            R_next = (Sd + B @ R).tocsr()
            R_next.eliminate_zeros()
            if R_next.nnz == R.nnz and abs(R_next - R).max() == 0:
                break
            R = R_next
        return R

    def transition_matrix(self) -> sp.csr_matrix:
        """P = P_E·R: the uniformized chain of post-decision states under this policy."""
        return (self.space.event_matrix @ self.outcome_matrix()).tocsr()

    def deterministic_decision(self) -> IntArray:
        """The most likely action as a decision array in :mod:`overtake.mdp.average_cost`'s format.

        Phase-known layout: the post-decision state reached (most likely outcome of R's row);
        phase-at-start layout: the queue to spawn from first, −1 for none.
        """
        sp_ = self.space
        if sp_.layout.deterministic:
            R = self.outcome_matrix().tocsr()
            dec = np.arange(sp_.size, dtype=np.int64)
            for y in range(sp_.size):
                a, b = R.indptr[y], R.indptr[y + 1]
                if b > a:
                    dec[y] = R.indices[a + int(np.argmax(R.data[a:b]))]
            return dec
        probs = np.column_stack([self.stop, self.spawn])
        best: IntArray = np.argmax(probs, axis=1).astype(np.int64) - 1
        return best

    def evaluate(self) -> tuple[PolicyMetrics, FloatArray]:
        """Exact stationary metrics (and the stationary law on all S states) of this policy."""
        sp_ = self.space
        reach, pi = stationary_distribution(self.transition_matrix())
        full = np.zeros(sp_.size)
        full[reach] = pi
        m = metrics(sp_.model, sp_.rows[reach], sp_.layout.queue_stage, pi, sp_.cap)
        return m, full


@dataclass(frozen=True, eq=False)
class LPResult:
    """Solution of the occupation-measure LP on one truncated space.

    ``objective`` is the LP's E[N]; ``metrics`` the exact evaluation of ``policy`` (use these);
    ``shadow_prices[name]`` = −∂E[N]/∂rhs ≥ 0 for each constraint (0 when slack).
    """

    space: StateSpace
    objective: float
    z: FloatArray
    policy: NodePolicy
    metrics: PolicyMetrics
    stationary: FloatArray
    shadow_prices: dict[str, float]
    constraint_values: dict[str, float]
    status: str
    variables: int
    build_seconds: float
    solve_seconds: float
    eval_seconds: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def exact_gain(self) -> float:
        """E[N] of the returned policy from its exact stationary law."""
        return self.metrics.mean_in_system


class InfeasibleError(SolverError):
    """The constraints cannot all be met on this truncation."""


def cost_rate(space: StateSpace) -> FloatArray:
    """The per-state cost rate value iteration minimises: ``space.cost`` (requests in the system,
    plus the truncation's blocking charge) where the state space defines it, else n(x)."""
    c = getattr(space, "cost", None)
    return np.asarray(space.n_total if c is None else c, dtype=np.float64)


def _spawn_columns(space: StateSpace) -> tuple[IntArray, IntArray, sp.csr_matrix]:
    """(node, queue) of every single-spawn variable and its inflow matrix (S × U)."""
    nodes, queues = [], []
    for q in range(space.Q):
        nb0, _ = space.spawn_neighbours[q][0]
        v = np.flatnonzero(nb0 >= 0)
        nodes.append(v)
        queues.append(np.full(v.size, q, dtype=np.int64))
    node = np.concatenate(nodes)
    queue = np.concatenate(queues)
    U = node.size
    r, c, d = [], [], []
    start = 0
    for q in range(space.Q):
        n_q = nodes[q].size
        cols = np.arange(start, start + n_q)
        for nb, p in space.spawn_neighbours[q]:
            r.append(nb[nodes[q]])
            c.append(cols)
            d.append(np.full(n_q, p))
        start += n_q
    inflow = sp.csr_matrix((np.concatenate(d), (np.concatenate(r), np.concatenate(c))), shape=(space.size, U))
    return node, queue, inflow


def occupation_lp(
    space: StateSpace,
    constraints: Sequence[LinearConstraint] = (),
    *,
    cost: FloatArray | None = None,
    solver_options: dict[str, Any] | None = None,
) -> LPResult:
    """Solve min E[cost] over (randomised) spawn policies subject to ``constraints``; cvxpy + HiGHS.

    ``cost`` defaults to the cost rate value iteration minimises (:func:`cost_rate`).
    """
    import cvxpy as cp

    t0 = time.perf_counter()
    S = space.size
    c = cost_rate(space) if cost is None else np.asarray(cost, dtype=float)
    zs, node, queue, A = _balance_system(space)
    nz, U = zs.size, node.size
    x = cp.Variable(nz + U, nonneg=True)
    z = x[:nz]
    balance = A @ x == 0
    norm = cp.sum(z) == 1
    extra = _constraint_rows(constraints, S, zs, z)
    prob = cp.Problem(cp.Minimize(c[zs] @ z), [balance, norm, *extra])
    t1 = time.perf_counter()
    _solve(prob, S, solver_options)
    t2 = time.perf_counter()
    xv = np.clip(np.asarray(x.value, dtype=float), 0.0, None)
    zfull = np.zeros(S)
    zfull[zs] = xv[:nz]
    mus = [float(np.asarray(k.dual_value).ravel()[0]) for k in extra]
    best = _reduced_costs(np.concatenate([c[zs], np.zeros(U)]), zs, A, balance, norm, constraints, mus)
    policy = _node_policy(space, zs, zfull, node, queue, xv[nz:], best)
    t3 = time.perf_counter()
    m, stat = policy.evaluate()
    t4 = time.perf_counter()
    values = {lc.name: float(np.asarray(lc.coeff) @ stat) for lc in constraints}
    return LPResult(
        space=space, objective=float(prob.value), z=zfull, policy=policy, metrics=m, stationary=stat,
        shadow_prices={lc.name: abs(mu) for lc, mu in zip(constraints, mus)},
        constraint_values=values, status=str(prob.status), variables=nz + U,
        build_seconds=t1 - t0, solve_seconds=t2 - t1, eval_seconds=t4 - t3,
        info={"rows": int(A.shape[0]) + 1 + len(constraints), "nnz": int(A.nnz), "reduced_cost_min": float(best.min())},
    )


def _balance_system(space: StateSpace) -> tuple[IntArray, IntArray, IntArray, sp.csr_matrix]:
    """The LP's balance equations (P_Eᵀ − I)·z + (inflow − outflow)·u = 0 as one matrix over the
    columns (z over the states where stopping is allowed, then u): returns (those states, each
    spawn column's node and queue, the matrix). Idle states with requests take no z column:
    stopping is not allowed there (the module docstring)."""
    S = space.size
    idle = (space.threads == 0) & (space.n_total > 0)
    zs = np.flatnonzero(~idle)  # states where stopping is allowed
    nz = zs.size
    node, queue, inflow = _spawn_columns(space)
    U = node.size
    E = sp.csr_matrix((np.ones(nz), (zs, np.arange(nz))), shape=(S, nz))
    PE = space.event_matrix
    out_u = sp.csr_matrix((np.ones(U), (node, np.arange(U))), shape=(S, U))
    A = sp.hstack([(PE.T @ E - E), inflow - out_u]).tocsr()
    return zs, node, queue, A


def _constraint_rows(constraints: Sequence[LinearConstraint], S: int, zs: IntArray, z: Any) -> list[Any]:
    """The caller's linear constraints on z as cvxpy constraints, each coefficient vector checked
    to cover every state (a wrong length would silently constrain the wrong states)."""
    rows = []
    for lc in constraints:
        coeff = np.asarray(lc.coeff, dtype=float)
        if coeff.shape != (S,):
            raise ValueError(f"constraint {lc.name}: coefficient vector must have {S} entries")
        rows.append(coeff[zs] @ z <= lc.rhs)
    return rows


def _solve(prob: Any, S: int, solver_options: dict[str, Any] | None) -> None:
    """Run HiGHS at :data:`HIGHS_OPTIONS` (overridden by ``solver_options``); anything but an
    optimum is an error naming what went wrong."""
    import cvxpy as cp

    opts = dict(HIGHS_OPTIONS)
    opts.update(solver_options or {})
    try:
        prob.solve(solver=cp.HIGHS, highs_options=opts)
    except cp.error.SolverError as exc:
        raise SolverError(f"the LP solver failed on {S} states: {exc}") from None
    if prob.status in ("infeasible", "infeasible_inaccurate"):
        raise InfeasibleError(f"the constraints cannot be met on this truncation ({S} states)")
    if prob.status != "optimal":
        raise SolverError(f"the LP solver returned status {prob.status!r} on {S} states")


def _reduced_costs(obj_cols: FloatArray, zs: IntArray, A: sp.csr_matrix, balance: Any, norm: Any,
                   constraints: Sequence[LinearConstraint], mus: list[float]) -> FloatArray:
    """Reduced costs r = c − Aᵀy of every column at the optimum, for the nodes without flow to
    choose by. The sign of cvxpy's duals is not fixed: the one that gives r ≥ 0 (as at an optimum)
    is taken, read as the larger least entry."""
    nz = zs.size
    y_bal = np.asarray(balance.dual_value, dtype=float).ravel()
    y_norm = float(np.asarray(norm.dual_value).ravel()[0])
    lag = obj_cols.copy()
    for lc, mu in zip(constraints, mus):
        lag[:nz] += abs(mu) * np.asarray(lc.coeff, dtype=float)[zs]
    best: FloatArray | None = None
    for sgn in (1.0, -1.0):
        red = lag + sgn * (A.T @ y_bal)
        red[:nz] += sgn * y_norm
        if best is None or red.min() > best.min():
            best = red
    assert best is not None
    return best


def _node_policy(
    space: StateSpace, zs: IntArray, z: FloatArray, node: IntArray, queue: IntArray, u: FloatArray,
    reduced: FloatArray,
) -> NodePolicy:
    S, Q = space.size, space.Q
    flow = np.zeros((S, Q + 1))
    flow[:, 0] = z
    np.add.at(flow, (node, queue + 1), u)
    through = flow.sum(axis=1)
    visited = through > 0
    probs = np.zeros_like(flow)
    probs[visited] = flow[visited] / through[visited, None]
    probs[probs < _NOISE] = 0.0
    # nodes without flow: the action of least reduced cost (greedy against the dual values)
    rc = np.full((S, Q + 1), np.inf)
    rc[zs, 0] = reduced[: zs.size]
    rc[node, queue + 1] = reduced[zs.size:]
    fill = ~visited | (probs.sum(axis=1) == 0)
    pick = np.argmin(rc[fill], axis=1)
    probs[fill] = 0.0
    probs[np.flatnonzero(fill), pick] = 1.0
    probs /= probs.sum(axis=1, keepdims=True)
    return NodePolicy(space, probs[:, 0].copy(), probs[:, 1:].copy())


def threads_constraint(space: StateSpace, max_mean_threads: float) -> LinearConstraint:
    """E[active threads] ≤ T̄ (a memory budget)."""
    return LinearConstraint("max_mean_threads", space.threads.astype(float), float(max_mean_threads))


def stage_sojourn_constraint(space: StateSpace, stage: int, target: float) -> LinearConstraint:
    """Mean sojourn at ``stage`` ≤ target, by Little: E[N_i] ≤ target·λ·(1 − P_block).

    Linear in π because P_block = π(blocked states); exact for the truncated model's metrics.
    """
    lam = space.model.arrival_rate
    n_i = space.requests_per_stage()[:, stage].astype(float)
    coeff = n_i - target * lam * (1.0 - space.blocked.astype(float))
    name = f"stage_sla:{space.model.stages[stage].name}"
    return LinearConstraint(name, coeff, 0.0)
