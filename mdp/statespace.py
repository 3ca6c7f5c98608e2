"""Truncated state spaces of the tandem and their transition structure (van der Weij et al., "Dynamic thread assignment", §2).

A state is a vector ``(w_0..w_{Q-1}, k_0..k_{D-1})``: ``w_q`` requests *waiting* in queue ``q``
and ``k_d`` active threads in coordinate ``d`` = (stage, phase). The paper's ``n_j^{(i)}`` is
``w + k`` of that coordinate. The queue layouts (:mod:`overtake.mdp.layout`):

* ``full`` (the paper's): one queue per coordinate — a waiting request's phase is known, so
  spawning from queue (i, j) starts a thread in coordinate (i, j).
* ``start``: one queue per stage — a waiting request's phase is unknown; it is drawn from α_i
  when its thread starts (what a sidecar without a classifier can enforce).
* ``none``: the chain of ``start``; the policy sees only counts per stage
  (:mod:`overtake.mdp.observation`). ``route``: one queue per (stage, route class), each with
  its own start-phase prior (:mod:`overtake.mdp.routes` builds that layout).

Truncation: at most ``C`` requests in the system (arrivals finding C are blocked) and at most
``K_max`` threads. States are ranked by their lexicographic rank among all vectors with sum ≤ C,
an exact, collision-free int64 key used for every index lookup (:mod:`overtake.mdp.ranking`);
their events and rates are :mod:`overtake.mdp.events`'.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from math import comb

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .errors import TruncationError
from .events import event_tables, share_tables, transitions, uniformization_rate
from .layout import Layout, PhaseInfo
from .lock import Locks
from .model import TandemModel
from .ranking import Ranker

# the layouts, ranks and events are imported from here by the modules built on the state space
__all__ = ["Layout", "PhaseInfo", "Ranker", "StateSpace", "Truncation", "count_states", "event_tables",
           "share_tables", "transitions", "uniformization_rate"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: the compiled event matrix finds destinations through a position per rank up to this many ranks
_DENSE_RANKS = 4_000_000


@dataclass(frozen=True)
class Truncation:
    """Caps that make the state space finite.

    Parameters
    ----------
    max_requests
        C: requests in the system at most; an arrival that finds C is blocked (lost).
    max_threads
        K_max: active threads at most (``None`` = C, i.e. no cap beyond the requests').
    """

    max_requests: int
    max_threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_requests, (int, np.integer)) or self.max_requests < 1:
            raise TruncationError(f"truncation.max_requests must be an integer >= 1, got {self.max_requests!r}")
        if self.max_threads is not None and (
            not isinstance(self.max_threads, (int, np.integer)) or self.max_threads < 1
        ):
            raise TruncationError(f"truncation.max_threads must be an integer >= 1, got {self.max_threads!r}")

    @property
    def k_max(self) -> int:
        return self.max_requests if self.max_threads is None else min(self.max_threads, self.max_requests)


def _enumerate(Q: int, D: int, cap: int, k_max: int) -> IntArray:
    """All (w, k) vectors with Σw + Σk ≤ C and Σk ≤ K_max, in lexicographic order."""
    rows = np.zeros((1, 0), dtype=np.int64)
    for col in range(Q + D):
        used = rows.sum(axis=1)
        used_k = rows[:, Q:].sum(axis=1) if col > Q else np.zeros(rows.shape[0], np.int64)
        room = cap - used
        if col >= Q:
            room = np.minimum(room, k_max - used_k)
        reps = room + 1
        base = np.repeat(rows, reps, axis=0)
        # values 0..room for each parent row, in order
        starts = np.cumsum(reps) - reps
        vals = np.arange(int(reps.sum()), dtype=np.int64) - np.repeat(starts, reps)
        rows = np.concatenate([base, vals[:, None]], axis=1)
    return rows


def count_states(model: TandemModel, trunc: Truncation, phase_info: PhaseInfo | Layout = "full") -> int:
    """Number of states of the truncated MDP, computed without enumerating them: with Q queues and D
    coordinates, Σ_{s ≤ K} C(s + D − 1, D − 1) · C(C − s + Q, Q). ``phase_info`` may be the layout
    itself (the ``route`` one, whose queues depend on the route split). With locks
    (:mod:`overtake.mdp.lock`) the space leaves out the states a full lock refuses: this is then
    an upper bound."""
    if isinstance(phase_info, Layout):
        Q = phase_info.n_queues
    elif phase_info == "route":
        raise ValueError("count_states: the route layout's queues depend on the route split; pass its layout")
    elif model.coupled:  # phase-blind layouts of a coupled model queue per routing row
        Q = Layout.build(model, phase_info).n_queues
    else:
        Q = model.n_coords if phase_info == "full" else model.n_stages
    D = model.n_coords
    C, km = trunc.max_requests, trunc.k_max
    return int(sum(comb(s + D - 1, D - 1) * comb(C - s + Q, Q) for s in range(0, km + 1)))


class StateSpace:
    """The full truncated MDP state space with its event matrix and spawn neighbours."""

    def __init__(
        self, model: TandemModel, trunc: Truncation, phase_info: PhaseInfo = "full", *, blocking_cost: bool = True,
        layout: Layout | None = None,
    ) -> None:
        self.model = model
        self.blocking_cost = blocking_cost
        self.trunc = trunc
        # an explicit layout (the ``route`` one) takes precedence over ``phase_info``
        self.layout = Layout.build(model, phase_info) if layout is None else layout
        self.Q = self.layout.n_queues
        self.D = model.n_coords
        self.cap = trunc.max_requests
        self.k_max = trunc.k_max
        self.ranker = Ranker(self.Q + self.D, self.cap)
        rows = _enumerate(self.Q, self.D, self.cap, self.k_max)
        if model.has_lock:
            # the policy starts a thread in a locked stage only while its lock has room
            # (:mod:`overtake.mdp.lock`): the states beyond are never reached
            rows = rows[Locks.build(model, self.Q).within(rows)]
        self.rows = rows
        self.keys = self.ranker.rank(self.rows)
        if np.any(np.diff(self.keys) <= 0):  # lexicographic enumeration ⇒ strictly increasing ranks
            raise AssertionError("state enumeration is not in rank order")
        self.size = int(self.rows.shape[0])
        self.n_total = self.rows.sum(axis=1)
        self.threads = self.rows[:, self.Q :].sum(axis=1)
        self.rate = uniformization_rate(model, self.k_max)

    def index(self, rows: IntArray) -> IntArray:
        """Index of each row in this space (rows must lie inside the truncation)."""
        keys = self.ranker.rank(rows)
        idx = np.searchsorted(self.keys, keys)
        idx = np.minimum(idx, self.size - 1)
        bad = self.keys[idx] != keys
        if np.any(bad):
            raise IndexError("row outside the state space")
        return idx.astype(np.int64)

    def find(self, rows: IntArray) -> IntArray:
        """Like :meth:`index` but −1 for rows outside the truncation."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.full(rows.shape[0], -1, dtype=np.int64)
        ok = (rows.min(axis=1) >= 0) & (rows.sum(axis=1) <= self.cap) & (rows[:, self.Q :].sum(axis=1) <= self.k_max)
        if np.any(ok):
            keys = self.ranker.rank(rows[ok])
            idx = np.minimum(np.searchsorted(self.keys, keys), self.size - 1)
            hit = self.keys[idx] == keys
            sub = np.where(hit, idx, -1)
            out[ok] = sub
        return out

    @cached_property
    def event_matrix(self) -> sp.csr_matrix:
        """Uniformized transition matrix P_E (rows: post-decision, columns: pre-decision states).

        Built by one compiled pass per row (_kernels_jit.event_rows) where the solver kernels load
        without numba (or numba is loaded anyway): the same matrix bit for bit, its rows' rates
        summed in :func:`transitions`' order (tests/mdp/test_chain_compiled.py), without the event
        arrays the numpy construction below holds at once.
        """
        compiled = self.compiled_event_matrix()
        if compiled is not None:
            return compiled
        src, dst, rate = transitions(self.model, self.layout, self.rows, self.cap, self.index)
        out = np.bincount(src, weights=rate, minlength=self.size)
        if np.any(out > self.rate * (1 + 1e-12)):
            raise AssertionError("uniformization rate below a state's outflow")
        ar = np.arange(self.size)
        data = np.concatenate([rate / self.rate, 1.0 - out / self.rate])
        del rate, out
        src = np.concatenate([src, ar])
        dst = np.concatenate([dst, ar])
        P = sp.csr_matrix((data, (src, dst)), shape=(self.size, self.size))
        del data, src, dst
        P.sum_duplicates()
        return P

    def compiled_event_matrix(self, force: bool = False) -> sp.csr_matrix | None:
        from . import _kernels

        if not force and not _kernels.aot_active() and "numba" not in sys.modules:
            return None
        ev_src, ev_move, ev_f = event_tables(self.model, self.layout)
        share, weights = share_tables(self.model, self.k_max)
        total = int(self.ranker.counts[self.ranker.length, self.cap])  # ranks of every vector with sum <= cap
        dense = np.zeros(0, dtype=np.int32)
        if total <= _DENSE_RANKS:
            dense = np.full(total, -1, dtype=np.int32)
            dense[self.keys] = np.arange(self.size, dtype=np.int32)
        S = self.size
        args = (self.rows, self.keys, dense, self.ranker.counts, self.cap, ev_src, ev_move, ev_f, share, weights,
                self.model.weights is not None, float(self.rate))
        wide = S * (ev_src.size + 1) >= 2**31 - 1
        index_dtype = np.int64 if wide else np.int32
        indptr = np.zeros(S + 1, dtype=index_dtype)
        none_i, none_f = np.zeros(0, dtype=index_dtype), np.zeros(0)
        _kernels.event_rows(*args, False, indptr, none_i, none_f, none_f)
        np.cumsum(indptr, out=indptr)
        nnz = int(indptr[-1])
        indices = np.empty(nnz, dtype=index_dtype)
        data = np.empty(nnz)
        out = np.empty(S)
        bad = int(_kernels.event_rows(*args, True, indptr, indices, data, out))
        if bad >= 0:
            raise IndexError("row outside the state space")
        if np.any(out > self.rate * (1 + 1e-12)):
            raise AssertionError("uniformization rate below a state's outflow")
        P = sp.csr_matrix((data, indices, indptr), shape=(S, S))
        P.has_sorted_indices = True
        return P

    @cached_property
    def spawn_neighbours(self) -> list[list[tuple[IntArray, float]]]:
        """For spawn action a (queue a, or ``layout.action_queue[a]``): [(index of the state after
        starting one thread in coordinate d, prob)].

        −1 where no request waits in the action's queue or the thread cap is reached.
        """
        out: list[list[tuple[IntArray, float]]] = []
        can = self.threads < self.k_max
        for a, q in enumerate(self.layout.queue_of_action):
            lst = []
            ok = can & (self.rows[:, q] > 0)
            for d, p in self.layout.spawn[a]:
                nb = np.full(self.size, -1, dtype=np.int64)
                if np.any(ok):
                    nr = self.rows[ok].copy()
                    nr[:, q] -= 1
                    nr[:, self.Q + d] += 1
                    # find: a start a full lock refuses is no action (−1)
                    nb[ok] = self.find(nr) if self.model.has_lock else self.index(nr)
                lst.append((nb, p))
            out.append(lst)
        return out

    @cached_property
    def cost(self) -> FloatArray:
        """Cost rate c(x): requests in the system, plus λ·r(x) where arrivals are blocked.

        The paper (§2) charges c(x) = n(x) only. On a truncated space that lets an optimum gain by
        blocking: states near the cap look cheap because arrivals there vanish. With
        ``blocking_cost`` each blocked arrival is charged r(x) = (W(x) + E[S]) / (1 − ρ), where W(x)
        is the remaining work of everything present (through all its stages, at full capacity):
        the marginal cost of one more request in an M/M/1 queue, h(n + 1) − h(n) = (n + 1)/(μ − λ),
        written in work. With it the exponential tandem's truncated optimum is π(1) already at
        C = 6 (tests/mdp/test_solve.py), and H2 optima at C = 10 are within 0.01% of C = 23's
        (BENCHMARKS.md); auto-truncation checks the rest. Without it, c(x) = n(x) exactly. Coupled
        stages (:attr:`TandemModel.routing`) keep the stages' mean work downstream: a correction
        at the cap only, and with it independent routing is today's chain bit for bit.
        """
        n: FloatArray = self.n_total.astype(np.float64)
        if not self.blocking_cost:
            return n
        m = self.model
        downstream = [sum(st.mean() for st in m.stages[i + 1 :]) for i in range(m.n_stages)]
        coord_work = np.concatenate(
            [st.phase_means() + downstream[i] for i, st in enumerate(m.stages)]
        )
        queue_work = np.array([
            sum(p * coord_work[d] for d, p in self.layout.spawn[self.layout.first_action(q)]) for q in range(self.Q)
        ])
        work = self.rows[:, : self.Q] @ queue_work + self.rows[:, self.Q :] @ coord_work
        r = (work / m.max_capacity(self.k_max) + m.mean_service()) / (1.0 - m.load)
        cost: FloatArray = n + np.where(self.blocked, m.arrival_rate * r, 0.0)
        return cost

    @cached_property
    def blocked(self) -> npt.NDArray[np.bool_]:
        """States in which an arrival is blocked by the truncation."""
        full: npt.NDArray[np.bool_] = self.n_total >= self.cap
        return full

    def requests_per_stage(self) -> IntArray:
        """Matrix (S, N): requests present at each stage."""
        N = self.model.n_stages
        out = np.zeros((self.size, N), dtype=np.int64)
        for q in range(self.Q):
            out[:, self.layout.queue_stage[q]] += self.rows[:, q]
        cs = self.model.coord_stage()
        for d in range(self.D):
            out[:, cs[d]] += self.rows[:, self.Q + d]
        return out
