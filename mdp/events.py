"""A state's events and their rates: the transitions out of post-decision states of the tandem
(van der Weij et al., "Dynamic thread assignment", §2), the event types the compiled loops
replay, the processor's per-thread shares, and the uniformization rate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from .layout import Layout
from .lock import Locks
from .model import TandemModel

__all__ = ["event_tables", "share_tables", "transitions", "uniformization_rate"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


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
    per_thread, w_of = _thread_speeds(model, rows, Q)
    ev = _Events(rows, index)
    open_ = n_tot < cap
    for q, p in layout.entry[0]:
        ev.add(open_, ((q, 1),), np.full(S, model.arrival_rate * p))
    for i, st in enumerate(model.stages):
        t_exit = st.exit_rates
        for j in range(st.phases):
            d = model.coord(i, j)
            kd = rows[:, Q + d]
            active = kd > 0
            base = kd * per_thread * w_of[d]
            for l in range(st.phases):
                if l != j and st.T[j, l] > 0:
                    ev.add(active, ((Q + d, -1), (Q + model.coord(i, l), 1)), base * st.T[j, l])
            if t_exit[j] > 0:
                nexts = (tuple(((Q + d, -1), (q, 1)) for q, _ in layout.next_entry(model, d))
                         if i + 1 < model.n_stages else (((Q + d, -1),),))
                probs = tuple(p for _, p in layout.next_entry(model, d)) if i + 1 < model.n_stages else (1.0,)
                for moves, p in zip(nexts, probs, strict=True):
                    for extra, share in _handover(locks, rows, d):
                        ev.add(active, moves + extra, base * t_exit[j] * p * share)
    return ev.arrays()


def _thread_speeds(model: TandemModel, rows: IntArray, Q: int) -> tuple[FloatArray, FloatArray]:
    """Per state, the service rate of one thread of weight 1, and the coordinates' weights: c(K)/K
    each under processor sharing, c(K)·w_d / Σ k_d' w_d' under weighted sharing. Blocked threads
    (columns past the coordinates, :mod:`overtake.mdp.lock`) take no share of the processor."""
    QD = Q + model.n_coords
    K = rows[:, Q:QD].sum(axis=1)
    if model.weights is None:  # processor sharing: c(K)/K each
        per_thread = np.where(K > 0, model.capacity(K) / np.maximum(K, 1), 0.0)
        w_of = np.ones(model.n_coords)
    else:  # weighted sharing: c(K)·w_d / Σ k_d' w_d' each
        w_of = np.asarray(model.weights)
        W = rows[:, Q:QD] @ w_of
        per_thread = np.where(W > 0, model.capacity(K) / np.where(W > 0, W, 1.0), 0.0)
    return per_thread, w_of


class _Events:
    """The transitions collected event type by event type; with ``index`` each type's destination
    rows are mapped to row numbers as they come (they never exist for all events at once)."""

    def __init__(self, rows: IntArray, index: Callable[[IntArray], IntArray] | None) -> None:
        self.rows, self.index = rows, index
        self.srcs: list[IntArray] = []
        self.dsts: list[IntArray] = []
        self.rates: list[FloatArray] = []

    def add(self, mask: npt.NDArray[np.bool_], moves: tuple[tuple[int, int], ...], rate: FloatArray) -> None:
        """The event that applies ``moves`` to the rows where ``mask`` holds and ``rate`` is positive."""
        keep = np.flatnonzero(mask & (rate > 0))
        if keep.size:
            new_rows = self.rows[keep]
            for col, step in moves:
                new_rows[:, col] += step
            self.srcs.append(keep)
            self.dsts.append(new_rows if self.index is None else self.index(new_rows))
            self.rates.append(rate[keep])

    def arrays(self) -> tuple[IntArray, IntArray, FloatArray]:
        """(source row numbers, destinations, rates), empty arrays of the right shapes when no event."""
        if not self.srcs:
            empty = np.zeros(0, np.int64) if self.index is not None else np.zeros((0, self.rows.shape[1]), np.int64)
            return np.zeros(0, np.int64), empty, np.zeros(0)
        return np.concatenate(self.srcs), np.concatenate(self.dsts), np.concatenate(self.rates)


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
