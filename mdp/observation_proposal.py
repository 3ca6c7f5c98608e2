"""The policy-improvement proposal of an observation table: the weighted-Q argmin per class.

With h a table's bias and μ its epochs' stationary weights, Q̄(o, a) = Σ_{y ∈ o} μ(y) E[h(post(y, a))]
(:mod:`overtake.mdp.observation`); E h(post(·, a)) for every action vector a is (Π_q B_q^{a_q}) h:
the spawn operators are applied queue after queue in a depth-first walk over a (they commute in
law), one sparse product per step, and each vector is summed per class with the weights μ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .csr_product import matvec
from .observation_actions import DecisionMatrix, Feasibility
from .observation_exact import ExactEvaluation

__all__ = ["Proposal", "propose"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


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


class _Walk:
    """The depth-first walk over action vectors: every feasible one's weighted Q̄ per class, the
    least so far (``best``, ``best_a``) and the current action's (``cur``)."""

    def __init__(self, feasibility: Feasibility, decisions: DecisionMatrix, actions: IntArray,
                 weight: FloatArray) -> None:
        self.feasibility = feasibility
        self.class_of = decisions.class_of
        self.n_classes = feasibility.waiting.shape[0]
        self.Q = feasibility.Q
        self.weight = weight
        self.best = np.full(self.n_classes, np.inf)
        self.best_a = actions.copy()
        self.cur = np.full(self.n_classes, np.nan)
        self.ops = [matvec(B) for B in decisions.spawn_operators]
        self.waiting = feasibility.waiting
        self.threads = feasibility.threads
        self.wmax = feasibility.waiting.max(axis=0) if self.n_classes else np.zeros(self.Q, np.int64)
        # an action vector as one integer (mixed radix over the queues): the current action's
        # classes are found by one comparison per visited action
        if np.any(actions > self.wmax) or np.any(actions < 0):
            raise ValueError("propose: the current table is not feasible in some class; repair it first")
        self.radix = np.concatenate([[1], np.cumprod(self.wmax[:-1] + 1)]).astype(np.int64)
        self.code = actions @ self.radix

    def visit(self, v: FloatArray, leaf: _Leaf) -> None:
        ok, states, a, code = leaf
        # the states of the classes where ``a`` is feasible only: each class's sum adds the same
        # terms in the same order as over every state, so it is the same to the last bit
        s = np.bincount(self.class_of[states], weights=self.weight[states] * v[states], minlength=self.n_classes)
        better = ok & (s < self.best)
        self.best[better] = s[better]
        self.best_a[better] = a
        mine = self.code == code
        self.cur[mine] = s[mine]

    def walk(self, h: FloatArray) -> None:
        """Visit every action vector some class can take (:func:`_plan`), each with its vector."""
        vec: list[FloatArray] = [h] * (self.Q + 1)
        ops = self.ops
        for q, t, leaf in _plan(self.feasibility, self.class_of, self.wmax, self.radix):
            vec[q + 1] = vec[q] if t == 0 else ops[q](vec[q + 1])
            if leaf is not None:
                self.visit(vec[q + 1], leaf)


#: a visited action vector: the classes where it is feasible, their states, the vector, its code
_Leaf = tuple[BoolArray, IntArray, IntArray, int]
#: the walk's steps: queue q's count becomes t (its vector: the parent's for t = 0, else queue
#: q's spawn operator applied to the vector for t − 1), and the action vector then complete
_Step = tuple[int, int, _Leaf | None]


def _plan(feasibility: Feasibility, class_of: IntArray, wmax: IntArray, radix: IntArray) -> list[_Step]:
    """The depth-first walk over action vectors, as steps (kept on ``feasibility``: it depends on
    the classes alone, not on the bias). A prefix no class can take is not extended (a feasible
    action's every prefix is alive), nor one with more threads than the cap: its vectors would be
    computed for no class; a complete vector no class can take is not visited."""
    if feasibility.walk_plan is not None:
        return feasibility.walk_plan  # type: ignore[no-any-return]
    Q, K = feasibility.Q, feasibility.k_max
    a = np.zeros(Q, dtype=np.int64)
    steps: list[_Step] = []

    def walk(q: int, total: int, alive: BoolArray) -> None:
        live = alive
        for t in range(int(wmax[q]) + 1):
            if t > 0:
                if total + t > K:
                    break
                live = live & (feasibility.waiting[:, q] >= t) & (feasibility.threads + (total + t) <= K)
                if not np.any(live):
                    break
            a[q] = t
            leaf: _Leaf | None = None
            if q + 1 == Q:
                ok, states = feasibility.feasible_states(a, class_of)
                leaf = (ok, states, a.copy(), int(a @ radix)) if states.size else None
            steps.append((q, t, leaf))
            if q + 1 < Q:
                walk(q + 1, total + t, live)
        a[q] = 0

    walk(0, 0, np.ones(feasibility.waiting.shape[0], dtype=bool))
    feasibility.walk_plan = steps
    return steps


def propose(feasibility: Feasibility, decisions: DecisionMatrix, actions: IntArray, ev: ExactEvaluation, *,
            rtol: float = 1e-10) -> Proposal:
    """Weighted-Q argmin per class (module docstring) of the classes of ``feasibility`` (states' classes
    ``decisions.class_of``), the current action kept on ties (within ``rtol`` of the bias's scale)."""
    actions = np.asarray(actions, dtype=np.int64)
    class_of = decisions.class_of
    n_classes = feasibility.waiting.shape[0]
    mu = ev.epochs
    mass = np.bincount(class_of, weights=mu, minlength=n_classes).astype(np.float64)
    class_size = np.bincount(class_of, minlength=n_classes)
    weight = np.where(mass[class_of] > 0, mu, 1.0 / class_size[class_of])
    h = ev.bias
    tol = rtol * (float(np.max(np.abs(h))) + 1.0)
    wsum = np.bincount(class_of, weights=weight, minlength=n_classes)
    w = _Walk(feasibility, decisions, actions, weight)
    w.walk(h)
    if np.any(np.isnan(w.cur)):
        raise ValueError("propose: the current table is not feasible in some class; repair it first")
    keep = w.cur <= w.best + tol * wsum
    best_a = w.best_a
    best_a[keep] = actions[keep]
    adv = np.where(keep, 0.0, w.best - w.cur)
    return Proposal(best_a, adv, mass)
