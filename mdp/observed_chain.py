"""A rule on observations evaluated on the chain it reaches, as a sidecar enforces it.

:func:`observed_chain` builds, breadth-first from the empty system, the chain of any rule that
reads observation rows (:func:`~overtake.mdp.observation.observe`): the rule is asked once per
observation-changing event and its answer started at once. Unlike the tables of
:class:`~overtake.mdp.observation.ObservationSpace`, a rule may start threads into a full lock
(Apache's π(∞)): they block, holding their thread. :func:`observed_law` gives the exact metrics and
the stationary law, which warm-starts a similar rule's solve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .chain import Chain, breadth_first
from .evaluate import PolicyMetrics, metrics, stationary_distribution
from .lock import Locks
from .model import TandemModel
from .observation import ObservedRule, observe, spawn_vector
from .statespace import Layout, Ranker, transitions

__all__ = ["ChainLaw", "evaluate_observed", "observed_chain", "observed_law"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def observed_chain(model: TandemModel, layout: Layout, rule: ObservedRule, *, max_requests: int,
                   max_threads: int | None = None, max_states: int = 3_000_000) -> Chain:
    """Breadth-first chain of a rule on observation rows, from the empty system (reachable states only).

    As :func:`overtake.mdp.chain.build_chain`, but the rule is asked once per observation-changing
    event and its answer started at once (phases drawn per queue prior), as a sidecar enforces it.
    With locks the rows carry blocked threads (:mod:`overtake.mdp.lock`): a thread the rule starts
    into a full lock blocks, holding its thread (the rule sees it among the stage's threads).
    """
    Q = layout.n_queues
    C = max_requests
    k_max = C if max_threads is None else min(max_threads, C)
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


@dataclass(frozen=True, eq=False)
class ChainLaw:
    """A chain's stationary law by state: the states' ranks (sorted, :class:`Ranker` over the
    chain's rows at its request cap) and their probabilities; warm-starts a similar rule's solve."""

    cap: int
    keys: IntArray
    probs: FloatArray


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
    cap, starts the iterative stationary solve (its states matched by rank, 0 elsewhere): the
    answer meets the same residual test either way."""
    ch = observed_chain(model, layout, rule, max_requests=max_requests, max_threads=max_threads,
                        max_states=max_states)
    ranker = Ranker(ch.rows.shape[1], max_requests)
    keys = ranker.rank(ch.rows)
    x0 = None
    if warm is not None and warm.cap == max_requests and warm.keys.size:
        pos = np.minimum(np.searchsorted(warm.keys, keys), warm.keys.size - 1)
        x0 = np.where(warm.keys[pos] == keys, warm.probs[pos], 0.0)
    reach, pi = stationary_distribution(ch.P, x0=x0)
    order = np.argsort(keys[reach])
    law = ChainLaw(max_requests, keys[reach][order], pi[order])
    return metrics(model, ch.rows[reach], layout.queue_stage, pi, max_requests), law
