"""A table's exact evaluation on an observation space: bias, gain and stationary law from sparse solves.

The equations are those of :class:`~overtake.mdp.factor.Factor` for the table's post-decision
chain P_A (:mod:`overtake.mdp.observation`). A table near an evaluated one is solved without a
new factorization where that is exact: by the low-rank (Sherman–Morrison–Woodbury) update of the
near table's complete factor when few decision rows changed, else, on a large chain, by BiCGSTAB
preconditioned by a factor of this space; every such answer is checked by its residual and
replaced by a new factorization where it misses.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order

from .errors import SolverError
from .evaluate import PolicyMetrics, metrics
from .factor import ITER_MIN, Factor
from .model import TandemModel
from .observation_actions import DecisionMatrix
from .statespace import Layout

__all__ = ["DIRECT_STATES", "LOW_RANK", "ExactEvaluation", "ExactSolver", "SolverState"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
Solutions = tuple[FloatArray | None, FloatArray | None]

# at most: complete LUs, else incomplete ones. Up to some eight thousand states (two-stage Table 1
# spaces) the complete LU of a searched table costs about what the incomplete one and its GMRES
# solves cost, and it answers the search's small trials by low-rank updates without a screen; on
# larger spaces its fill grows far faster than the incomplete one's
DIRECT_STATES = 8_500
# above this many changed states: BiCGSTAB (Factor.iterate) or a new LU; at most: the low-rank update
# of the current complete factor (Factor.update), whose 2r triangular solves cost less than the
# ordering and elimination of a new LU of the chains it is used on
LOW_RANK = 80
# after this many iterative solves in a row that did not converge within their budget, the space's
# tables are factored at once: the preconditioner does not carry them, and each failure costs
# its budget on top of the factorization that follows (a count, not a clock). Once one search
# gives up so, the space's other searches do too (ExactSolver.given_up).
ITER_GIVE_UP = 3
# an iterative evaluation (both solves) that took more BiCGSTAB iterations than this on a space of
# REFRESH_STATES states (proportionally more on a larger one): the preconditioner has drifted from
# the tables the search now reaches, and the next iterative table is factored instead, its factor
# preconditioning the tables after it. A new incomplete factor of a searched table costs about
# what this many iterations preconditioned by a drifted one cost, and its neighbours then converge
# in a few; its ordering and symbolic steps grow faster than an iteration with the chain's size
# (at three times the states it costs some two to three times as many iterations)
REFRESH_ITERATIONS = 40
REFRESH_STATES = 8_500
_UPDATE_RTOL = 1e-11  # relative residual a low-rank update's solutions must meet (else a new LU)


@dataclass(frozen=True, eq=False)
class ExactEvaluation:
    """A table's exact performance on an :class:`~overtake.mdp.observation.ObservationSpace`.

    ``gain`` = Λγ (time-average cost, blocking charged as :attr:`StateSpace.cost`); ``bias`` the
    relative values h on post-decision states (h(0) = 0); ``post`` the stationary law on
    post-decision states, ``epochs`` the stationary rate of decision epochs per pre-decision
    state (μ = π P_chg), both of length ``space.size``; ``metrics`` E[W] and the rest;
    ``factor`` the LU the solves used (a preconditioner for the next table), ``refactored``
    whether this table was factored itself, ``solution`` the three solves' answers.
    """

    gain: float
    bias: FloatArray
    post: FloatArray
    epochs: FloatArray
    metrics: PolicyMetrics
    factor: Factor
    refactored: bool
    solution: FloatArray | None = None  # (u, v, π_{−0}) as columns: the next table's starting point


@dataclass(frozen=True, eq=False)
class _System:
    """A table's equations: A = (I − P)_{−0,−0}, the bias right-hand sides (c/Λ, 1) and P_{0,−0}."""

    P: sp.csr_matrix
    A: sp.csc_matrix
    cost: FloatArray
    rhs: FloatArray
    p0: FloatArray


class SolverState(NamedTuple):
    """:meth:`ExactSolver.state`."""

    preconditioner: Factor | None
    lu_work: int
    iter_failed: int
    stale: bool = False


class ExactSolver:
    """The exact evaluations of the tables on one observation space, and what they keep between tables.

    ``decisions`` builds the tables' decision rows, ``P_change`` is the observation-changing part of
    the event matrix, ``entered`` marks the states a decision epoch enters and ``transition`` gives
    a table's P_A (:class:`~overtake.mdp.observation.ObservationSpace`).

    Iterative solves are preconditioned by the sparsest factorization made on this space (a
    π(∞)-like table's LU fills in far less than those of the tables the search reaches, and
    preconditions them as well) until one takes more than :data:`REFRESH_ITERATIONS` (per
    :data:`REFRESH_STATES` states): the next
    table is then factored and its factor preconditions the next ones. They may take the work the
    costliest factorization took;
    both counted from the fill, never timed, so that the path the search takes does not depend on
    the machine's load.

    The independent searches of a space (:mod:`overtake.mdp.observed`) each start from the
    :meth:`state` the starting evaluations left, and each may miss :data:`ITER_GIVE_UP` iterative
    solves in a row before factoring; once one of them has, the others factor at once too: the
    preconditioner failed tables of the same space, and each miss costs its whole budget. The
    mark is a byte of memory shared with the forked worker that runs some of the searches
    (:mod:`overtake.mdp.observed_beside`). Which exact solve answers a table may then depend on
    which search gave up first; the answers meet the same residual tests either way.
    """

    def __init__(self, model: TandemModel, layout: Layout, decisions: DecisionMatrix, P_change: sp.csr_matrix,
                 entered: npt.NDArray[np.bool_], transition: Callable[[IntArray], sp.csr_matrix]) -> None:
        #: the latest factorization preconditions (the searched table's own, which its trials
        #: differ from in a few classes), and a miss only refactors: the space never gives up on
        #: iterating (ExactSolver.follow; False: the sparsest factor and ITER_GIVE_UP)
        self.follow = False
        self.model, self.layout, self.decisions = model, layout, decisions
        self.space = decisions.space
        self.class_of = decisions.class_of
        self.P_change, self.entered, self.transition = P_change, entered, transition
        self._P_change_csc: sp.csc_matrix | None = None  # P_chg by column, for the low-rank updates' U
        self.preconditioner: Factor | None = None
        self.lu_work = 0
        self.iter_failed = 0  # iterative solves failed in a row on this space (ITER_GIVE_UP)
        self.stale = False  # the last iterative evaluation took over REFRESH_ITERATIONS: factor the next
        self._given_up = mmap.mmap(-1, 1)  # anonymous and shared: a fork of this process sees the mark

    @property
    def given_up(self) -> bool:
        """Whether a search on this space (here or in a forked worker) missed :data:`ITER_GIVE_UP`
        iterative solves in a row: every search factors from then on."""
        return self._given_up[0] != 0

    def state(self) -> SolverState:
        """What the evaluations carry from one table to the next (preconditioner, work budget,
        iterative misses in a row, whether the preconditioner is due for renewal): :meth:`restore`
        starts a search from it again."""
        return SolverState(self.preconditioner, self.lu_work, self.iter_failed, self.stale)

    def restore(self, state: SolverState) -> None:
        self.preconditioner, self.lu_work, self.iter_failed, self.stale = state

    def changed_states(self, actions: IntArray, factor: Factor) -> IntArray | None:
        """The states whose decision rows differ between ``actions`` and ``factor``'s table and that
        a decision epoch enters (the rank of the change, :meth:`Factor.update`); None where the
        factor cannot be updated (incomplete)."""
        if not factor.complete or factor.base is None:
            return None
        moved = np.any(np.asarray(actions) != factor.actions, axis=1)[self.class_of]
        return np.flatnonzero(moved & self.entered)

    def low_rank(self, actions: IntArray, near: ExactEvaluation) -> bool:
        """Whether :meth:`evaluate` (``near``) solves for this table by a low-rank update of ``near``'s factor."""
        z = self.changed_states(actions, near.factor)
        return z is not None and z.size <= LOW_RANK

    def system(self, actions: IntArray) -> _System:
        """The equations of a table."""
        sp_ = self.space
        S = sp_.size
        P = self.transition(actions)
        A = (sp.identity(S, format="csr") - P)[1:, 1:].tocsc()
        cost = sp_.cost / sp_.rate
        # P_{0,−0} from row 0's entries (as P[0, 1:].toarray() sums them, without a submatrix)
        lo, hi = int(P.indptr[0]), int(P.indptr[1])
        cols = P.indices[lo:hi]
        p0 = np.zeros(S - 1)
        np.add.at(p0, cols[cols > 0] - 1, P.data[lo:hi][cols > 0])
        return _System(P, A, cost, np.column_stack([cost[1:], np.ones(S - 1)]), p0)

    def evaluate(self, actions: IntArray, *, near: ExactEvaluation | None = None,
                 complete: bool = False, law: FloatArray | None = None) -> ExactEvaluation:
        """:meth:`ObservationSpace.evaluate <overtake.mdp.observation.ObservationSpace.evaluate>`: the
        near table's update or iteration, else a new factorization; then the gain, bias and law,
        checked by the law's residual. ``law``: this table's stationary law already solved (the
        screen's), the iterative stationary solve's start."""
        eq = self.system(actions)
        sol, solT = self._near(actions, near, eq, law)
        refactored = sol is None or solT is None
        if refactored:
            factor, sol, solT = self._factored(actions, eq, complete)
        else:
            assert near is not None
            factor = near.factor
        assert sol is not None and solT is not None
        if refactored:
            factor.base = np.column_stack([sol, solT])
        post, reach, resid = self._law(eq, solT)
        if resid > 1e-9:
            if not (refactored and factor.complete):  # an iterative answer not good enough: factor it completely
                return self.evaluate(actions, complete=True)
            raise SolverError(f"stationary solve inaccurate: residual {resid:.2e} on {self.space.size} states")
        return self._result(eq, sol, solT, post, reach, factor, refactored)

    def _near(self, actions: IntArray, near: ExactEvaluation | None, eq: _System,
              law: FloatArray | None = None) -> Solutions:
        """Both solves from ``near``'s factor (low-rank update) or preconditioned by this space's
        (BiCGSTAB on a large chain); (None, None) where neither applies or either failed."""
        if near is None:
            return None, None
        factor = near.factor
        changed = self.changed_states(actions, factor)
        if changed is not None and changed.size <= LOW_RANK:
            return self._updated(factor, actions, changed, eq)
        S = self.space.size
        gave_up = not self.follow and (self.iter_failed >= ITER_GIVE_UP or self.given_up)
        if S <= DIRECT_STATES or gave_up or self.stale:
            return None, None  # stale: _factored renews the preconditioner
        X0 = near.solution if near.solution is not None else np.zeros((S - 1, 3))
        # the table's own law, where solved already, is far closer than the near table's
        X0T = X0[:, 2:] if law is None or not law[0] > 0 else (law[1:] / law[0])[:, None]
        pre = self.preconditioner or factor
        budget = max(ITER_MIN, max(self.lu_work, 4 * pre.work) // pre.iteration_work(eq.A))
        sol = pre.iterate(eq.A, eq.rhs, X0[:, :2], budget=budget)
        spent = pre.iterations
        solT = None if sol is None else pre.iterate(eq.A, eq.p0[:, None], X0T, budget=budget, trans=True)
        self.iter_failed = self.iter_failed + 1 if solT is None else 0
        self.stale = solT is not None and spent + pre.iterations > REFRESH_ITERATIONS * max(1.0, S / REFRESH_STATES)
        if self.iter_failed >= ITER_GIVE_UP and not self.follow:
            self._given_up[0] = 1
        return sol, solT

    def _updated(self, factor: Factor, actions: IntArray, z: IntArray, eq: _System) -> Solutions:
        """Both solves of ``actions`` by the low-rank update of ``factor`` (changed states ``z``),
        each checked by its residual: (None, None) where either misses :data:`_UPDATE_RTOL`."""
        S = self.space.size
        class_of = self.class_of
        if z.size == 0:
            assert factor.base is not None
            return factor.base[:, :2], factor.base[:, 2:]
        old = self.decisions.rows(z, np.asarray(factor.actions, dtype=np.int64)[class_of])
        new = self.decisions.rows(z, np.asarray(actions, dtype=np.int64)[class_of])
        rows = np.concatenate([old[0], new[0]])
        cols = np.concatenate([old[1], new[1]])
        if np.any(cols == 0):
            return None, None  # the empty state's column moved: not this update's form
        # ΔR without the empty state's column (it has no entry there), built as such
        dR = sp.csr_matrix((np.concatenate([-old[2], new[2]]), (np.searchsorted(z, rows), cols - 1)),
                           shape=(z.size, S - 1))
        dR.sum_duplicates()
        if self._P_change_csc is None:
            self._P_change_csc = self.P_change.tocsc()
        # P_chg's columns z (a column slice of its CSC copy: the same matrix as a CSR column index, cheaper)
        Uz = self._P_change_csc[:, z]
        # a column of U is its state's column of P_chg; a row of ΔR its state's new decision row
        # less the factored one: both keyed so the factor solves each once over the search
        counts = np.asarray(actions, dtype=np.int64)[class_of[z]]
        keys = ([int(s) for s in z], [(int(s), c.tobytes()) for s, c in zip(z, counts, strict=True)])
        out = factor.update(Uz[1:], dR, Uz[0].toarray().ravel(), keys=keys)
        if out is None:
            return None, None
        sol, solT = out
        pb = eq.p0[:, None]
        for x, b, op in ((sol, eq.rhs, eq.A), (solT[:, None], pb, eq.A.T)):
            if np.linalg.norm(op @ x - b) > _UPDATE_RTOL * np.linalg.norm(b):
                return None, None
        return sol, solT[:, None]

    def _factored(self, actions: IntArray, eq: _System, complete: bool) -> tuple[Factor, FloatArray, FloatArray]:
        """A new factorization of the table and both solves: incomplete on a large chain unless
        ``complete``, and complete where GMRES fails on the incomplete one."""
        factor = Factor(eq.A, actions, complete=complete or self.space.size <= DIRECT_STATES)
        sol = factor.solve(eq.A, eq.rhs)
        solT = None if sol is None else factor.solve(eq.A, eq.p0[:, None], trans=True)
        if sol is None or solT is None:  # the incomplete factor did not carry GMRES: the complete one
            factor = Factor(eq.A, actions)
            sol = factor.solve(eq.A, eq.rhs)
            solT = factor.solve(eq.A, eq.p0[:, None], trans=True)
        assert sol is not None and solT is not None
        self.lu_work = max(self.lu_work, factor.work)
        if self.follow or self.stale or self.preconditioner is None or factor.nnz < self.preconditioner.nnz:
            self.preconditioner = factor
        self.stale = False
        return factor, sol, solT

    def _law(self, eq: _System, solT: FloatArray) -> tuple[FloatArray, IntArray, float]:
        """The stationary law on post-decision states (0 where the empty system does not reach),
        the states reached, and the law's relative residual."""
        S = self.space.size
        post = np.clip(np.concatenate([[1.0], solT[:, 0]]), 0.0, None)
        reach = np.sort(breadth_first_order(eq.P, 0, directed=True, return_predecessors=False))
        post[np.setdiff1d(np.arange(S), reach, assume_unique=True)] = 0.0
        post /= post.sum()
        resid = float(np.abs(eq.P.T @ post - post).max() / post.max())
        return post, reach, resid

    def _result(self, eq: _System, sol: FloatArray, solT: FloatArray, post: FloatArray, reach: IntArray,
                factor: Factor, refactored: bool) -> ExactEvaluation:
        """Gain, bias, epoch weights and metrics from the solves and the law."""
        sp_ = self.space
        u, v = sol[:, 0], sol[:, 1]
        gamma = float((eq.cost[0] + eq.p0 @ u) / (1.0 + eq.p0 @ v))
        h = np.concatenate([[0.0], u - gamma * v])
        epochs = np.asarray(self.P_change.T @ post).ravel()
        m = metrics(self.model, sp_.rows[reach], self.layout.queue_stage, post[reach], sp_.cap)
        return ExactEvaluation(gamma * sp_.rate, h, post, epochs, m, factor, refactored, np.column_stack([sol, solT]))
