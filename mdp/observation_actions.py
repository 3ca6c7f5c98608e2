"""The actions of an observation table and the decision operators they induce.

Which thread starts each observation class allows (enough waiting, within the thread cap and every
lock's free places, never idling), how a table is made feasible, and what starting threads does
to the full chain: the multinomial draw of their phases (:func:`spawn_vector`), one thread's
operator per queue (B_q) and a table's decision matrix R_A, rebuilt only in the rows of the states
whose action changed (:mod:`overtake.mdp.observation` states the model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from itertools import product
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .lock import Locks
from .model import TandemModel
from .statespace import Layout, StateSpace

__all__ = ["DecisionMatrix", "Feasibility", "compositions", "spawn_vector"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


@cache
def compositions(n: int, probs: tuple[float, ...]) -> tuple[tuple[tuple[int, ...], float], ...]:
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
            for split, pr in compositions(int(n - b), probs):
                for bsplit, bpr in compositions(int(b), probs):
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


class Feasibility:
    """The feasible actions of each observation class (rows ``classes``: waiting per queue, threads
    per stage) under thread cap ``k_max`` and the model's locks."""

    def __init__(self, model: TandemModel, layout: Layout, classes: IntArray, k_max: int) -> None:
        Q = layout.n_queues
        self.Q = Q
        self.k_max = k_max
        self.waiting: IntArray = classes[:, :Q]
        self.threads: IntArray = classes[:, Q:].sum(axis=1)
        self.requests: IntArray = self.waiting.sum(axis=1) + self.threads
        # locked stages: the queues of each and its free places per class (no state has a blocked
        # thread: the lock's holders are the stage's threads, :mod:`overtake.mdp.observation`)
        self.lock_room = [(np.flatnonzero(layout.queue_stage == i), m - classes[:, Q + i])
                          for i, m in enumerate(model.locks or ()) if m is not None]
        self._feasible: dict[tuple[int, ...], BoolArray] = {}
        self._states: dict[tuple[int, ...], tuple[BoolArray, IntArray]] = {}
        #: the proposal's walk over action vectors (observation_proposal._plan), made once
        self.walk_plan: Any = None

    def feasible(self, a: IntArray) -> BoolArray:
        """Classes in which starting ``a`` (threads per queue) is allowed: enough waiting, within
        K_max, within every lock's free places, and not idling (requests present, no thread
        active after the decision)."""
        a = np.asarray(a, dtype=np.int64)
        tot = int(a.sum())
        K = self.threads + tot
        ok: BoolArray = (np.all(self.waiting >= a, axis=1) & (K <= self.k_max)
                         & ~((self.requests > 0) & (K == 0)))
        for qs, room in self.lock_room:
            ok &= int(a[qs].sum()) <= room
        return ok

    def feasible_cached(self, a: IntArray) -> BoolArray:
        """:meth:`feasible`, kept per action vector (every proposal visits the same ones; do not modify)."""
        key = tuple(int(x) for x in a)
        ok = self._feasible.get(key)
        if ok is None:
            ok = self._feasible[key] = self.feasible(a)
        return ok

    def feasible_states(self, a: IntArray, class_of: IntArray) -> tuple[BoolArray, IntArray]:
        """:meth:`feasible_cached` and the states (classes ``class_of``, always the same array)
        of the classes where ``a`` is feasible, in increasing order; kept per action vector."""
        key = tuple(int(x) for x in a)
        got = self._states.get(key)
        if got is None:
            ok = self.feasible_cached(a)
            got = self._states[key] = (ok, np.flatnonzero(ok[class_of]))
        return got

    def repair(self, actions: IntArray) -> IntArray:
        """Make a table feasible: clip to the waiting counts, every lock's free places (a request
        the lock would block waits in the sidecar) and K_max (later queues kept first), and start
        one thread (the latest stage's first non-empty queue) where it would idle."""
        a = np.minimum(np.maximum(np.asarray(actions, dtype=np.int64), 0), self.waiting).copy()
        for qs, free in self.lock_room:
            left = free.copy()
            for lq in qs.tolist():
                a[:, lq] = np.minimum(a[:, lq], left)
                left = left - a[:, lq]
        room = self.k_max - self.threads
        for q in range(self.Q):  # drop from the earliest queues first: later stages have priority
            over = np.maximum(a.sum(axis=1) - room, 0)
            a[:, q] -= np.minimum(a[:, q], over)
        idle = (self.requests > 0) & (self.threads + a.sum(axis=1) == 0)
        if np.any(idle):
            has = self.waiting[idle] > 0
            q = self.Q - 1 - np.argmax(has[:, ::-1], axis=1)
            a[np.flatnonzero(idle), q] = 1
        return a


#: COO entries DecisionMatrix.rows keeps at most (then it starts again)
ROWS_KEPT = 4_000_000


@dataclass(frozen=True, eq=False)
class _DecisionRows:
    """A decision matrix's entries (COO) and the per-state action counts they were built for."""

    counts: IntArray
    src: IntArray
    idx: IntArray
    prob: FloatArray


class DecisionMatrix:
    """R_A of the tables on a state space whose states belong to classes ``class_of``: pre-decision
    state → law of its post-decision state, and B_q, one thread started from queue q."""

    def __init__(self, space: StateSpace, layout: Layout, class_of: IntArray) -> None:
        self.space = space
        self.layout = layout
        self.class_of = class_of
        # the decision matrix of the last table asked for, as COO entries: a trial differs from it
        # in the rows of a few classes, and only those rows are rebuilt
        self._base: _DecisionRows | None = None
        self._ops: list[sp.csr_matrix] | None = None
        # the rows of each class under each action asked for: (class, action bytes) → COO entries
        self._rows: dict[int | tuple[int, bytes], tuple[IntArray, IntArray, FloatArray]] = {}
        self._kept_entries = 0

    def __call__(self, actions: IntArray) -> sp.csr_matrix:
        """R_A. Only the rows of the states whose action differs from the last table's are rebuilt
        (a row depends on its state's action alone); the rest are that table's entries."""
        S = self.space.size
        counts = np.asarray(actions, dtype=np.int64)[self.class_of]
        base = self._base
        if base is None or base.counts.shape != counts.shape:
            fresh = np.arange(S)
            kept = _DecisionRows(counts, *self.rows(fresh, counts))
        else:
            changed = np.any(counts != base.counts, axis=1)
            fresh = np.flatnonzero(changed)
            keep = ~changed[base.src]
            src, idx, prob = self.rows(fresh, counts)
            kept = _DecisionRows(counts, np.concatenate([base.src[keep], src]), np.concatenate([base.idx[keep], idx]),
                                 np.concatenate([base.prob[keep], prob]))
        self._base = kept
        R = sp.csr_matrix((kept.prob, (kept.src, kept.idx)), shape=(S, S))
        R.sum_duplicates()
        return R

    def rows(self, states: IntArray, counts: IntArray) -> tuple[IntArray, IntArray, FloatArray]:
        """The COO entries (row, column, probability) of R's rows ``states`` under per-state ``counts``
        (over every state, the same in all states of a class: a table's), in no particular order
        (a row has no two entries in one column).

        A search tries the same actions in the same classes again and again: each class's rows
        under each action are built once (:meth:`_built`) and kept, up to :data:`ROWS_KEPT` entries."""
        if states.size == 0:
            return self._built(states, counts)
        cls = self.class_of[states]
        present, first = np.unique(cls, return_index=True)
        keys = self._keys(present, counts[states[first]])
        kept = self._rows
        if self._kept_entries > ROWS_KEPT:
            kept.clear()
            self._kept_entries = 0
        missing = [j for j, k in enumerate(keys) if k not in kept]
        if missing:
            built = np.flatnonzero(np.isin(self.class_of, present[missing]))
            src, idx, prob = self._built(built, counts)
            order = np.argsort(self.class_of[src], kind="stable")
            src, idx, prob = src[order], idx[order], prob[order]
            self._kept_entries += src.size
            bounds = np.searchsorted(self.class_of[src], present[missing], side="left").tolist() + [src.size]
            for n, j in enumerate(missing):
                lo, hi = bounds[n], bounds[n + 1]
                kept[keys[j]] = (src[lo:hi], idx[lo:hi], prob[lo:hi])
        parts = [kept[k] for k in keys]
        src = np.concatenate([e[0] for e in parts])
        idx = np.concatenate([e[1] for e in parts])
        prob = np.concatenate([e[2] for e in parts])
        want = np.zeros(self.space.size, dtype=bool)
        want[states] = True
        if want[src].all():
            return src, idx, prob
        keep = want[src]
        return src[keep], idx[keep], prob[keep]

    def _keys(self, classes: IntArray, actions: IntArray) -> list[int] | list[tuple[int, bytes]]:
        """One key per (class, action) pair: an integer (class and action in mixed radix, an
        action's counts being at most the thread cap each) where it fits in 63 bits."""
        k = self.space.k_max + 1
        Q = actions.shape[1]
        if k ** Q * (self.class_of.size + 1) < 2 ** 62 and (actions.size == 0 or 0 <= actions.min() <= actions.max() < k):
            radix = k ** np.arange(Q, dtype=np.int64)
            return (classes.astype(np.int64) * k ** Q + actions @ radix).tolist()  # type: ignore[no-any-return]
        return [(int(c), a.tobytes()) for c, a in zip(classes.tolist(), actions)]

    def _built(self, states: IntArray, counts: IntArray) -> tuple[IntArray, IntArray, FloatArray]:
        """:meth:`rows`, built from the multinomial draws (:func:`spawn_vector`)."""
        sp_ = self.space
        go = states[counts[states].sum(axis=1) > 0]
        stay = states[counts[states].sum(axis=1) == 0]
        rows, prob, src = spawn_vector(self.layout, sp_.rows[go], counts[go], np.ones(go.size), go)
        return (np.concatenate([src, stay]), np.concatenate([sp_.index(rows), stay]),
                np.concatenate([prob, np.ones(stay.size)]))

    @property
    def spawn_operators(self) -> list[sp.csr_matrix]:
        """B_q: one thread started from queue q (phase drawn from its prior); zero rows where none can."""
        if self._ops is None:
            S = self.space.size
            ops = []
            for q in range(self.space.Q):
                r, c, v = [], [], []
                for nb, p in self.space.spawn_neighbours[q]:
                    ok = np.flatnonzero(nb >= 0)
                    r.append(ok)
                    c.append(nb[ok])
                    v.append(np.full(ok.size, p))
                ops.append(sp.csr_matrix((np.concatenate(v), (np.concatenate(r), np.concatenate(c))), shape=(S, S)))
            self._ops = ops
        return self._ops
