"""The overtaking heuristic: Theorem 3.1 as an index rule, without value iteration.

The theorem is van der Weij et al.'s ("Dynamic thread assignment").

Theorem 3.1 starts threads for phase-j requests at stage i when they *overtake in expectation*
requests at stages ≥ i under the downstream rules. We make "in expectation" concrete with the
clearing view of processor sharing. Let ``R_d`` be the remaining work to departure of a request
in coordinate d = (stage i, phase j): the rest of stage i from phase j followed by full services
at stages i+1..N, itself a PH distribution PH(e_d, A) where A chains the stages' sub-generators
(``A = T_i`` on stage blocks, ``t_i α_{i+1}`` from stage i's exits into stage i+1). Under
processor sharing two requests receive equal service while both are present, so request a is
delayed by exactly min(R_a, R_x) by a newcomer x, and x overtakes a by (R_a − R_x)⁺. Starting x
next to the active set A instead of after it therefore changes the sum of sojourn times by

    Δ(x) = Σ_{a∈A} ( 2·E min(R_x, R_a) − E R_a )          (pairwise, our default rule)

with E min(R_c, R_d) = (e_c ⊗ e_d)(−(A ⊕ A))⁻¹ 1 (a D² linear solve, D = Σ M_i). A waiting
request is started when Δ < 0: its expected overtaking gain Σ E(R_a − R_x)⁺ exceeds the delay
Σ E min(R_x, R_a) it inflicts. With exponential remaining work Δ < 0 ⇔ E R_x < E R_a, the
literal "overtakes in expectation"; with IFR work (exponential or Erlang stages, §3) no waiting
request ever passes the test, so the rule is π(1): one thread, later stages first.

Decisions per epoch (the same at every arrival, phase change and completion):

1. candidates are the waiting requests, cheapest expected remaining work first (later stage
   first on ties, FCFS inside a queue);
2. with no active thread the first candidate is started (work conservation);
3. every further candidate is started iff Δ(x) < 0 against the active set *including* the
   threads started earlier in this epoch (so "s threads" for a class come out of the test).

``variant="lookahead"`` refines the alternative to starting x: instead of waiting for a to
leave, x may be started at any of a's later phase changes, where the MDP decides again with a's new
phase known (Theorem 3.1's dependence on the downstream rules); the wait cost is then the value
of a small optimal-stopping problem on a's remaining path (:func:`wait_costs`). It never starts
more than the pairwise rule, so it is π(1) on exponential/Erlang stages too.
``variant="literal"`` is the bare pairwise reading of the theorem (start x iff E R_x < E R_a for
some active a at a stage ≥ x's stage); it is kept for comparison in ``bench/heuristic_table.py``.
With more than one core, a thread that adds capacity (c(K+1)/(K+1) ≥ c(K)/K) is always started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import ModelError
from .evaluate import PolicyMetrics
from .model import TandemModel
from .rule_evaluation import evaluate_rule, grow_requests
from .statespace import Layout

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

VARIANTS = ("pairwise", "lookahead", "literal")
_VARIANT_CODE = {"pairwise": 0, "lookahead": 0, "literal": 1}


def chained_generator(model: TandemModel) -> FloatArray:
    """A (D×D): the sub-generator of a request's remaining path through all stages (PH of §2)."""
    D = model.n_coords
    A = np.zeros((D, D))
    for i, st in enumerate(model.stages):
        o = model.offsets[i]
        m = st.phases
        A[o:o + m, o:o + m] = st.T
        if i + 1 < model.n_stages:
            nxt = model.stages[i + 1]
            o2 = model.offsets[i + 1]
            # exit from phase j starts the next stage by row j of the routing (α for independent stages)
            A[o:o + m, o2:o2 + nxt.phases] = st.exit_rates[:, None] * model.routing_matrix(i)
    return A


def remaining_work(model: TandemModel) -> tuple[FloatArray, FloatArray]:
    """(E R_d, E min(R_c, R_d)) for every coordinate pair, at full processor speed."""
    A = chained_generator(model)
    D = A.shape[0]
    one = np.ones(D)
    mean = np.asarray(np.linalg.solve(-A, one), dtype=np.float64)
    # ∫ P(R_c > t) P(R_d > t) dt with independent paths: the Kronecker sum A ⊕ A
    I = np.eye(D)
    ksum = np.kron(A, I) + np.kron(I, A)
    mins = np.linalg.solve(-ksum, np.ones(D * D)).reshape(D, D)
    return mean, np.asarray(0.5 * (mins + mins.T), dtype=np.float64)


def wait_costs(model: TandemModel, mean: FloatArray, mins: FloatArray, variant: str) -> FloatArray:
    """W[x, a]: the delay x suffers if it is not started next to a (relative to E R_x).

    ``pairwise``: x waits until a departs, W = E R_a. ``lookahead``: x may be started at any of
    a's later phase changes (the epochs where the MDP decides again with a's new phase known), so
    W is the continuation value of an optimal-stopping problem on a's remaining path:
    V(d) = min(E R_x + 2 E min(R_x, R_d),  1/μ_d + Σ_d' p(d, d') V(d') + p(d, done) E R_x),
    solved by value iteration over the D coordinates (a alone at full speed while x waits).
    """
    D = mean.size
    if variant != "lookahead":
        return np.tile(mean, (D, 1))
    A = chained_generator(model)
    mu = -np.diag(A)
    P = A / mu[:, None]
    np.fill_diagonal(P, 0.0)
    done = np.clip(1.0 - P.sum(axis=1), 0.0, 1.0)
    W = np.empty((D, D))
    for x in range(D):
        spawn = mean[x] + 2.0 * mins[x]
        V = spawn.copy()
        for _ in range(100_000):
            cont = 1.0 / mu + P @ V + done * mean[x]
            V2 = np.minimum(spawn, cont)
            if np.max(np.abs(V2 - V)) <= 1e-13 * max(1.0, float(np.max(V))):
                V = V2
                break
            V = V2
        W[x] = 1.0 / mu + P @ V + done * mean[x] - mean[x]
    return W


@dataclass(frozen=True, eq=False)
class OvertakingHeuristic:
    """The overtaking heuristic for one model: a rule on the phase-known (``full``) layout.

    ``actions(rows)`` maps state rows (waiting per coordinate, then threads per coordinate, as
    :attr:`overtake.mdp.Policy.columns` for ``phase_info="full"``) to threads to start per coordinate.
    """

    model: TandemModel
    variant: str
    remaining: FloatArray
    min_pair: FloatArray
    wait: FloatArray
    order: IntArray
    coord_stage: IntArray
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "heuristic" if self.variant == "pairwise" else f"heuristic({self.variant})"

    @property
    def variant_code(self) -> int:
        return _VARIANT_CODE[self.variant]

    def actions(self, rows: npt.ArrayLike, *, max_threads: int | None = None) -> IntArray:
        r = np.ascontiguousarray(np.asarray(rows, dtype=np.int64))
        D = self.model.n_coords
        if r.ndim != 2 or r.shape[1] != 2 * D:
            raise ModelError(f"heuristic state rows must have {2 * D} columns (waiting, then threads per coordinate)")
        cap = np.iinfo(np.int64).max if max_threads is None else int(max_threads)
        from ._simcall import decide_rows  # the ahead-of-time kernel; numba only without it

        return decide_rows(r, self.remaining, self.min_pair, self.wait, self.order, self.coord_stage,  # type: ignore[no-any-return]
                            self.variant_code, int(self.model.cores), float(self.model.overhead), cap)

    def action(self, state: npt.ArrayLike) -> IntArray:
        row: IntArray = self.actions(np.asarray(state, dtype=np.int64).reshape(1, -1))[0]
        return row

    def rule(self):  # type: ignore[no-untyped-def]
        return self.actions


def overtaking_heuristic(model: TandemModel, *, variant: str = "pairwise") -> OvertakingHeuristic:
    """Build the overtaking heuristic (no value iteration; cost O(D⁶) once, D = Σ M_i ≤ ~30)."""
    if variant not in VARIANTS:
        raise ModelError(f"heuristic variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    mean, mins = remaining_work(model)
    cs = model.coord_stage().astype(np.int64)
    # cheapest expected remaining work first; later stage first on ties
    order = np.lexsort((np.arange(mean.size), -cs, np.round(mean, 12))).astype(np.int64)
    return OvertakingHeuristic(model, variant, mean, mins, wait_costs(model, mean, mins, variant), order, cs)


@dataclass
class HeuristicEvaluation:
    """Exact E[W] of the heuristic on the truncated chain, with the caps tried."""

    name: str
    metrics: PolicyMetrics
    trace: list[dict[str, Any]]
    seconds: float


def evaluate_heuristic(
    model: TandemModel, heuristic: OvertakingHeuristic | None = None, *, tol: float = 1e-3,
    start: int = 20, max_requests: int = 400,
) -> HeuristicEvaluation:
    """Exact metrics of the heuristic (chain on the ``full`` layout); the request cap grows 1.5×
    until E[W] moves by less than ``tol`` (as :func:`overtake.mdp.rule_evaluation.evaluate_baseline`)."""
    t0 = time.perf_counter()
    h = heuristic or overtaking_heuristic(model)
    model.check_stable(None)
    layout = Layout.build(model, "full")

    def ev(C: int) -> PolicyMetrics:
        return evaluate_rule(model, layout, h.actions, max_requests=C, max_threads=None)

    m, trace = grow_requests(ev, start, tol, h.name, max_cap=max_requests, error=ModelError)
    return HeuristicEvaluation(h.name, m, trace, time.perf_counter() - t0)
