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

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from itertools import product

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order

from .errors import SolverError
from .evaluate import PolicyMetrics, metrics, stationary_distribution
from .factor import ITER_MIN, Factor
from .lock import Locks
from .model import TandemModel
from .policy import Policy
from .routes import RouteSplit
from .statespace import Layout, Ranker, StateSpace, Truncation

__all__ = ["ExactEvaluation", "ObservationSpace", "Proposal", "observe", "spawn_vector"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
ObservedRule = Callable[[IntArray], IntArray]


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


@cache
def _compositions(n: int, probs: tuple[float, ...]) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Every split of n threads over len(probs) phases with its multinomial probability."""
    m = len(probs)
    out = []
    for c in product(range(n + 1), repeat=m - 1):
        if sum(c) > n:
            continue
        counts = (*c, n - sum(c))
        coef = math.factorial(n)
        for k in counts:
            coef //= math.factorial(k)
        pr = float(coef) * math.prod(pk**k for pk, k in zip(probs, counts))
        if pr > 0:
            out.append((counts, pr))
    return tuple(out)


def spawn_vector(
    layout: Layout, rows: IntArray, counts: IntArray, prob: FloatArray, src: IntArray, locks: Locks | None = None
) -> tuple[IntArray, FloatArray, IntArray]:
    """Start ``counts[s, q]`` threads from each queue q of each row s, phases drawn from the queue's prior.

    Returns the post-decision rows with their probabilities and the index of the row they came
    from (``src``), one entry per multinomial outcome. ``locks`` (rows with blocked-thread
    columns, :mod:`overtake.mdp.lock`): threads started in a locked stage beyond its free places
    block; the started threads are exchangeable, so the phases of those that run and of those
    that block are two independent multinomials.
    """
    Q = layout.n_queues
    for q in range(Q):
        c = counts[:, q]
        if not np.any(c > 0):
            continue
        coords = [d for d, _ in layout.spawn[q]]
        probs = tuple(p for _, p in layout.spawn[q])
        blk = np.zeros_like(c)
        if locks is not None and locks.coord_twin[coords[0]] >= 0:
            room = np.maximum(locks.coord_cap[coords[0]] - locks.holders(rows, coords[0]), 0)
            blk = np.maximum(c - room, 0)
        parts_r, parts_p, parts_s, parts_c = [rows[c == 0]], [prob[c == 0]], [src[c == 0]], [counts[c == 0]]
        # the distinct (started, blocked) pairs in lexicographic order, as one integer each (a
        # row-wise unique sorts structured rows, many times slower on a large frontier)
        base = int(c.max()) + 1
        codes = np.unique((c * base + blk)[c > 0])
        for n, b in zip((codes // base).tolist(), (codes % base).tolist()):
            sel = (c == n) & (blk == b)
            for split, pr in _compositions(int(n - b), probs):
                for bsplit, bpr in _compositions(int(b), probs):
                    r = rows[sel].copy()
                    r[:, q] -= n
                    for d, k, kb in zip(coords, split, bsplit):
                        r[:, Q + d] += k
                        if kb:
                            assert locks is not None
                            r[:, locks.twin_col(d)] += kb
                    parts_r.append(r)
                    parts_p.append(prob[sel] * (pr * bpr))
                    parts_s.append(src[sel])
                    parts_c.append(counts[sel])
        rows, prob, src, counts = (np.concatenate(parts_r), np.concatenate(parts_p), np.concatenate(parts_s),
                                   np.concatenate(parts_c))
    return rows, prob, src


_DIRECT_STATES = 6_000  # below: complete LUs (an LU is cheaper than GMRES set-up); above: incomplete LU
# above this many changed states: BiCGSTAB (Factor.iterate) or a new LU; at most: the low-rank update
# of the current complete factor (Factor.update), whose 2r triangular solves cost less than the
# ordering and elimination of a new LU of the chains it is used on
_LOW_RANK = 80
_UPDATE_RTOL = 1e-11  # relative residual a low-rank update's solutions must meet (else a new LU)
_TRANSITIONS_KEPT = 4  # transitions ObservationSpace.transition keeps (the current table's and its trials')


@dataclass(frozen=True, eq=False)
class _DecisionRows:
    """A decision matrix's entries (COO) and the per-state action counts they were built for."""

    counts: IntArray
    src: IntArray
    idx: IntArray
    prob: FloatArray


@dataclass(frozen=True, eq=False)
class ExactEvaluation:
    """A table's exact performance on an :class:`ObservationSpace`.

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
class Proposal:
    """The weighted-Q improvement step for every class.

    ``actions`` the argmin action per class (the current one on ties), ``advantage`` its weighted
    Q̄ minus the current action's (≤ 0; Λ × it is the first-order gain change for reached
    classes), ``mass`` the classes' epoch weights (0: not reached by the current table, whose
    states are then weighted uniformly).
    """

    actions: IntArray
    advantage: FloatArray
    mass: FloatArray


class ObservationSpace:
    """The full truncated chain of a hidden-phase layout, its observation classes and their actions.

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
        w = self.classes[:, : self.Q]
        self._w = w
        self._K = self.classes[:, self.Q :].sum(axis=1)
        self._n = w.sum(axis=1) + self._K
        # locked stages: the queues of each and its free places per class (no state has a blocked
        # thread: the lock's holders are the stage's threads, module docstring)
        self._lock_room = [(np.flatnonzero(layout.queue_stage == i), m - self.classes[:, self.Q + i])
                           for i, m in enumerate(model.locks or ()) if m is not None]
        PE = sp_.event_matrix.tocoo()
        # Idle states (requests, no thread) are never post-decision states of a feasible table; they
        # decide at every event so that the bias is defined on them too (none is absorbing).
        idle = (sp_.threads == 0) & (sp_.n_total > 0)
        same = (self.class_of[PE.row] == self.class_of[PE.col]) & ~idle[PE.row]
        S = sp_.size
        self.P_same = sp.csr_matrix((PE.data[same], (PE.row[same], PE.col[same])), shape=(S, S))
        self.P_change = sp.csr_matrix((PE.data[~same], (PE.row[~same], PE.col[~same])), shape=(S, S))
        # states a decision epoch enters: only their decision rows reach P (low-rank updates)
        self._entered: BoolArray = np.bincount(PE.col[~same], minlength=S) > 0
        # iterative solves (evaluate): the sparsest factorization made on this space preconditions
        # them (a π(∞)-like table's LU fills in far less than those of the tables the search
        # reaches, and preconditions them as well), and they may take the work the costliest
        # factorization took; both counted from the fill, never timed, so that the path the
        # search takes does not depend on the machine's load
        self._preconditioner: Factor | None = None
        self._lu_work = 0
        # the decision matrix of the last table asked for, as COO entries (a trial differs from it
        # in the rows of a few classes: only those rows are rebuilt) and the last transitions
        # (a trial's stationary screen and its full evaluation ask for the same one)
        self._r_base: _DecisionRows | None = None
        self._p_cache: dict[bytes, sp.csr_matrix] = {}
        self._feasible: dict[tuple[int, ...], BoolArray] = {}

    # ---- actions ------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.space.size

    def feasible(self, a: IntArray) -> BoolArray:
        """Classes in which starting ``a`` (threads per queue) is allowed: enough waiting, within
        K_max, within every lock's free places, and not idling (requests present, no thread
        active after the decision)."""
        a = np.asarray(a, dtype=np.int64)
        tot = int(a.sum())
        K = self._K + tot
        ok: BoolArray = np.all(self._w >= a, axis=1) & (K <= self.k_max) & ~((self._n > 0) & (K == 0))
        for qs, room in self._lock_room:
            ok &= int(a[qs].sum()) <= room
        return ok

    def _feasible_cached(self, a: IntArray) -> BoolArray:
        """:meth:`feasible`, kept per action vector (every proposal visits the same ones; do not modify)."""
        key = tuple(int(x) for x in a)
        ok = self._feasible.get(key)
        if ok is None:
            ok = self._feasible[key] = self.feasible(a)
        return ok

    def repair(self, actions: IntArray) -> IntArray:
        """Make a table feasible: clip to the waiting counts, every lock's free places (a request
        the lock would block waits in the sidecar) and K_max (later queues kept first), and start
        one thread (the latest stage's first non-empty queue) where it would idle."""
        a = np.minimum(np.maximum(np.asarray(actions, dtype=np.int64), 0), self._w).copy()
        for qs, free in self._lock_room:
            left = free.copy()
            for lq in qs.tolist():
                a[:, lq] = np.minimum(a[:, lq], left)
                left = left - a[:, lq]
        room = self.k_max - self._K
        for q in range(self.Q):  # drop from the earliest queues first: later stages have priority
            over = np.maximum(a.sum(axis=1) - room, 0)
            a[:, q] -= np.minimum(a[:, q], over)
        idle = (self._n > 0) & (self._K + a.sum(axis=1) == 0)
        if np.any(idle):
            has = self._w[idle] > 0
            q = self.Q - 1 - np.argmax(has[:, ::-1], axis=1)
            a[np.flatnonzero(idle), q] = 1
        return a

    def table(self, rule: ObservedRule) -> IntArray:
        """The table of a rule on observation rows (made feasible by :meth:`repair`)."""
        return self.repair(np.asarray(rule(self.classes), dtype=np.int64))

    @property
    def spawn_operators(self) -> list[sp.csr_matrix]:
        """B_q: one thread started from queue q (phase drawn from its prior); zero rows where none can."""
        if not hasattr(self, "_ops"):
            S = self.size
            ops = []
            for q in range(self.Q):
                r, c, v = [], [], []
                for nb, p in self.space.spawn_neighbours[q]:
                    ok = np.flatnonzero(nb >= 0)
                    r.append(ok)
                    c.append(nb[ok])
                    v.append(np.full(ok.size, p))
                ops.append(sp.csr_matrix((np.concatenate(v), (np.concatenate(r), np.concatenate(c))), shape=(S, S)))
            self._ops = ops
        return self._ops

    # ---- exact evaluation -----------------------------------------------------------------------
    def decision_matrix(self, actions: IntArray) -> sp.csr_matrix:
        """R_A: pre-decision state → law of its post-decision state under the table.

        Only the rows of the states whose action differs from the last table's are rebuilt (a
        row depends on its state's action alone); the rest are that table's entries."""
        S = self.space.size
        counts = np.asarray(actions, dtype=np.int64)[self.class_of]
        base = self._r_base
        if base is None or base.counts.shape != counts.shape:
            fresh = np.arange(S)
            kept = _DecisionRows(counts, *self._decision_rows(fresh, counts))
        else:
            changed = np.any(counts != base.counts, axis=1)
            fresh = np.flatnonzero(changed)
            keep = ~changed[base.src]
            src, idx, prob = self._decision_rows(fresh, counts)
            kept = _DecisionRows(counts, np.concatenate([base.src[keep], src]), np.concatenate([base.idx[keep], idx]),
                                 np.concatenate([base.prob[keep], prob]))
        self._r_base = kept
        R = sp.csr_matrix((kept.prob, (kept.src, kept.idx)), shape=(S, S))
        R.sum_duplicates()
        return R

    def _decision_rows(self, states: IntArray, counts: IntArray) -> tuple[IntArray, IntArray, FloatArray]:
        """The COO entries (row, column, probability) of R's rows ``states`` under per-state ``counts``."""
        sp_ = self.space
        go = states[counts[states].sum(axis=1) > 0]
        stay = states[counts[states].sum(axis=1) == 0]
        rows, prob, src = spawn_vector(self.layout, sp_.rows[go], counts[go], np.ones(go.size), go)
        return (np.concatenate([src, stay]), np.concatenate([sp_.index(rows), stay]),
                np.concatenate([prob, np.ones(stay.size)]))

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

    def changed_states(self, actions: IntArray, factor: Factor) -> IntArray | None:
        """The states whose decision rows differ between ``actions`` and ``factor``'s table and that
        a decision epoch enters (the rank of the change, :meth:`Factor.update`); None where the
        factor cannot be updated (incomplete)."""
        if not factor.complete or factor.base is None:
            return None
        moved = np.any(np.asarray(actions) != factor.actions, axis=1)[self.class_of]
        return np.flatnonzero(moved & self._entered)

    def low_rank(self, actions: IntArray, near: ExactEvaluation) -> bool:
        """Whether :meth:`evaluate` (``near``) solves for this table by a low-rank update of ``near``'s factor."""
        z = self.changed_states(actions, near.factor)
        return z is not None and z.size <= _LOW_RANK

    def _updated(self, factor: Factor, actions: IntArray, z: IntArray, A: sp.csc_matrix, rhs: FloatArray,
                 p0: FloatArray) -> tuple[FloatArray | None, FloatArray | None]:
        """Both solves of ``actions`` by the low-rank update of ``factor`` (changed states ``z``),
        each checked by its residual: (None, None) where either misses :data:`_UPDATE_RTOL`."""
        S = self.size
        if z.size == 0:
            assert factor.base is not None
            return factor.base[:, :2], factor.base[:, 2:]
        old = self._decision_rows(z, np.asarray(factor.actions, dtype=np.int64)[self.class_of])
        new = self._decision_rows(z, np.asarray(actions, dtype=np.int64)[self.class_of])
        rows = np.concatenate([old[0], new[0]])
        dR = sp.csr_matrix((np.concatenate([-old[2], new[2]]),
                            (np.searchsorted(z, rows), np.concatenate([old[1], new[1]]))),
                           shape=(z.size, S))
        dR.sum_duplicates()
        if dR[:, 0].nnz:
            return None, None  # the empty state's column moved: not this update's form
        Uz = self.P_change[:, z].tocsc()
        # a column of U is its state's column of P_chg; a row of ΔR its state's new decision row
        # less the factored one: both keyed so the factor solves each once over the search
        counts = np.asarray(actions, dtype=np.int64)[self.class_of[z]]
        keys = ([int(s) for s in z], [(int(s), c.tobytes()) for s, c in zip(z, counts, strict=True)])
        out = factor.update(Uz[1:], dR[:, 1:].tocsr(), Uz[0].toarray().ravel(), keys=keys)
        if out is None:
            return None, None
        sol, solT = out
        pb = p0[:, None]
        for x, b, op in ((sol, rhs, A), (solT[:, None], pb, A.T)):
            if np.linalg.norm(op @ x - b) > _UPDATE_RTOL * np.linalg.norm(b):
                return None, None
        return sol, solT[:, None]

    def evaluate(self, actions: IntArray, *, near: ExactEvaluation | None = None,
                 complete: bool = False) -> ExactEvaluation:
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
        A new factorization of a large chain is incomplete (:class:`Factor`), and complete where
        GMRES fails on it, its law's residual exceeds 1e-9, or ``complete`` asks for it.
        """
        sp_ = self.space
        S = sp_.size
        P = self.transition(actions)
        A = (sp.identity(S, format="csr") - P)[1:, 1:].tocsc()
        cost = sp_.cost / sp_.rate
        p0 = P[0, 1:].toarray().ravel()
        rhs = np.column_stack([cost[1:], np.ones(S - 1)])
        sol = solT = None
        factor = near.factor if near is not None else None
        changed = None if factor is None else self.changed_states(actions, factor)
        if factor is not None and changed is not None and changed.size <= _LOW_RANK:
            sol, solT = self._updated(factor, actions, changed, A, rhs, p0)
        elif factor is not None and near is not None and S > _DIRECT_STATES:
            X0 = near.solution if near.solution is not None else np.zeros((S - 1, 3))
            pre = self._preconditioner or factor
            budget = max(ITER_MIN, max(self._lu_work, 4 * pre.work) // pre.iteration_work(A))
            sol = pre.iterate(A, rhs, X0[:, :2], budget=budget)
            solT = None if sol is None else pre.iterate(A, p0[:, None], X0[:, 2:], budget=budget, trans=True)
        refactored = sol is None or solT is None
        if refactored:
            factor = Factor(A, actions, complete=complete or S <= _DIRECT_STATES)
            sol = factor.solve(A, rhs)
            solT = None if sol is None else factor.solve(A, p0[:, None], trans=True)
            if sol is None or solT is None:  # the incomplete factor did not carry GMRES: the complete one
                factor = Factor(A, actions)
                sol = factor.solve(A, rhs)
                solT = factor.solve(A, p0[:, None], trans=True)
            self._lu_work = max(self._lu_work, factor.work)
            if self._preconditioner is None or factor.nnz < self._preconditioner.nnz:
                self._preconditioner = factor
        assert factor is not None and sol is not None and solT is not None
        if refactored:
            factor.base = np.column_stack([sol, solT])
        u, v = sol[:, 0], sol[:, 1]
        gamma = float((cost[0] + p0 @ u) / (1.0 + p0 @ v))
        h = np.concatenate([[0.0], u - gamma * v])
        post = np.clip(np.concatenate([[1.0], solT[:, 0]]), 0.0, None)
        reach = np.sort(breadth_first_order(P, 0, directed=True, return_predecessors=False))
        post[np.setdiff1d(np.arange(S), reach, assume_unique=True)] = 0.0
        post /= post.sum()
        resid = float(np.abs(P.T @ post - post).max() / post.max())
        if resid > 1e-9:
            if not (refactored and factor.complete):  # an iterative answer not good enough: factor it completely
                return self.evaluate(actions, complete=True)
            raise SolverError(f"stationary solve inaccurate: residual {resid:.2e} on {S} states")
        epochs = np.asarray(self.P_change.T @ post).ravel()
        m = metrics(self.model, sp_.rows[reach], self.layout.queue_stage, post[reach], self.cap)
        return ExactEvaluation(gamma * sp_.rate, h, post, epochs, m, factor, refactored, np.column_stack([sol, solT]))

    # ---- improvement ----------------------------------------------------------------------------
    def propose(self, actions: IntArray, ev: ExactEvaluation, *, rtol: float = 1e-10) -> Proposal:
        """Weighted-Q argmin per class (module docstring), the current action kept on ties.

        E h(post(·, a)) for every action vector a is (Π_q B_q^{a_q}) h: the spawn operators are
        applied queue after queue in a depth-first walk over a (they commute in law), one sparse
        product per step, and each vector is summed per class with the weights μ.
        """
        actions = np.asarray(actions, dtype=np.int64)
        mu = ev.epochs
        mass = np.bincount(self.class_of, weights=mu, minlength=self.n_classes).astype(np.float64)
        weight = np.where(mass[self.class_of] > 0, mu, 1.0 / self.class_size[self.class_of])
        h = ev.bias
        tol = rtol * (float(np.max(np.abs(h))) + 1.0)
        wsum = np.bincount(self.class_of, weights=weight, minlength=self.n_classes)
        best = np.full(self.n_classes, np.inf)
        best_a = actions.copy()
        cur = np.full(self.n_classes, np.nan)
        ops = self.spawn_operators
        wmax = self._w.max(axis=0) if self.n_classes else np.zeros(self.Q, np.int64)
        budget = self.k_max
        a = np.zeros(self.Q, dtype=np.int64)

        # an action vector as one integer (mixed radix over the queues): the current action's
        # classes are found by one comparison per visited action
        if np.any(actions > wmax) or np.any(actions < 0):
            raise ValueError("propose: the current table is not feasible in some class; repair it first")
        radix = np.concatenate([[1], np.cumprod(wmax[:-1] + 1)]).astype(np.int64)
        code = actions @ radix

        def visit(v: FloatArray) -> None:
            ok = self._feasible_cached(a)
            if not np.any(ok):
                return
            s = np.bincount(self.class_of, weights=weight * v, minlength=self.n_classes)
            better = ok & (s < best)
            best[better] = s[better]
            best_a[better] = a
            mine = code == int(a @ radix)
            cur[mine] = s[mine]

        def walk(q: int, v: FloatArray, total: int) -> None:
            if q == self.Q:
                visit(v)
                return
            vq = v
            for t in range(int(wmax[q]) + 1):
                if t > 0:
                    if total + t > budget:
                        break
                    vq = ops[q] @ vq
                a[q] = t
                walk(q + 1, vq, total + t)
            a[q] = 0

        walk(0, h, 0)
        if np.any(np.isnan(cur)):
            raise ValueError("propose: the current table is not feasible in some class; repair it first")
        keep = cur <= best + tol * wsum
        best_a[keep] = actions[keep]
        adv = np.where(keep, 0.0, best - cur)
        return Proposal(best_a, adv, mass)

    # ---- artifact ---------------------------------------------------------------------------------
    def policy(self, actions: IntArray, *, routes: RouteSplit | None = None,
               meta: dict[str, object] | None = None) -> Policy:
        """The table as a policy artifact over observation vectors (:class:`overtake.mdp.Policy`)."""
        return Policy(self.model, self.layout.phase_info, self.cap, self.k_max, self.keys.copy(),
                      np.asarray(actions, dtype=np.int16), dict(meta or {}), routes=routes)
