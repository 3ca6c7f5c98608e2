"""Truncated state spaces of the tandem and their transition structure (van der Weij et al., "Dynamic thread assignment", §2).

A state is a vector ``(w_0..w_{Q-1}, k_0..k_{D-1})``: ``w_q`` requests *waiting* in queue ``q``
and ``k_d`` active threads in coordinate ``d`` = (stage, phase). The paper's ``n_j^{(i)}`` is
``w + k`` of that coordinate. Two queue layouts:

* ``full`` (the paper's): one queue per coordinate — a waiting request's phase is known, so
  spawning from queue (i, j) starts a thread in coordinate (i, j).
* ``start``: one queue per stage — a waiting request's phase is unknown; it is drawn from α_i
  when its thread starts (what a sidecar without a classifier can enforce).
* ``none``: the chain of ``start``; the policy sees only counts per stage
  (:mod:`overtake.mdp.observation`). ``route``: one queue per (stage, route class), each with
  its own start-phase prior (:mod:`overtake.mdp.routes` builds that layout).

Truncation: at most ``C`` requests in the system (arrivals finding C are blocked) and at most
``K_max`` threads. States are ranked by their lexicographic rank among all vectors with sum ≤ C,
an exact, collision-free int64 key used for every index lookup.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from math import comb
from typing import Literal

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .errors import TruncationError
from .lock import Locks
from .model import TandemModel, exit_law

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
PhaseInfo = Literal["full", "start", "none", "route"]

_RANK_KERNEL_ROWS = 20_000
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


@dataclass(frozen=True, eq=False)
class Layout:
    """How waiting requests are queued and what spawning a thread from a queue does.

    ``entry[i]`` lists (queue, probability) for a request entering stage ``i``;
    ``spawn[a]`` lists (coordinate, probability) for spawn action ``a``, which starts a thread for
    a request of queue ``action_queue[a]`` (``None``: action ``a`` is queue ``a``'s one action).
    Several actions on one queue let the controller choose what the thread becomes — the CPU
    class it starts in (:func:`overtake.mdp.priority_classes.class_action_layout`).
    ``handoff[d]`` (coupled models, :attr:`TandemModel.routing`): the (queue, probability) list of
    a request leaving coordinate ``d`` for the next stage, in place of that stage's ``entry``.
    """

    phase_info: PhaseInfo
    queue_stage: IntArray
    entry: tuple[tuple[tuple[int, float], ...], ...]
    spawn: tuple[tuple[tuple[int, float], ...], ...]
    action_queue: IntArray | None = None
    handoff: tuple[tuple[tuple[int, float], ...], ...] | None = None

    def next_entry(self, model: TandemModel, d: int) -> tuple[tuple[int, float], ...]:
        """Where a request leaving coordinate ``d`` waits at the next stage: (queue, probability)."""
        if self.handoff is not None:
            return self.handoff[d]
        return self.entry[int(model.coord_stage()[d]) + 1]

    def __post_init__(self) -> None:
        n = self.queue_stage.size
        if self.action_queue is None:
            if len(self.spawn) != n:
                raise ValueError(f"layout: {len(self.spawn)} spawn entries for {n} queues; give action_queue")
        elif (self.action_queue.size != len(self.spawn) or self.action_queue.min(initial=0) < 0
              or self.action_queue.max(initial=0) >= n or np.unique(self.action_queue).size != n):
            raise ValueError("layout: action_queue must name a queue (0..n_queues-1) per spawn action, "
                             "every queue at least once")

    @property
    def n_queues(self) -> int:
        return int(self.queue_stage.size)

    @property
    def n_actions(self) -> int:
        return len(self.spawn)

    @property
    def queue_of_action(self) -> IntArray:
        """The queue each spawn action draws its request from."""
        if self.action_queue is None:
            return np.arange(self.n_queues, dtype=np.int64)
        return self.action_queue

    def first_action(self, q: int) -> int:
        """Queue ``q``'s first spawn action (the one a projection or a work estimate uses)."""
        return int(np.flatnonzero(self.queue_of_action == q)[0])

    @property
    def deterministic(self) -> bool:
        """True when each queue has one spawn action that starts a known coordinate (``full``)."""
        return self.action_queue is None and all(len(s) == 1 for s in self.spawn)

    @staticmethod
    def build(model: TandemModel, phase_info: PhaseInfo = "full") -> Layout:
        entry: tuple[tuple[tuple[int, float], ...], ...]
        spawn: tuple[tuple[tuple[int, float], ...], ...]
        if phase_info == "full":
            qs = model.coord_stage()
            entry = tuple(
                tuple((model.coord(i, j), float(p)) for j, p in enumerate(st.alpha) if p > 0)
                for i, st in enumerate(model.stages)
            )
            spawn = tuple(((d, 1.0),) for d in range(model.n_coords))
        elif phase_info in ("start", "none"):
            # ``none`` keeps the chain of ``start``: only what the policy may look at differs
            qs = np.arange(model.n_stages)
            entry = tuple(((i, 1.0),) for i in range(model.n_stages))
            spawn = tuple(
                tuple((model.coord(i, j), float(p)) for j, p in enumerate(st.alpha) if p > 0)
                for i, st in enumerate(model.stages)
            )
        elif phase_info == "route":
            raise ValueError("phase_info 'route' needs the route split: build it with RouteSplit.layout(model)")
        else:
            raise ValueError(f"phase_info must be 'full', 'start', 'none' or 'route', got {phase_info!r}")
        if model.coupled:
            return _coupled_layout(model, phase_info, np.asarray(qs, dtype=np.int64), entry, spawn)
        return Layout(phase_info, np.asarray(qs, dtype=np.int64), entry, spawn)


def _coupled_layout(model: TandemModel, phase_info: PhaseInfo, qs: IntArray,
                    entry: tuple[tuple[tuple[int, float], ...], ...],
                    spawn: tuple[tuple[tuple[int, float], ...], ...]) -> Layout:
    """The layout of a coupled model (:attr:`TandemModel.routing`), the smallest exact one.

    ``full``: the queues of the independent layout; a request leaving (i, j) waits in the queue of
    its start phase l at stage i + 1, drawn from R_i[j] (the start phase is all the rest of its
    path depends on). Phase-blind layouts: stage 1 keeps one queue; stage i + 1 has one queue per
    distinct row of R_i among the phases that exit (requests of one row are interchangeable), its
    spawn drawing from that row. Independent routing gives one row per stage: today's layout.
    """
    if phase_info == "full":
        handoff = tuple(
            tuple((model.coord(i + 1, l), float(p)) for l, p in enumerate(model.start_law(i, j)) if p > 0)
            if i + 1 < model.n_stages else ()
            for i, st in enumerate(model.stages) for j in range(st.phases))
        return Layout(phase_info, qs, entry, spawn, handoff=handoff)
    q_stage: list[int] = [0]
    new_spawn: list[tuple[tuple[int, float], ...]] = [spawn[0]]
    new_entry: list[tuple[tuple[int, float], ...]] = [((0, 1.0),)]
    hand: list[tuple[tuple[int, float], ...]] = []
    for i, st in enumerate(model.stages):
        if i + 1 == model.n_stages:
            hand.extend(() for _ in range(st.phases))
            continue
        rows: list[tuple[float, ...]] = []
        for j in range(st.phases):
            row = tuple(float(p) for p in model.start_law(i, j))
            if st.exit_rates[j] > 0 and row not in rows:
                rows.append(row)
        first = len(q_stage)
        for row in rows:
            q_stage.append(i + 1)
            new_spawn.append(tuple((model.coord(i + 1, l), p) for l, p in enumerate(row) if p > 0))
        law = exit_law(st)
        new_entry.append(tuple((first + r, float(sum(law[j] for j in range(st.phases)
                                                    if tuple(float(p) for p in model.start_law(i, j)) == row)))
                               for r, row in enumerate(rows)))
        for j in range(st.phases):
            row = tuple(float(p) for p in model.start_law(i, j))
            hand.append(((first + rows.index(row), 1.0),) if row in rows else ())
    return Layout(phase_info, np.asarray(q_stage, dtype=np.int64), tuple(new_entry), tuple(new_spawn),
                  handoff=tuple(hand))


class Ranker:
    """Exact rank of an integer vector of length L with sum ≤ C in lexicographic order."""

    def __init__(self, length: int, cap: int) -> None:
        self.length = length
        self.cap = cap
        total = comb(cap + length, length)
        if total >= 2**62:
            raise TruncationError(
                f"truncation.max_requests = {cap} with {length} state components is too large "
                f"to index ({total:.3g} vectors); lower max_requests or max_threads"
            )
        # N[r, b] = #vectors of length r with sum <= b = C(b + r, r)
        n = np.zeros((length + 2, cap + 1), dtype=np.int64)
        for r in range(length + 2):
            for b in range(cap + 1):
                n[r, b] = comb(b + r, r)
        self.counts = n
        self._n_list = [[int(x) for x in r] for r in n]

    def rank_one(self, row: list[int]) -> int:
        """:meth:`rank` of one vector in plain Python: a few µs, for per-request lookups."""
        n = self._n_list
        L = self.length
        budget = self.cap
        key = 0
        for col, v in enumerate(row):
            if v > 0:
                r = L - col
                key += n[r][budget] - n[r][budget - v]
            budget -= v
        if budget < 0:
            raise IndexError("a row exceeds the truncation's request cap")
        return key

    def rank(self, rows: IntArray) -> IntArray:
        """Ranks of many rows; IndexError if a row exceeds the cap.

        One compiled pass for many rows or once the kernels are loaded anyway (by a large solve);
        column-by-column numpy otherwise, so small scenarios start without loading them.
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.ndim == 1:
            rows = rows[None, :]
        if rows.shape[0] >= _RANK_KERNEL_ROWS or "numba" in sys.modules or "overtake.mdp._kernels" in sys.modules:
            from . import _kernels

            key = np.empty(rows.shape[0], dtype=np.int64)
            if not _kernels.rank_rows(rows, self.counts, self.cap, key):
                raise IndexError("a row exceeds the truncation's request cap")
            return key
        budget = np.full(rows.shape[0], self.cap, dtype=np.int64)
        key = np.zeros(rows.shape[0], dtype=np.int64)
        L = self.length
        for col in range(L):
            v = rows[:, col]
            r = L - col - 1
            # vectors sharing the prefix with a smaller value here: N[r+1][b] - N[r+1][b-v]
            b = np.maximum(budget, 0)
            key += np.where(v > 0, self.counts[r + 1, b] - self.counts[r + 1, np.maximum(b - v, 0)], 0)
            budget = budget - v
        if np.any(budget < 0):
            raise IndexError("a row exceeds the truncation's request cap")
        return key


def transitions(
    model: TandemModel,
    layout: Layout,
    rows: IntArray,
    cap: int,
    index: Callable[[IntArray], IntArray] | None = None,
) -> tuple[IntArray, IntArray, FloatArray]:
    """Transitions out of post-decision states: (source row number, destination row, rate).

    Implements the rates of the MDP's operator T (§2): arrivals λα_1, phase moves
    k_j μ_j p_jl · c(K)/K, completions k_j μ_j p_j,M+1 · c(K)/K routed to stage i+1's entry.
    Blocked arrivals and uniformization self-loops are left to the caller. With ``index`` the
    destinations are returned as ``index(rows)``, computed per event type, so the destination rows
    of all events (8 words an event) never exist at once — what lets 10⁷ states fit in 8 GB.
    """
    Q = layout.n_queues
    S = rows.shape[0]
    n_tot = rows.sum(axis=1)
    QD = Q + model.n_coords
    locks = Locks.build(model, Q) if rows.shape[1] > QD else None
    # blocked threads (columns past QD, :mod:`overtake.mdp.lock`) take no share of the processor
    K = rows[:, Q:QD].sum(axis=1)
    if model.weights is None:  # processor sharing: c(K)/K each
        per_thread = np.where(K > 0, model.capacity(K) / np.maximum(K, 1), 0.0)
        w_of = np.ones(model.n_coords)
    else:  # weighted sharing: c(K)·w_d / Σ k_d' w_d' each
        w_of = np.asarray(model.weights)
        W = rows[:, Q:QD] @ w_of
        per_thread = np.where(W > 0, model.capacity(K) / np.where(W > 0, W, 1.0), 0.0)
    srcs: list[IntArray] = []
    dsts: list[IntArray] = []
    rates: list[FloatArray] = []

    def add(mask: npt.NDArray[np.bool_], moves: tuple[tuple[int, int], ...], rate: FloatArray) -> None:
        keep = np.flatnonzero(mask & (rate > 0))
        if keep.size:
            new_rows = rows[keep]
            for col, step in moves:
                new_rows[:, col] += step
            srcs.append(keep)
            dsts.append(new_rows if index is None else index(new_rows))
            rates.append(rate[keep])

    open_ = n_tot < cap
    for q, p in layout.entry[0]:
        add(open_, ((q, 1),), np.full(S, model.arrival_rate * p))
    for i, st in enumerate(model.stages):
        t_exit = st.exit_rates
        for j in range(st.phases):
            d = model.coord(i, j)
            kd = rows[:, Q + d]
            active = kd > 0
            base = kd * per_thread * w_of[d]
            for l in range(st.phases):
                if l != j and st.T[j, l] > 0:
                    add(active, ((Q + d, -1), (Q + model.coord(i, l), 1)), base * st.T[j, l])
            if t_exit[j] > 0:
                nexts = (tuple(((Q + d, -1), (q, 1)) for q, _ in layout.next_entry(model, d))
                         if i + 1 < model.n_stages else (((Q + d, -1),),))
                probs = tuple(p for _, p in layout.next_entry(model, d)) if i + 1 < model.n_stages else (1.0,)
                for moves, p in zip(nexts, probs, strict=True):
                    for extra, share in _handover(locks, rows, d):
                        add(active, moves + extra, base * t_exit[j] * p * share)
    if not srcs:
        empty = np.zeros(0, np.int64) if index is not None else np.zeros((0, rows.shape[1]), np.int64)
        return np.zeros(0, np.int64), empty, np.zeros(0)
    return np.concatenate(srcs), np.concatenate(dsts), np.concatenate(rates)


def _handover(locks: Locks | None, rows: IntArray, d: int) -> list[tuple[tuple[tuple[int, int], ...], FloatArray]]:
    """What else happens when a thread of coordinate ``d`` leaves its stage: (column moves, share of
    the rate) per outcome. In a locked stage with blocked threads one of them takes the lock,
    each with equal chance (:mod:`overtake.mdp.lock`); otherwise nothing."""
    if locks is None or locks.coord_twin[d] < 0:
        return [((), np.ones(rows.shape[0]))]
    twins = [int(c) for c in locks.stage_coords[d]]
    blocked = rows[:, [locks.twin_col(c) for c in twins]]
    B = blocked.sum(axis=1)
    out: list[tuple[tuple[tuple[int, int], ...], FloatArray]] = [((), (B == 0).astype(np.float64))]
    for t, c in enumerate(twins):
        out.append((((locks.twin_col(c), -1), (locks.n_queues + c, 1)), blocked[:, t] / np.maximum(B, 1)))
    return out


def event_tables(model: TandemModel, layout: Layout) -> tuple[IntArray, IntArray, FloatArray]:
    """:func:`transitions`' event types, in its order: (source coordinate or −1 for an arrival,
    column moves (col, step, col, step; col −1: none), the two rate factors)."""
    Q = layout.n_queues
    src: list[int] = []
    move: list[tuple[int, int, int, int]] = []
    fac: list[tuple[float, float]] = []
    for q, p in layout.entry[0]:
        src.append(-1)
        move.append((q, 1, -1, 0))
        fac.append((model.arrival_rate * p, 1.0))
    for i, st in enumerate(model.stages):
        t_exit = st.exit_rates
        for j in range(st.phases):
            d = model.coord(i, j)
            for l in range(st.phases):
                if l != j and st.T[j, l] > 0:
                    src.append(d)
                    move.append((Q + d, -1, Q + model.coord(i, l), 1))
                    fac.append((float(st.T[j, l]), 1.0))
            if t_exit[j] > 0:
                if i + 1 < model.n_stages:
                    for q, p in layout.next_entry(model, d):
                        src.append(d)
                        move.append((Q + d, -1, q, 1))
                        fac.append((float(t_exit[j]), float(p)))
                else:
                    src.append(d)
                    move.append((Q + d, -1, -1, 0))
                    fac.append((float(t_exit[j]), 1.0))
    return (np.array(src, dtype=np.int64), np.array(move, dtype=np.int64).reshape(-1, 4),
            np.array(fac, dtype=np.float64).reshape(-1, 2))


def share_tables(model: TandemModel, k_max: int) -> tuple[FloatArray, FloatArray]:
    """(per-thread share by thread count K, CPU weights) for the compiled event loops: c(K)/K and
    ones under processor sharing (:func:`transitions`' arithmetic), c(K) and the weights (divided by
    Σ k_d w_d per state) under weighted sharing."""
    Ks = np.arange(k_max + 1)
    if model.weights is None:
        share: FloatArray = np.asarray(np.where(Ks > 0, model.capacity(Ks) / np.maximum(Ks, 1), 0.0), dtype=np.float64)
        return share, np.ones(model.n_coords)
    return np.asarray(model.capacity(Ks), dtype=np.float64), np.asarray(model.weights, dtype=np.float64)


def uniformization_rate(model: TandemModel, k_max: int) -> float:
    """Λ = λ + max_K c(K) · max_j |T_jj|: an upper bound on every state's total outflow."""
    mu_max = max(float(np.max(-np.diag(st.T))) for st in model.stages)
    return model.arrival_rate + model.max_capacity(k_max) * mu_max


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
