"""Policies that see counts, not phases, evaluated exactly on the full chain.

A sidecar without phase labels sees, per waiting queue (a stage, or a stage's route class,
:mod:`overtake.mdp.routes`), the number of requests waiting, and per stage the number of active
threads. The chain keeps everything else: the phase of every active thread (a coordinate of the
MDP's state) and, through the queue's prior α, the phase each waiting request will start in.
With ``x = (w, k)`` a full state (waiting per queue, threads per (stage, phase) coordinate) the
observation is

    o(x) = (w_1 .. w_Q,  K_1 .. K_N),      K_i = Σ_j k_ij,

and a policy is a table: one action per observation class, a ∈ {0..w_1} × … × {0..w_Q}, the
threads to start from each queue. Starting a_q threads from queue q draws their phases from
α_q (a multinomial), so one action leads to a distribution over post-decision states.

Decision epochs are the events the observation shows: arrivals and completions. A phase change
inside a thread (or a uniformization self-loop) leaves ``o`` unchanged and, unlike the MDP (van
der Weij, Bhulai and van der Mei, "Dynamic thread assignment", §2), which re-decides at every
event, triggers no decision: a sidecar cannot act on an event it does not see. With ``P_E`` the
uniformized event matrix split into observation-changing ``P_chg`` and unchanged ``P_same``
parts, a table ``A`` induces the post-decision chain

    P_A = P_chg · R_A + P_same,        R_A(y, ·) = law of the post-decision state from y under A(o(y)),

evaluated exactly: (I − P_A) h + γ 1 = c/Λ (bias ``h``, gain g = Λγ) and the stationary law π of
P_A, both from one sparse LU (:class:`~overtake.mdp.factor.Factor`). The weighted Q-value of an
action at class o,

    Q̄(o, a) = Σ_{y ∈ o} μ(y) · E[h(post(y, a))],     μ = π P_chg (the epochs' stationary weights),

is, times Λ, the first-order change of the gain when class o moves towards ``a`` (the
average-reward policy-gradient theorem, Sutton, McAllester, Singh and Mansour, "Policy gradient
methods for reinforcement learning with function approximation", NIPS 2000, Theorem 1, applied
to a policy that reads the observation only). Unlike in an MDP, acting on it in every class at
once is not guaranteed to lower the gain; :mod:`overtake.mdp.observed` accepts a step only when
exact evaluation confirms it.

A stage with a lock (:mod:`overtake.mdp.lock`, capacity m_i): the observation stays the same.
K_i counts the stage's threads, holders and blocked alike (a sidecar counts its requests in
flight per stage and knows m_i from its stages file), and it tells both apart: a thread blocks
only while m_i hold the lock, so holders = min(K_i, m_i) and blocked = K_i − holders. The tables
of :class:`ObservationSpace` start a thread in a locked stage only while K_i < m_i: its states
have no blocked thread (as the MDP's, :class:`~overtake.mdp.statespace.StateSpace`), and a
request the lock would block waits in the sidecar instead, to be started at the lock's release,
an event the observation shows. :func:`~overtake.mdp.observed_chain.observed_chain` evaluates any
rule, one that starts threads into a full lock included (Apache's π(∞)): those threads block,
holding their thread.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .evaluate import stationary_distribution
from .factor import Factor
from .lock import Locks
from .model import TandemModel
from .observation_actions import DecisionMatrix, Feasibility, spawn_vector
from .observation_exact import ExactEvaluation, ExactSolver
from .observation_proposal import Proposal, propose
from .policy import Policy
from .routes import RouteSplit
from .statespace import Layout, Ranker, StateSpace, Truncation

__all__ = ["ExactEvaluation", "ObservationSpace", "Proposal", "observe", "spawn_vector"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
ObservedRule = Callable[[IntArray], IntArray]

_TRANSITIONS_KEPT = 4  # transitions ObservationSpace.transition keeps (the current table's and its trials')


def observe(model: TandemModel, layout: Layout, rows: IntArray) -> IntArray:
    """Observation rows (waiting per queue, active threads per stage) of full rows (waiting, threads per
    coordinate, and blocked threads per coordinate of a locked stage: counted as its threads)."""
    Q = layout.n_queues
    rows = np.asarray(rows, dtype=np.int64)
    if rows.shape[1] > Q + model.n_coords:
        rows = Locks.build(model, Q).fold(rows)
    out = np.zeros((rows.shape[0], Q + model.n_stages), dtype=np.int64)
    out[:, :Q] = rows[:, :Q]
    for i in range(model.n_stages):
        lo, hi = model.offsets[i], model.offsets[i + 1]
        out[:, Q + i] = rows[:, Q + lo:Q + hi].sum(axis=1)
    return out


class ObservationSpace:
    """The full truncated chain of a hidden-phase layout, its observation classes and their actions.

    The classes' feasible actions are :attr:`feasibility`'s (:mod:`overtake.mdp.observation_actions`),
    a table's decision matrix :attr:`decisions`', its exact evaluation :attr:`exact`'s
    (:mod:`overtake.mdp.observation_exact`) and its improvement step :func:`propose`'s
    (:mod:`overtake.mdp.observation_proposal`); this class holds the chain and the classes.

    Parameters
    ----------
    model
        The tandem.
    trunc
        Request cap C and thread cap K_max of the chain.
    layout
        ``Layout.build(model, "none")`` (one queue per stage) or ``RouteSplit.layout(model)``.
    """

    def __init__(self, model: TandemModel, trunc: Truncation, layout: Layout, *, blocking_cost: bool = True) -> None:
        self.model = model
        self.layout = layout
        self.space = StateSpace(model, trunc, layout.phase_info, blocking_cost=blocking_cost, layout=layout)
        sp_ = self.space
        self.Q = sp_.Q
        self.N = model.n_stages
        self.k_max = sp_.k_max
        self.cap = sp_.cap
        obs = observe(model, layout, sp_.rows)
        self.ranker = Ranker(self.Q + self.N, self.cap)
        keys = self.ranker.rank(obs)
        self.keys, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        self.class_of: IntArray = inv.astype(np.int64).ravel()
        self.classes: IntArray = obs[first]
        self.n_classes = int(self.keys.size)
        self.class_size = np.bincount(self.class_of, minlength=self.n_classes)
        self.feasibility = Feasibility(model, layout, self.classes, self.k_max)
        PE = sp_.event_matrix.tocoo()
        # Idle states (requests, no thread) are never post-decision states of a feasible table; they
        # decide at every event so that the bias is defined on them too (none is absorbing).
        idle = (sp_.threads == 0) & (sp_.n_total > 0)
        same = (self.class_of[PE.row] == self.class_of[PE.col]) & ~idle[PE.row]
        S = sp_.size
        self.P_same = sp.csr_matrix((PE.data[same], (PE.row[same], PE.col[same])), shape=(S, S))
        self.P_change = sp.csr_matrix((PE.data[~same], (PE.row[~same], PE.col[~same])), shape=(S, S))
        # states a decision epoch enters: only their decision rows reach P (low-rank updates)
        self.entered: BoolArray = np.bincount(PE.col[~same], minlength=S) > 0
        self.decisions = DecisionMatrix(sp_, layout, self.class_of)
        self.exact = ExactSolver(model, layout, self.decisions, self.P_change, self.entered, self.transition)
        # the last transitions (a trial's stationary screen and its full evaluation ask for the same one)
        self._p_cache: dict[bytes, sp.csr_matrix] = {}

    @property
    def size(self) -> int:
        return self.space.size

    # ---- actions ------------------------------------------------------------------------------
    def feasible(self, a: IntArray) -> BoolArray:
        """Classes in which starting ``a`` is allowed (:meth:`Feasibility.feasible`)."""
        return self.feasibility.feasible(a)

    def repair(self, actions: IntArray) -> IntArray:
        """A table made feasible (:meth:`Feasibility.repair`)."""
        return self.feasibility.repair(actions)

    def table(self, rule: ObservedRule) -> IntArray:
        """The table of a rule on observation rows (made feasible by :meth:`repair`)."""
        return self.repair(np.asarray(rule(self.classes), dtype=np.int64))

    @property
    def spawn_operators(self) -> list[sp.csr_matrix]:
        """B_q: one thread started from queue q (phase drawn from its prior); zero rows where none can."""
        return self.decisions.spawn_operators

    # ---- a table's chain ----------------------------------------------------------------------
    def decision_matrix(self, actions: IntArray) -> sp.csr_matrix:
        """R_A: pre-decision state → law of its post-decision state under the table (:class:`DecisionMatrix`)."""
        return self.decisions(actions)

    def transition(self, actions: IntArray) -> sp.csr_matrix:
        """P_A = P_chg R_A + P_same on post-decision states (the last few kept: do not modify it)."""
        key = np.ascontiguousarray(actions, dtype=np.int64).tobytes()
        P = self._p_cache.pop(key, None)
        if P is None:
            P = (self.P_change @ self.decision_matrix(actions) + self.P_same).tocsr()
        self._p_cache[key] = P
        while len(self._p_cache) > _TRANSITIONS_KEPT:
            self._p_cache.pop(next(iter(self._p_cache)))
        return P

    def stationary_gain(self, actions: IntArray, *, start: FloatArray | None = None) -> tuple[float, FloatArray]:
        """A table's gain Σ π c and its stationary law π (over all states, 0 where unreachable) only.

        The gain of a uniformized chain is its stationary law's mean cost, so a table is ranked
        without its bias: π on the states it reaches from the empty system, by the iterative
        solve of :func:`overtake.mdp.evaluate.stationary_distribution` (residual 1e-12, started
        from ``start``, e.g. a similar table's law), costs far less than the LU that
        :meth:`evaluate` factors over every state, reached or not. The search screens its
        starting tables and trial steps with it; a step is still accepted on :meth:`evaluate`'s
        gain.
        """
        P = self.transition(actions)
        reach, pi = stationary_distribution(P, x0=start)
        post = np.zeros(self.size)
        post[reach] = pi
        return float(post @ self.space.cost), post

    # ---- exact evaluation -----------------------------------------------------------------------
    def changed_states(self, actions: IntArray, factor: Factor) -> IntArray | None:
        """The states a low-rank update of ``factor`` would change (:meth:`ExactSolver.changed_states`)."""
        return self.exact.changed_states(actions, factor)

    def low_rank(self, actions: IntArray, near: ExactEvaluation) -> bool:
        """Whether :meth:`evaluate` (``near``) solves for this table by a low-rank update of ``near``'s factor."""
        return self.exact.low_rank(actions, near)

    def evaluate(self, actions: IntArray, *, near: ExactEvaluation | None = None,
                 complete: bool = False, law: FloatArray | None = None) -> ExactEvaluation:
        """Gain, bias and stationary laws of a table, all exact (sparse solves, :class:`Factor`).

        ``near``: the evaluation of a similar table. Where its factor is complete and the two
        tables' decision rows differ in at most 80 states that decision epochs enter, both solves
        are that factor's low-rank update (:meth:`Factor.update`, exact; residuals checked to
        1e-11). Else, on a large chain, BiCGSTAB preconditioned by the sparsest factorization made
        on this space and started from ``near``'s solution (relative residual 1e-13,
        :meth:`Factor.iterate`). A solve that has not converged within the costliest
        factorization's work (counted from the fill, never timed: the same table takes the same
        path on any machine), an update that misses its residual, or a stationary law whose
        residual exceeds 1e-9, is replaced by a new factorization: the answer is exact either way.
        After three iterative solves in a row on this space that did not converge, its tables are
        factored at once (:data:`~overtake.mdp.observation_exact.ITER_GIVE_UP`). A new
        factorization of a large chain is incomplete (:class:`Factor`), and complete where GMRES
        fails on it, its law's residual exceeds 1e-9, or ``complete`` asks for it.
        """
        return self.exact.evaluate(actions, near=near, complete=complete, law=law)

    # ---- improvement ----------------------------------------------------------------------------
    def propose(self, actions: IntArray, ev: ExactEvaluation, *, rtol: float = 1e-10) -> Proposal:
        """Weighted-Q argmin per class (module docstring, :func:`overtake.mdp.observation_proposal.propose`),
        the current action kept on ties."""
        return propose(self.feasibility, self.decisions, actions, ev, rtol=rtol)

    # ---- artifact ---------------------------------------------------------------------------------
    def policy(self, actions: IntArray, *, routes: RouteSplit | None = None,
               meta: dict[str, object] | None = None) -> Policy:
        """The table as a policy artifact over observation vectors (:class:`overtake.mdp.Policy`)."""
        return Policy(self.model, self.layout.phase_info, self.cap, self.k_max, self.keys.copy(),
                      np.asarray(actions, dtype=np.int16), dict(meta or {}), routes=routes)
