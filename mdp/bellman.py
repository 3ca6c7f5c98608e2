"""The minimisation over spawn actions in the MDP's operator.

The function H of van der Weij et al., "Dynamic thread assignment", §2.

At a pre-decision state y = (w, k) the controller may start threads for any waiting requests:

    H(y) = min { V(w − a, k + a) : 0 ≤ a ≤ w, Σ(k + a) ≤ K_max }.

The paper writes the minimum over single-coordinate moves; we allow every combination (the box),
and never enumerate it. Two exact dynamic programmes:

* :func:`box_minimum` (phase known): the box is a product of intervals intersected with a
  downward-closed thread cap, so the minimum is a sequence of one-dimensional suffix minima, one
  coordinate at a time — O(Q·S) instead of O(Π(w_q+1)·S).
* :func:`spawn_minimum` (phase drawn when the thread starts): threads are started one at a time,
  each revealing its phase, so H(y) = min(V(y), min_q Σ_j α_qj H(y_qj)) by backward recursion over
  the number of active threads (K_max levels).

Both return the minimiser; ties go to starting fewer threads. Post-decision states that idle
(requests present, no thread active) are excluded: idling the processor never helps, and without
this every policy would not be unichain — policy iteration needs that (Puterman §8.6).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import numpy.typing as npt

from .statespace import StateSpace

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Below this many states the solvers use numpy passes instead of the compiled kernels, so a small
#: scenario never imports numba (a noticeable start-up); above it the kernels are faster.
KERNEL_MIN_STATES = 5_000


class ActionIndex:
    """Precomputed level orderings so each Bellman minimisation is a few vectorised passes."""

    def __init__(self, space: StateSpace) -> None:
        self.space = space

    @cached_property
    def box_order(self) -> tuple[IntArray, IntArray]:
        # Queue after queue: (state, one-more-thread neighbour) ordered by the neighbour's k_d,
        # highest first, so a state's neighbour already holds the suffix minimum along q when read.
        sp = self.space
        orders, nbs = [], []
        for q in range(sp.Q):
            (nb, _), = sp.spawn_neighbours[q]
            (d, _), = sp.layout.spawn[q]
            has = np.flatnonzero(nb >= 0)
            order = has[np.argsort(-sp.rows[has, sp.Q + d], kind="stable")]
            orders.append(order)
            nbs.append(nb[order])
        return np.concatenate(orders).astype(np.int64), np.concatenate(nbs).astype(np.int64)

    @cached_property
    def idle(self) -> npt.NDArray[np.bool_]:
        """Post-decision states not allowed: requests present but no active thread."""
        idle: npt.NDArray[np.bool_] = (self.space.threads == 0) & (self.space.n_total > 0)
        return idle

    @cached_property
    def _thread_levels(self) -> list[IntArray]:
        K = self.space.threads
        return [np.flatnonzero(K == k) for k in range(self.space.k_max, -1, -1)]

    @cached_property
    def box_batches(self) -> list[tuple[IntArray, IntArray]]:
        """:attr:`box_order` cut into (queue, neighbour level) runs: each run's states are disjoint
        from its neighbours, so one run is one vectorised numpy step of the suffix-minimum DP."""
        sp = self.space
        order, nb = self.box_order
        key = np.empty(order.size, dtype=np.int64)
        at = 0
        for q in range(sp.Q):
            (d, _), = sp.layout.spawn[q]
            m = int(np.count_nonzero(sp.spawn_neighbours[q][0][0] >= 0))
            key[at:at + m] = q * (sp.k_max + 2) + sp.rows[nb[at:at + m], sp.Q + d]
            at += m
        cuts = np.flatnonzero(np.diff(key)) + 1
        return [(o, j) for o, j in zip(np.split(order, cuts), np.split(nb, cuts), strict=True) if o.size]

    def box_minimum(self, V: FloatArray, rtol: float = 0.0) -> tuple[FloatArray, IntArray]:
        """H(y) and its minimiser (a state index) for every y, phase-known layout."""
        sp = self.space
        if not sp.layout.deterministic:
            raise ValueError("box_minimum needs the phase-known layout; use spawn_minimum")
        V = np.ascontiguousarray(V, dtype=np.float64)
        tol = rtol * (np.max(np.abs(V)) + 1.0)
        if sp.size < KERNEL_MIN_STATES:
            G = np.where(self.idle, np.inf, V)
            A = np.arange(sp.size, dtype=np.int64)
            for o, j in self.box_batches:
                better = G[j] < G[o] - tol
                oo, jj = o[better], j[better]
                G[oo] = G[jj]
                A[oo] = A[jj]
            return G, A
        from . import _kernels

        order, nb = self.box_order
        G = np.empty(sp.size)
        A = np.empty(sp.size, dtype=np.int64)
        _kernels.box_minimum(V, self.idle, order, nb, tol, G, A)
        return G, A

    def spawn_minimum(self, V: FloatArray, rtol: float = 0.0) -> tuple[FloatArray, IntArray]:
        """H(y) and the first spawn action (the queue, where each has one; −1 = stop) for every y."""
        sp = self.space
        H = np.where(self.idle, np.inf, V)
        dec = np.full(sp.size, -1, dtype=np.int64)
        tol = rtol * (np.max(np.abs(V)) + 1.0)
        for states in self._thread_levels:
            best = H[states]
            for q in range(sp.layout.n_actions):
                val = np.zeros(states.size)
                ok = np.ones(states.size, dtype=bool)
                for nb, p in sp.spawn_neighbours[q]:
                    j = nb[states]
                    ok &= j >= 0
                    val += p * H[np.maximum(j, 0)]
                better = ok & (val < best - tol)
                best = np.where(better, val, best)
                dec[states[better]] = q
            H[states] = best
        return H, dec


def brute_force_minimum(space: StateSpace, V: FloatArray, state: int) -> float:
    """min over every spawn vector a (enumerated): the reference the tests check the DP against."""
    import itertools

    row = space.rows[state]
    Q = space.Q
    w = row[:Q]
    best = float(V[state]) if (row[Q:].sum() > 0 or row.sum() == 0) else np.inf
    for a in itertools.product(*(range(int(x) + 1) for x in w)):
        av = np.asarray(a)
        if row[Q:].sum() + av.sum() > space.k_max:
            continue
        new = row.copy()
        new[:Q] -= av
        for q in range(Q):
            ((d, _),) = space.layout.spawn[q]
            new[Q + d] += av[q]
        if new[Q:].sum() == 0 and new.sum() > 0:
            continue  # idling is not an action
        best = min(best, float(V[space.index(new[None, :])[0]]))
    return best
