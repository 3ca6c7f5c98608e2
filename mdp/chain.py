"""Chains induced by a decision rule, built by breadth-first search from the empty system.

Baselines (π(k), π(k1,…,kN), π(∞)) and loaded policy artifacts are rules: functions from
pre-decision states to the number of threads to start from each queue. Only states the rule can
reach are built, so π(∞) on a cap of C requests costs C(C+D, D) states, not the whole lattice.
In the phase-at-start layout a spawn reveals a random phase; threads are then started one at a
time and the rule is asked again after each, as a sidecar would.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .errors import TruncationError
from .lock import Locks
from .model import TandemModel
from .statespace import Layout, Ranker, event_tables, share_tables, transitions, uniformization_rate

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
Rule = Callable[[IntArray], IntArray]


class Columns(NamedTuple):
    """P by column without its diagonal (CSC: ``ptr``, source ``idx``, ``val``) and the diagonal:
    what the stationary solve reads (evaluate.stationary_columns)."""

    ptr: npt.NDArray[np.int32]
    idx: npt.NDArray[np.int32]
    val: FloatArray
    diag: FloatArray


class Chain:
    """A finite chain on reachable (w, k) states with its uniformized transition matrix.

    The compiled search gives the matrix by column (``columns``), as the stationary solve reads
    it; ``P`` (CSR) is then assembled from them on first use.
    """

    def __init__(self, rows: IntArray, P: sp.csr_matrix | None, layout: Layout, cap: int,
                 columns: Columns | None = None) -> None:
        assert P is not None or columns is not None
        self.rows = rows
        self._P = P
        self.columns = columns
        self.layout = layout
        self.cap = cap

    @property
    def P(self) -> sp.csr_matrix:
        if self._P is None:
            assert self.columns is not None
            self._P = _from_columns(self.columns)
        return self._P


def _from_columns(c: Columns) -> sp.csr_matrix:
    """P in CSR from its columns and diagonal, every diagonal entry stored (as the assembly from
    transitions stores them, zeros included)."""
    n = c.diag.size
    ar = np.arange(n)
    cols = np.repeat(ar, np.diff(c.ptr))
    P = sp.csr_matrix((np.concatenate([c.val, c.diag]), (np.concatenate([c.idx, ar]), np.concatenate([cols, ar]))),
                      shape=(n, n))
    P.sum_duplicates()
    return P


def _apply_rule(
    layout: Layout, rows: IntArray, prob: FloatArray, src: IntArray, rule: Rule, k_max: int, locks: Locks
) -> tuple[IntArray, FloatArray, IntArray]:
    """Take pre-decision states to post-decision states (with branching on random phases); the rule
    sees :meth:`Locks.fold` of each state, a thread started into a full lock is blocked."""
    Q = layout.n_queues
    done_rows, done_prob, done_src = [], [], []
    counts = rule(locks.fold(rows))
    for _ in range(10_000):
        counts = np.minimum(counts, rows[:, :Q])
        room = k_max - rows[:, Q:].sum(axis=1)
        active = (counts.sum(axis=1) > 0) & (room > 0)
        done_rows.append(rows[~active])
        done_prob.append(prob[~active])
        done_src.append(src[~active])
        if not np.any(active):
            break
        rows, prob, src, counts = rows[active], prob[active], src[active], counts[active]
        if layout.deterministic:
            # phases are known: start all requested threads at once, up to the thread cap
            for q in range(Q):
                take = np.minimum(counts[:, q], k_max - rows[:, Q:].sum(axis=1))
                ((d, _),) = layout.spawn[q]
                rows = rows.copy()
                rows[:, q] -= take
                locks.place(rows, d, take)
            counts = np.zeros_like(counts)
            continue
        q_first = np.argmax(counts > 0, axis=1)
        new_rows, new_prob, new_src = [], [], []
        for q in range(Q):
            sel = q_first == q
            if not np.any(sel):
                continue
            for d, p in layout.spawn[q]:
                r = rows[sel].copy()
                r[:, q] -= 1
                locks.place(r, d, np.ones(r.shape[0], dtype=np.int64))
                new_rows.append(r)
                new_prob.append(prob[sel] * p)
                new_src.append(src[sel])
        rows = np.concatenate(new_rows)
        prob = np.concatenate(new_prob)
        src = np.concatenate(new_src)
        counts = rule(locks.fold(rows))
    return np.concatenate(done_rows), np.concatenate(done_prob), np.concatenate(done_src)


def build_chain(
    model: TandemModel,
    layout: Layout,
    rule: Rule,
    *,
    max_requests: int,
    max_threads: int | None = None,
    max_states: int = 5_000_000,
    compiled: bool | None = None,
) -> Chain:
    """Breadth-first construction of the post-decision chain a rule induces.

    A policy table's rule (:meth:`Policy.actions` of a phase-known or phase-at-start policy) or a
    baseline's (:class:`~overtake.mdp.baselines.BaselineRule`) is run by one compiled search
    (_kernels_jit.chain_bfs) where the solver kernels load without numba (their ahead-of-time
    build) or numba is loaded anyway: the same states in the same order and the same transition
    matrix (to rounding in sums of coinciding transitions) as the level-by-level numpy search
    below, which any other rule takes (tests/mdp/test_chain_compiled.py), without the level-by-level
    search's temporaries. ``compiled``: True forces the compiled search (numba's JIT if need be),
    False the numpy one; None chooses as above.
    """
    C = max_requests
    k_max = C if max_threads is None else min(max_threads, C)
    if compiled is not False:
        chain = _build_compiled(model, layout, rule, C, k_max, max_states, force=compiled is True)
        if chain is not None:
            return chain

    locks = Locks.build(model, layout.n_queues)

    def step(frontier: IntArray) -> tuple[IntArray, FloatArray, IntArray]:
        s, pre, r = transitions(model, layout, frontier, C)
        return _apply_rule(layout, pre, r, s, rule, k_max, locks)

    return breadth_first(model, layout, step, max_requests=C, k_max=k_max, max_states=max_states,
                         width=layout.n_queues + model.n_coords + locks.n_twins)


#: one breadth-first step: the transitions out of ``frontier`` as (post-decision rows, rates,
#: index of each transition's source row in ``frontier``)
Step = Callable[[IntArray], tuple[IntArray, FloatArray, IntArray]]


def breadth_first(model: TandemModel, layout: Layout, step: Step, *, max_requests: int, k_max: int,
                  max_states: int, width: int | None = None) -> Chain:
    """The chain of the states ``step`` reaches from the empty system, uniformized at the rate of
    ``k_max`` threads (shared by :func:`build_chain` and the observation chains of
    :mod:`overtake.mdp.observation`); ``width``: the state rows' columns (Q + D, and one per
    blocked-thread column of a model with locks, :mod:`overtake.mdp.lock`)."""
    Q, D = layout.n_queues, model.n_coords
    L = Q + D if width is None else width
    C = max_requests
    ranker = Ranker(L, C)
    lam_u = uniformization_rate(model, k_max)
    zero = np.zeros((1, L), dtype=np.int64)
    known_keys = ranker.rank(zero)
    all_rows = [zero]
    frontier = zero
    n_known = 1
    srcs, dst_keys, rates = [], [], []
    while frontier.shape[0] > 0:
        base = n_known - frontier.shape[0]
        post, prob, s2 = step(frontier)
        keys = ranker.rank(post)
        srcs.append(s2 + base)
        dst_keys.append(keys)
        rates.append(prob)
        uk, first = np.unique(keys, return_index=True)
        pos = np.minimum(np.searchsorted(known_keys, uk), known_keys.size - 1)
        new = known_keys[pos] != uk
        frontier = post[first[new]]
        # merge two sorted runs (timsort: linear), not np.union1d, which sorts both from scratch
        known_keys = np.sort(np.concatenate([known_keys, uk[new]]), kind="stable")
        all_rows.append(frontier)
        n_known += frontier.shape[0]
        if n_known > max_states:
            raise TruncationError(
                f"the chain exceeds {max_states} states at max_requests = {C}; lower the truncation"
            )
    rows = np.concatenate(all_rows)
    row_keys = ranker.rank(rows)
    order = np.argsort(row_keys)
    src = np.concatenate(srcs)
    dk = np.concatenate(dst_keys)
    dst = order[np.searchsorted(row_keys[order], dk)]
    rate = np.concatenate(rates)
    return _uniformized(rows, src, dst, rate, lam_u, layout, C)


def _uniformized(rows: IntArray, src: IntArray, dst: IntArray, rate: FloatArray, lam_u: float, layout: Layout,
                 C: int) -> Chain:
    """The chain of transitions (src → dst at ``rate``) uniformized at ``lam_u``."""
    S = rows.shape[0]
    out = np.bincount(src, weights=rate, minlength=S)
    ar = np.arange(S)
    P = sp.csr_matrix(
        (np.concatenate([rate / lam_u, 1.0 - out / lam_u]), (np.concatenate([src, ar]), np.concatenate([dst, ar]))),
        shape=(S, S),
    )
    P.sum_duplicates()
    return Chain(rows, P, layout, C)


def _rule_tables(rule: Rule, layout: Layout, model: TandemModel) -> tuple[int, tuple[Any, ...]] | None:
    """(kind, arguments) of ``rule`` for _kernels_jit.chain_bfs, or None when it is not one it runs."""
    from .baselines import BaselineRule
    from .policy import Policy

    Q = layout.n_queues
    if isinstance(rule, BaselineRule):
        if rule.queue_stage.size != Q or rule.coord_stage.size != model.n_coords:
            return None
        dummy = np.zeros((1, max(Q, 1)), dtype=np.int64)
        return rule.kind, (rule.param, np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int32), dummy, dummy, 0, 0,
                           rule.queue_stage, rule.coord_stage, rule.priority)
    pol = getattr(rule, "__self__", None)
    if (isinstance(pol, Policy) and getattr(rule, "__func__", None) is Policy.actions and not pol.observed
            and pol.Q == Q and pol.D == model.n_coords and pol.model == model):
        keys, dense, spawn = pol.lookup_tables()
        queue_stage = np.asarray(layout.queue_stage, dtype=np.int64)
        coord_stage = np.asarray(model.coord_stage(), dtype=np.int64)
        return 0, (np.zeros(1, dtype=np.int64), keys, dense, spawn, pol.ranker.counts, int(pol.max_requests),
                   int(pol.max_threads), queue_stage, coord_stage, np.arange(Q, dtype=np.int64))
    return None


def _build_compiled(model: TandemModel, layout: Layout, rule: Rule, C: int, k_max: int, max_states: int,
                    force: bool = False) -> Chain | None:
    """:func:`build_chain` by _kernels_jit.chain_bfs; None where that does not apply (or would
    import numba just for this, unless ``force``)."""
    if layout.action_queue is not None or model.has_lock:  # the compiled search has no blocked threads
        return None
    spec = _rule_tables(rule, layout, model)
    if spec is None:
        return None
    from . import _kernels

    if not force and not _kernels.aot_active() and "numba" not in sys.modules:
        return None
    kind, rargs = spec
    Q, D = layout.n_queues, model.n_coords
    L = Q + D
    ranker = Ranker(L, C)
    lam_u = uniformization_rate(model, k_max)
    ev_src, ev_move, ev_f = event_tables(model, layout)
    per_thread, weights = share_tables(model, k_max)
    sp_ptr, coords, probs = _spawn_tables(layout)
    kernel_args = (ranker.counts, C, k_max, max_states, ev_src, ev_move, ev_f, per_thread, weights,
                   model.weights is not None, sp_ptr, coords, probs, layout.deterministic, kind, *rargs)
    return compiled_search(_kernels.chain_bfs, kernel_args, L, ev_src.size, C, max_states, lam_u, layout)


def compiled_search(kernel: Callable[..., int], args: tuple[Any, ...], L: int, n_events: int, C: int, max_states: int,
                    lam_u: float, layout: Layout) -> Chain:
    """Run a resumable breadth-first kernel (_kernels_jit.chain_bfs, _observed_jit.observed_bfs:
    ``kernel(st, rows, keys, level, ht, t_src, t_dst, t_rate, *args)``) from the empty system,
    enlarging its buffers whenever one fills, and the chain it found in the numpy search's order,
    its matrix by column (_kernels_jit.transition_columns: what the stationary solve reads; P
    itself is assembled only where asked for)."""
    ranker = Ranker(L, C)
    b = _BfsBuffers(1 << 12, L, n_events)
    b.keys[0] = ranker.rank(b.rows[:1])[0]
    st = np.array([1, 0, 0, 1], dtype=np.int64)  # one state (the empty system), rebuild the table
    while True:
        status = kernel(st, b.rows, b.keys, b.level, b.ht, b.t_src, b.t_dst, b.t_rate, *args)
        if status == 0:
            break
        if status == 2:
            raise TruncationError(f"the chain exceeds {max_states} states at max_requests = {C}; lower the truncation")
        b.grow(int(st[0]), int(st[1]))
        st[3] = 1
    rows, keys, level, t_src, t_dst, t_rate = b.rows, b.keys, b.level, b.t_src, b.t_dst, b.t_rate
    n, nt = int(st[0]), int(st[1])
    # the numpy search's order: level after level, each level by rank
    order = np.lexsort((keys[:n], level[:n]))
    inv = np.empty(n, dtype=np.int64)
    inv[order] = np.arange(n, dtype=np.int64)
    if nt >= 2**31 - 1:  # beyond 32-bit column indices: the coordinate assembly
        return _uniformized(rows[order], inv[t_src[:nt]], inv[t_dst[:nt]], t_rate[:nt].copy(), lam_u, layout, C)
    from . import _kernels

    ptr = np.empty(n + 1, dtype=np.int32)
    idx = np.empty(nt, dtype=np.int32)
    val = np.empty(nt, dtype=np.float64)
    diag = np.empty(n, dtype=np.float64)
    nnz = _kernels.transition_columns(t_src[:nt], t_dst[:nt], t_rate[:nt], order, inv, float(lam_u), ptr, idx, val,
                                      diag)
    return Chain(rows[order], None, layout, C, Columns(ptr, idx[:nnz], val[:nnz], diag))


def _spawn_tables(layout: Layout) -> tuple[IntArray, IntArray, FloatArray]:
    """Per queue, the coordinates a started thread may take and their probabilities, as CSR-like
    arrays (pointer per queue, coordinates, probabilities) for the compiled search."""
    Q = layout.n_queues
    sp_ptr = np.zeros(Q + 1, dtype=np.int64)
    sp_coord: list[int] = []
    sp_prob: list[float] = []
    for q in range(Q):
        for d, p in layout.spawn[q]:
            sp_coord.append(d)
            sp_prob.append(p)
        sp_ptr[q + 1] = len(sp_coord)
    return sp_ptr, np.array(sp_coord, dtype=np.int64), np.array(sp_prob, dtype=np.float64)


class _BfsBuffers:
    """The compiled search's buffers: states (rows, rank keys, BFS level, hash table) and
    transitions (source, destination, rate), grown when the search reports one full."""

    def __init__(self, n_cap: int, width: int, n_events: int) -> None:
        self.rows = np.zeros((n_cap, width), dtype=np.int64)
        self.keys = np.zeros(n_cap, dtype=np.int64)
        self.level = np.zeros(n_cap, dtype=np.int64)
        t_cap = n_cap * (n_events + 1)
        self.t_src = np.empty(t_cap, dtype=np.int64)
        self.t_dst = np.empty(t_cap, dtype=np.int64)
        self.t_rate = np.empty(t_cap, dtype=np.float64)
        self.ht = np.empty((2 * n_cap, 2), dtype=np.int64)

    def grow(self, n: int, nt: int) -> None:
        """A buffer filled with ``n`` states and ``nt`` transitions: the more-than-half-used ones
        (both if neither) four times larger; the search resumes with the state whose expansion
        did not fit."""
        grow_rows, grow_t = 2 * n > self.rows.shape[0], 2 * nt > self.t_src.size
        if grow_rows or not grow_t:
            n_cap = 4 * self.rows.shape[0]
            self.rows, self.keys = _grown(self.rows, n, n_cap), _grown(self.keys, n, n_cap)
            self.level = _grown(self.level, n, n_cap)
            self.ht = np.empty((2 * n_cap, 2), dtype=np.int64)
        if grow_t or not grow_rows:
            t_cap = 4 * self.t_src.size
            self.t_src, self.t_dst = _grown(self.t_src, nt, t_cap), _grown(self.t_dst, nt, t_cap)
            self.t_rate = _grown(self.t_rate, nt, t_cap)


def _grown(a: npt.NDArray[Any], used: int, size: int) -> npt.NDArray[Any]:
    out = np.empty((size, *a.shape[1:]), dtype=a.dtype)
    out[:used] = a[:used]
    return out
