"""Chains induced by a decision rule, built by breadth-first search from the empty system.

Baselines (π(k), π(k1,…,kN), π(∞)) and loaded policy artifacts are rules: functions from
pre-decision states to the number of threads to start from each queue. Only states the rule can
reach are built, so π(∞) on a cap of C requests costs C(C+D, D) states, not the whole lattice.
In the phase-at-start layout a spawn reveals a random phase; threads are then started one at a
time and the rule is asked again after each, as a sidecar would.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .errors import TruncationError
from .model import TandemModel
from .statespace import Layout, Ranker, _events, uniformization_rate

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
Rule = Callable[[IntArray], IntArray]


class Chain:
    """A finite chain on reachable (w, k) states with its uniformized transition matrix."""

    def __init__(self, rows: IntArray, P: sp.csr_matrix, layout: Layout, cap: int) -> None:
        self.rows = rows
        self.P = P
        self.layout = layout
        self.cap = cap


def _apply_rule(
    layout: Layout, rows: IntArray, prob: FloatArray, src: IntArray, rule: Rule, k_max: int
) -> tuple[IntArray, FloatArray, IntArray]:
    """Take pre-decision states to post-decision states (with branching on random phases)."""
    Q = layout.n_queues
    done_rows, done_prob, done_src = [], [], []
    counts = rule(rows)
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
                rows[:, Q + d] += take
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
                r[:, Q + d] += 1
                new_rows.append(r)
                new_prob.append(prob[sel] * p)
                new_src.append(src[sel])
        rows = np.concatenate(new_rows)
        prob = np.concatenate(new_prob)
        src = np.concatenate(new_src)
        counts = rule(rows)
    return np.concatenate(done_rows), np.concatenate(done_prob), np.concatenate(done_src)


def build_chain(
    model: TandemModel,
    layout: Layout,
    rule: Rule,
    *,
    max_requests: int,
    max_threads: int | None = None,
    max_states: int = 5_000_000,
) -> Chain:
    """Breadth-first construction of the post-decision chain a rule induces."""
    C = max_requests
    k_max = C if max_threads is None else min(max_threads, C)

    def step(frontier: IntArray) -> tuple[IntArray, FloatArray, IntArray]:
        s, pre, r = _events(model, layout, frontier, C)
        return _apply_rule(layout, pre, r, s, rule, k_max)

    return breadth_first(model, layout, step, max_requests=C, k_max=k_max, max_states=max_states)


#: one breadth-first step: the transitions out of ``frontier`` as (post-decision rows, rates,
#: index of each transition's source row in ``frontier``)
Step = Callable[[IntArray], tuple[IntArray, FloatArray, IntArray]]


def breadth_first(model: TandemModel, layout: Layout, step: Step, *, max_requests: int, k_max: int,
                  max_states: int) -> Chain:
    """The chain of the states ``step`` reaches from the empty system, uniformized at the rate of
    ``k_max`` threads (shared by :func:`build_chain` and the observation chains of
    :mod:`overtake.mdp.observation`)."""
    Q, D = layout.n_queues, model.n_coords
    C = max_requests
    ranker = Ranker(Q + D, C)
    lam_u = uniformization_rate(model, k_max)
    zero = np.zeros((1, Q + D), dtype=np.int64)
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
        # merge two sorted runs (timsort: linear); np.union1d's hash-based unique is ~20x slower here
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
    S = rows.shape[0]
    out = np.bincount(src, weights=rate, minlength=S)
    ar = np.arange(S)
    P = sp.csr_matrix(
        (np.concatenate([rate / lam_u, 1.0 - out / lam_u]), (np.concatenate([src, ar]), np.concatenate([dst, ar]))),
        shape=(S, S),
    )
    P.sum_duplicates()
    return Chain(rows, P, layout, C)
