"""Average-cost solvers for the tandem MDP on one truncated space (van der Weij et al., "Dynamic thread assignment", §2;
Puterman, *Markov Decision Processes*, §8.5 and §8.6).

The uniformized chain (rate Λ) has per-step cost c(x)/Λ with c(x) = requests in the system. The
optimality equation on post-decision states is

    g/Λ + V(x) = c(x)/Λ + Σ_y P_E(x, y) · H(y),      H(y) = min over spawn actions (bellman.py)

* :func:`relative_value_iteration` — V_{n+1} = T V_n − (T V_n)(0); stops when
  span(T V_n − V_n) < tol·g, and brackets g by Λ·min(TV − V) ≤ g ≤ Λ·max(TV − V) (Odoni bounds).
* :func:`anderson_rvi` — the same RVI map V ↦ TV − (TV)(0) with Anderson acceleration (Walker and
  Ni 2011, "Anderson acceleration for fixed-point iterations", type II): each step mixes the last
  ``memory`` iterates by a small least-squares problem, which on a fixed policy is GMRES on the
  evaluation equations. Same stopping rule and Odoni bounds as RVI, so the bracket is as rigorous;
  it needs far fewer sweeps on the slowly mixing chains of long phases (BENCHMARKS.md ``mdp-peer``).
* :func:`policy_iteration` — Howard's algorithm: evaluate the policy exactly by one sparse solve of
  (I − P_π) h + g/Λ·1 = c/Λ with h(0) = 0, improve greedily (keeping the current action on ties),
  repeat until the policy is stable; then one Bellman step on h gives the same bounds as RVI.
  Exact, and a handful of policies suffice on Table 1, but each evaluation is a linear solve on a
  lattice of Q + D dimensions, where a complete LU fills in badly and an incomplete one is costly
  to factor: on large spaces it is the slowest of the three (BENCHMARKS.md ``mdp-peer``).

:func:`solve_space` dispatches on ``method`` ("anderson", default, "rvi" or "pi").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .anderson import AndersonMixer, StallRestart
from .bellman import KERNEL_MIN_STATES, ActionIndex
from .csr_product import kernel
from .errors import SolverError
from .evaluate import sparse_solver
from .statespace import StateSpace

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Progress = Callable[[str], None]


@dataclass(frozen=True, eq=False)
class SolveResult:
    """Outcome of an average-cost solve on one truncated state space.

    ``decision`` is, per pre-decision state, the post-decision state index (phase-known layout)
    or the queue to start a thread from next, −1 for none (phase-at-start layout).
    ``gain`` is g = average number in system (time-average cost rate) of the returned policy;
    ``gain_bounds`` bracket the optimal g of the truncated model.
    """

    space: StateSpace
    decision: IntArray
    gain: float
    gain_bounds: tuple[float, float]
    bias: FloatArray
    n_iter: int
    sweeps: int
    method: str
    converged: bool
    seconds: float
    history: list[float] = field(default_factory=list)

    @property
    def span_residual(self) -> float:
        return self.gain_bounds[1] - self.gain_bounds[0]


def _minimize(ai: ActionIndex, V: FloatArray, rtol: float = 0.0) -> tuple[FloatArray, IntArray]:
    if ai.space.layout.deterministic:
        return ai.box_minimum(V, rtol)
    return ai.spawn_minimum(V, rtol)


def decision_matrix(space: StateSpace, decision: IntArray) -> sp.csr_matrix:
    """R(y, x) = probability that the decision rule takes pre-decision y to post-decision x."""
    S = space.size
    if space.layout.deterministic:
        return sp.csr_matrix((np.ones(S), (np.arange(S), decision)), shape=(S, S))
    stop = decision < 0
    rows, cols, vals = [], [], []
    for q in range(space.layout.n_actions):
        sel = np.flatnonzero(decision == q)
        for nb, p in space.spawn_neighbours[q]:
            if np.any(nb[sel] < 0):
                raise SolverError("decision starts a thread where none can start")
            rows.append(sel)
            cols.append(nb[sel])
            vals.append(np.full(sel.size, p))
    B = sp.csr_matrix(
        (np.concatenate(vals) if vals else np.zeros(0),
         (np.concatenate(rows) if rows else np.zeros(0, int), np.concatenate(cols) if cols else np.zeros(0, int))),
        shape=(S, S),
    )
    Sd = sp.diags(stop.astype(float)).tocsr()
    R = Sd
    # B raises the thread count, so B^(K_max+1) = 0 and R = Σ_t B^t S is exact after K_max steps.
    for _ in range(space.k_max + 1):
        R_next = (Sd + B @ R).tocsr()
        if R_next.nnz == R.nnz and abs(R_next - R).max() == 0:
            break
        R = R_next
    return R


def induced_matrix(space: StateSpace, decision: IntArray) -> sp.csr_matrix:
    """P_π = P_E · R: the uniformized chain on post-decision states under the decision rule."""
    PE = space.event_matrix
    if space.layout.deterministic:
        P = sp.csr_matrix((PE.data.copy(), decision[PE.indices], PE.indptr.copy()), shape=PE.shape)
        P.sum_duplicates()
        return P
    return (PE @ decision_matrix(space, decision)).tocsr()


def evaluate_bias(space: StateSpace, P: sp.csr_matrix, cost: FloatArray) -> tuple[float, FloatArray]:
    """Solve (I − P)h + γ·1 = cost with h(0) = 0; returns (γ, h). Unichain P required."""
    gamma, h, _ = _evaluate_bias(space, P, cost)
    return gamma, h


def _evaluate_bias(
    space: StateSpace, P: sp.csr_matrix, cost: FloatArray, warm: tuple[FloatArray, FloatArray] | None = None
) -> tuple[float, FloatArray, tuple[FloatArray, FloatArray]]:
    """:func:`evaluate_bias` also returning (u, v) below, and starting the iterative solve from
    ``warm``, the previous policy's (u, v) (policy iteration changes few decisions a step)."""
    # With h(0) = 0 the other equations give h = u − γ·v, (I − P)₋₀ u = cost₋₀, (I − P)₋₀ v = 1;
    # row 0 then fixes γ. Two right-hand sides, one factorisation, no dense column.
    S = space.size
    A = (sp.identity(S, format="csr") - P).tocsr()
    solve = sparse_solver(A[1:, 1:].tocsc())
    uv = (solve(cost[1:], None if warm is None else warm[0]), solve(np.ones(S - 1), None if warm is None else warm[1]))
    p0 = P[0, 1:].toarray().ravel()
    gamma = (cost[0] + p0 @ uv[0]) / (1.0 + p0 @ uv[1])
    h = np.concatenate([[0.0], uv[0] - gamma * uv[1]])
    return float(gamma), h, uv


def bellman_bounds(space: StateSpace, ai: ActionIndex, V: FloatArray) -> tuple[float, float, FloatArray]:
    """Λ·min and Λ·max of (TV − V): lower and upper bounds on the optimal average cost."""
    cost = space.cost / space.rate
    H, _ = _minimize(ai, V)
    TV = cost + space.event_matrix @ H
    d = TV - V
    return float(d.min() * space.rate), float(d.max() * space.rate), TV


def relative_value_iteration(
    space: StateSpace,
    *,
    tol: float = 1e-6,
    max_iter: int = 200_000,
    V0: FloatArray | None = None,
    progress: Progress | None = None,
) -> SolveResult:
    """Relative value iteration, stopping when span(TV − V) ≤ tol · g."""
    t0 = time.perf_counter()
    ai = ActionIndex(space)
    cost = space.cost / space.rate
    PE = space.event_matrix
    V = np.zeros(space.size) if V0 is None else np.array(V0, dtype=np.float64)
    lo = hi = 0.0
    converged = False
    it = 0
    if space.layout.deterministic and space.size >= KERNEL_MIN_STATES:
        from . import _kernels

        # compiled fused sweeps, in chunks so progress can be reported between them
        order, nb = ai.box_order
        idle = ai.idle
        chunk = 250
        while it < max_iter and not converged:
            n, lo, hi, converged = _kernels.rvi_sweeps(
                PE.indptr, PE.indices, PE.data, cost, V, idle, order, nb, min(chunk, max_iter - it), tol
            )
            it += n
            if progress and not converged:
                progress(f"rvi sweep {it}: g in [{lo * space.rate:.6g}, {hi * space.rate:.6g}]")
    else:
        for it in range(1, max_iter + 1):
            H, _ = _minimize(ai, V)
            TV = cost + PE @ H
            d = TV - V
            lo, hi = float(d.min()), float(d.max())
            V = TV - TV[0]
            if hi - lo <= tol * max(abs(hi), 1e-12):
                converged = True
                break
            if progress and it % 500 == 0:
                progress(f"rvi sweep {it}: g in [{lo * space.rate:.6g}, {hi * space.rate:.6g}]")
    _, decision = _minimize(ai, V)
    res_gain = 0.5 * (lo + hi) * space.rate
    return SolveResult(
        space, decision, res_gain, (lo * space.rate, hi * space.rate), V, it, it, "rvi", converged,
        time.perf_counter() - t0,
    )


def _scipy_matvec(PE: sp.csr_matrix) -> Callable[..., None] | None:
    """scipy's compiled y += A·x for CSR (:func:`overtake.mdp.csr_product.kernel`), or None.

    It adds each row's terms to y(x) in index order, exactly as _kernels_jit.bellman_residual
    does from cost(x), and is the faster of the two (tests/mdp/test_chain_compiled.py checks that
    they agree bit for bit): so only on a plain CSR matrix in canonical format (sorted indices).
    Where it is missing or the matrix is not such, None (the kernel runs).
    """
    if getattr(PE, "format", None) != "csr" or not PE.has_canonical_format:
        return None
    return kernel(PE)


def _anderson_step(space: StateSpace, ai: ActionIndex, cost: FloatArray, TV: FloatArray,
                   res: list[FloatArray]) -> Callable[[FloatArray], tuple[float, float]]:
    """Anderson RVI's Bellman step: TV from V (into ``TV``), the residual TV − TV(0) − V (a new
    array, into ``res[0]``), and min and max of TV − V; compiled on large deterministic spaces."""
    PE = space.event_matrix
    n = space.size
    if space.layout.deterministic and n >= KERNEL_MIN_STATES:
        from . import _kernels

        order, nb = ai.box_order
        idle = ai.idle
        G = np.empty(n)
        matvec = _scipy_matvec(PE)

        def step(V: FloatArray) -> tuple[float, float]:
            res[0] = np.empty(n)
            if matvec is None:
                lo, hi = _kernels.bellman_residual(PE.indptr, PE.indices, PE.data, cost, V, idle, order, nb, G, TV,
                                                   res[0])
            else:  # the same sums in the same order: TV(x) = cost(x) + Σ P_E(x, ·) H, bit for bit
                _kernels.box_value(V, idle, order, nb, G)
                TV[:] = cost
                matvec(n, n, PE.indptr, PE.indices, PE.data, G, TV)
                lo, hi = _kernels.residual_stats(TV, V, res[0])
            return float(lo), float(hi)
    else:
        def step(V: FloatArray) -> tuple[float, float]:
            H, _ = _minimize(ai, V)
            TV[:] = cost + PE @ H
            d = TV - V
            res[0] = TV - TV[0] - V
            return float(d.min()), float(d.max())
    return step


def anderson_rvi(
    space: StateSpace,
    *,
    tol: float = 1e-6,
    max_iter: int = 100_000,
    V0: FloatArray | None = None,
    memory: int = 6,
    progress: Progress | None = None,
) -> SolveResult:
    """Relative value iteration with Anderson acceleration; stops like RVI, span(TV − V) ≤ tol · g.

    With residual f(V) = TV − (TV)(0) − V and the last ``memory`` differences ΔV, Δf, the next
    iterate is V + f − (ΔV + Δf)·γ, γ = argmin ‖f − Δf·γ‖₂ (Walker and Ni 2011, eq. 2.1 with
    mixing 1). Every iterate gets a full Bellman step, so Λ·min(TV − V) ≤ g* ≤ Λ·max(TV − V)
    (Odoni) holds at each one, and the greedy policy of the last V has g ≤ Λ·max(TV − V), exactly
    as for :func:`relative_value_iteration`. The history restarts when the span has not improved
    for ``4·memory`` steps (a policy switch can make old differences misleading).
    """
    t0 = time.perf_counter()
    mixer = AndersonMixer(space.size, memory)
    ai = ActionIndex(space)
    cost = space.cost / space.rate
    n = space.size
    V = np.zeros(n) if V0 is None else np.array(V0, dtype=np.float64)
    V -= V[0]
    TV = np.empty(n)
    # the residual TV − TV(0) − V of the last step; a new array each step (the mixer keeps it)
    res: list[FloatArray] = [np.empty(0)]
    step = _anderson_step(space, ai, cost, TV, res)

    stall = StallRestart(mixer, 4 * memory)  # the history stopped helping (e.g. after a policy switch)
    lo = hi = 0.0
    converged = False
    it = 0
    last = V  # the last iterate with finite Bellman bounds
    for it in range(1, max_iter + 1):
        lo, hi = step(V)
        if not (np.isfinite(lo) and np.isfinite(hi) and lo <= hi):
            # a non-finite mixed iterate (the compiled step then returns (inf, -inf), which would
            # pass the test below): drop the history, go on from the last good iterate
            if V is last:
                raise SolverError("anderson: the Bellman step is not finite; check the model's rates")
            stall.restart()
            V = last
            continue
        last = V
        if hi - lo <= tol * max(abs(hi), 1e-12):
            converged = True
            break
        if progress and it % 100 == 0:
            progress(f"anderson step {it}: g in [{lo * space.rate:.6g}, {hi * space.rate:.6g}]")
        stall.observe(hi - lo)
        V = mixer.step(V, res[0])
        V -= V[0]
    _, decision = _minimize(ai, V)
    return SolveResult(
        space, decision, 0.5 * (lo + hi) * space.rate, (lo * space.rate, hi * space.rate), V, it, it,
        "anderson", converged, time.perf_counter() - t0,
    )


def policy_iteration(
    space: StateSpace,
    *,
    decision0: IntArray | None = None,
    max_iter: int = 100,
    rtol: float = 1e-10,
    progress: Progress | None = None,
) -> SolveResult:
    """Howard's policy iteration with exact sparse policy evaluation (Puterman §8.6)."""
    t0 = time.perf_counter()
    ai = ActionIndex(space)
    cost = space.cost / space.rate
    if decision0 is None:
        # start from "never spawn beyond one thread per coordinate": a stable, unichain policy
        decision0 = _initial_decision(space, ai)
    dec = decision0.copy()
    history: list[float] = []
    converged = False
    it = 0
    h = np.zeros(space.size)
    warm = None
    for it in range(1, max_iter + 1):
        P = induced_matrix(space, dec)
        gam, h, warm = _evaluate_bias(space, P, cost, warm)
        history.append(gam * space.rate)
        if progress:
            progress(f"policy iteration {it}: g = {gam * space.rate:.8g}")
        H, new = _minimize(ai, h)
        tol = rtol * (np.max(np.abs(h)) + 1.0)
        if space.layout.deterministic:
            keep = h[dec] <= H + tol
        else:
            cur = _decision_value(space, dec, h, H)
            keep = cur <= H + tol
        new = np.where(keep, dec, new)
        if np.array_equal(new, dec):
            converged = True
            break
        dec = new
    lo, hi, _ = bellman_bounds(space, ai, h)
    if not converged:
        raise SolverError(f"policy iteration did not converge in {max_iter} iterations")
    return SolveResult(
        space, dec, history[-1], (lo, hi), h, it, it, "pi", converged, time.perf_counter() - t0, history
    )


def _decision_value(space: StateSpace, dec: IntArray, h: FloatArray, H: FloatArray) -> FloatArray:
    """Value of taking ``dec`` now and acting optimally (w.r.t. h) afterwards: compare with H."""
    val = h.copy()
    for q in range(space.layout.n_actions):
        sel = np.flatnonzero(dec == q)
        v = np.zeros(sel.size)
        for nb, p in space.spawn_neighbours[q]:
            v += p * H[nb[sel]]
        val[sel] = v
    return val


def _initial_decision(space: StateSpace, ai: ActionIndex) -> IntArray:
    """Greedy start: minimise −(active coordinates) so each waiting class gets one thread if free."""
    Q = space.Q
    busy = np.zeros(space.size)
    for spawn in space.layout.spawn:
        for d, _ in spawn:
            busy += (space.rows[:, Q + d] > 0) * 1.0
    # prefer more distinct busy coordinates, then fewer threads
    score = -busy + 1e-3 * space.threads
    _, dec = (ai.box_minimum(score) if space.layout.deterministic else ai.spawn_minimum(score))
    return dec


def solve_space(
    space: StateSpace,
    *,
    method: str = "anderson",
    tol: float = 1e-6,
    max_iter: int | None = None,
    decision0: IntArray | None = None,
    V0: FloatArray | None = None,
    progress: Progress | None = None,
) -> SolveResult:
    """Solve the MDP on one truncated space; ``method`` is "anderson" (the default), "rvi" or "pi".

    ``V0`` starts the value iterations (a smaller space's values mapped onto this one),
    ``decision0`` policy iteration.
    """
    if method == "pi":
        return policy_iteration(space, decision0=decision0, max_iter=max_iter or 100, progress=progress)
    if method == "rvi":
        return relative_value_iteration(space, tol=tol, max_iter=max_iter or 200_000, V0=V0, progress=progress)
    if method == "anderson":
        return anderson_rvi(space, tol=tol, max_iter=max_iter or 100_000, V0=V0, progress=progress)
    raise ValueError(f"method must be 'anderson', 'rvi' or 'pi', got {method!r}")
