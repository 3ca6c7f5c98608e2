"""A rule on observations evaluated on the chain it reaches, as a sidecar enforces it.

:func:`observed_chain` builds, breadth-first from the empty system, the chain of any rule that
reads observation rows (:func:`~overtake.mdp.observation.observe`): the rule is asked once per
observation-changing event and its answer started at once. Unlike the tables of
:class:`~overtake.mdp.observation.ObservationSpace`, a rule may start threads into a full lock
(Apache's π(∞)): they block, holding their thread. :func:`observed_law` gives the exact metrics and
the stationary law, which warm-starts a similar rule's solve.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .chain import Chain, breadth_first, compiled_search
from .evaluate import PolicyMetrics, chain_law, metrics
from .lock import Locks
from .model import TandemModel
from .observation import ObservedRule, observe
from .observation_actions import compositions, spawn_vector
from .policy import Policy
from .statespace import Layout, Ranker, event_tables, share_tables, transitions, uniformization_rate

__all__ = ["ChainLaw", "evaluate_observed", "observed_chain", "observed_law"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: multinomial outcomes the compiled search tabulates at most (beyond: the numpy search)
_MAX_OUTCOMES = 2_000_000


def observed_chain(model: TandemModel, layout: Layout, rule: ObservedRule, *, max_requests: int,
                   max_threads: int | None = None, max_states: int = 3_000_000, compiled: bool | None = None) -> Chain:
    """Breadth-first chain of a rule on observation rows, from the empty system (reachable states only).

    As :func:`overtake.mdp.chain.build_chain`, but the rule is asked once per observation-changing
    event and its answer started at once (phases drawn per queue prior), as a sidecar enforces it.
    With locks the rows carry blocked threads (:mod:`overtake.mdp.lock`): a thread the rule starts
    into a full lock blocks, holding its thread (the rule sees it among the stage's threads).

    An observation table's rule (:meth:`Policy.actions` of a ``none`` or ``route`` policy) on a
    model without locks is run by one compiled search (_observed_jit.observed_bfs) where the
    solver kernels load without numba or numba is loaded anyway: the same states in the same order
    and the same transition matrix (to rounding in sums of coinciding transitions) as the
    level-by-level numpy search below (tests/mdp/test_observed_chain_compiled.py). ``compiled``:
    True forces the compiled search (numba's JIT if need be), False the numpy one; None chooses as above.
    """
    Q = layout.n_queues
    C = max_requests
    k_max = C if max_threads is None else min(max_threads, C)
    if compiled is not False:
        chain = _compiled_chain(model, layout, rule, C, k_max, max_states, force=compiled is True)
        if chain is not None:
            return chain
    ranker = Ranker(Q + model.n_stages, C)
    locks = Locks.build(model, Q)

    def step(frontier: IntArray) -> tuple[IntArray, FloatArray, IntArray]:
        s, pre, r = transitions(model, layout, frontier, C)
        o_pre = observe(model, layout, pre)
        changed = np.any(o_pre != observe(model, layout, frontier)[s], axis=1)
        counts = np.zeros((pre.shape[0], Q), dtype=np.int64)
        if np.any(changed):
            # many transitions share an observation: ask the rule once per distinct one
            seen = o_pre[changed]
            _, first, inv = np.unique(ranker.rank(seen), return_index=True, return_inverse=True)
            want = np.asarray(rule(seen[first]), dtype=np.int64)[inv.ravel()]
            want = np.minimum(np.maximum(want, 0), pre[changed, :Q])
            room = np.maximum(k_max - pre[changed, Q:].sum(axis=1), 0)
            for q in range(Q - 1, -1, -1):  # the thread cap: later queues first
                take = np.minimum(want[:, q], room)
                want[:, q] = take
                room = room - take
            counts[changed] = want
        return spawn_vector(layout, pre, counts, r, s, locks if locks.n_twins else None)

    return breadth_first(model, layout, step, max_requests=C, k_max=k_max, max_states=max_states,
                         width=Q + model.n_coords + locks.n_twins)


def _compiled_chain(model: TandemModel, layout: Layout, rule: ObservedRule, C: int, k_max: int, max_states: int,
                    force: bool) -> Chain | None:
    """:func:`observed_chain` by _observed_jit.observed_bfs; None where that does not apply (or
    would import numba just for this, unless ``force``)."""
    pol = getattr(rule, "__self__", None)
    if (model.has_lock or layout.action_queue is not None or not isinstance(pol, Policy)
            or getattr(rule, "__func__", None) is not Policy.actions or not pol.observed or pol.model != model
            or pol.Q != layout.n_queues or pol.D != model.n_stages):
        return None
    from . import _kernels

    if not force and not _kernels.aot_active() and "numba" not in sys.modules:
        return None
    Q, L = layout.n_queues, layout.n_queues + model.n_coords
    sp_ptr = np.zeros(Q + 1, dtype=np.int64)
    comp_ptr = np.zeros((Q, k_max + 2), dtype=np.int64)
    comp_k: list[tuple[int, ...]] = []
    comp_p: list[float] = []
    width = max(len(layout.spawn[q]) for q in range(Q))
    for q in range(Q):
        sp_ptr[q + 1] = sp_ptr[q] + len(layout.spawn[q])
        probs = tuple(p for _, p in layout.spawn[q])
        for n in range(k_max + 1):  # spawn_vector's outcomes of n threads, in its order
            comp_ptr[q, n] = len(comp_p)
            for split, pr in compositions(n, probs):
                comp_k.append(split + (0,) * (width - len(split)))
                comp_p.append(pr)
            if len(comp_p) > _MAX_OUTCOMES:
                return None
        comp_ptr[q, k_max + 1] = len(comp_p)
    sp_coord = np.array([d for q in range(Q) for d, _ in layout.spawn[q]], dtype=np.int64)
    keys, dense, spawn = pol.lookup_tables()
    ev_src, ev_move, ev_f = event_tables(model, layout)
    per_thread, weights = share_tables(model, k_max)
    args = (Ranker(L, C).counts, C, k_max, max_states, ev_src, ev_move, ev_f, per_thread, weights,
            model.weights is not None, np.asarray(model.coord_stage(), dtype=np.int64), model.n_stages, sp_ptr,
            sp_coord, comp_ptr, np.array(comp_k, dtype=np.int64).reshape(-1, width), np.array(comp_p),
            keys, dense, spawn, pol.ranker.counts, int(pol.max_requests), int(pol.max_threads))
    return compiled_search(_kernels.observed_bfs, args, L, ev_src.size, C, max_states,
                           uniformization_rate(model, k_max), layout)


@dataclass(frozen=True, eq=False)
class ChainLaw:
    """A chain's stationary law by state: the states' ranks (sorted, :class:`Ranker` over the
    chain's rows at its request cap), their probabilities and their rows; warm-starts a similar
    rule's solve, or the same rule's on a larger cap."""

    cap: int
    keys: IntArray
    probs: FloatArray
    rows: IntArray | None = None

    def start(self, cap: int, keys: IntArray, rows: IntArray) -> FloatArray | None:
        """This law on the states ``rows`` (ranks ``keys`` at request cap ``cap``), 0 on those it
        lacks; None where it cannot be matched (another cap and no rows, or a larger cap)."""
        if not self.keys.size:
            return None
        if self.cap == cap:
            mine, probs = self.keys, self.probs
        elif self.rows is not None and self.cap < cap and self.rows.shape[1] == rows.shape[1]:
            mine = Ranker(rows.shape[1], cap).rank(self.rows)
            order = np.argsort(mine)
            mine, probs = mine[order], self.probs[order]
        else:
            return None
        pos = np.minimum(np.searchsorted(mine, keys), mine.size - 1)
        out: FloatArray = np.where(mine[pos] == keys, probs[pos], 0.0)
        return out


def evaluate_observed(
    model: TandemModel, layout: Layout, rule: ObservedRule, *, max_requests: int, max_threads: int | None = None,
    max_states: int = 3_000_000,
) -> PolicyMetrics:
    """Exact metrics of an observation rule on the chain it reaches within ``max_requests``."""
    return observed_law(model, layout, rule, max_requests=max_requests, max_threads=max_threads,
                        max_states=max_states)[0]


def observed_law(
    model: TandemModel, layout: Layout, rule: ObservedRule, *, max_requests: int, max_threads: int | None = None,
    max_states: int = 3_000_000, warm: ChainLaw | None = None,
) -> tuple[PolicyMetrics, ChainLaw]:
    """:func:`evaluate_observed` and the chain's law; ``warm``, a similar rule's law on the same
    cap or this rule's on a smaller one, starts the iterative stationary solve (its states matched
    by rank, 0 elsewhere): the answer meets the same residual test either way."""
    ch = observed_chain(model, layout, rule, max_requests=max_requests, max_threads=max_threads,
                        max_states=max_states)
    ranker = Ranker(ch.rows.shape[1], max_requests)
    keys = ranker.rank(ch.rows)
    x0 = None if warm is None else warm.start(max_requests, keys, ch.rows)
    reach, pi = chain_law(ch, x0)
    order = np.argsort(keys[reach])
    law = ChainLaw(max_requests, keys[reach][order], pi[order], ch.rows[reach][order])
    return metrics(model, ch.rows[reach], layout.queue_stage, pi, max_requests), law
