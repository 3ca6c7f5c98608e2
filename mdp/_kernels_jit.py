"""The solver's inner loops as numba JIT kernels (cached on disk); :mod:`overtake.mdp._kernels`
runs them, or their ahead-of-time build from the same source.

The box minimum and fused relative value iteration are plain loops over precomputed index
arrays (built by :class:`overtake.mdp.bellman.ActionIndex`), so one RVI sweep touches each
state's spawn neighbours and event-matrix row once, without the temporaries a vectorised numpy
sweep allocates.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def box_minimum(V, idle, order, nb, tol, G, A):  # type: ignore[no-untyped-def]
    """G(y) = min of V over y's spawn box, A(y) its argmin (bellman.py's suffix-minimum DP).

    ``order``/``nb`` list, queue after queue, each state with its one-more-thread neighbour,
    neighbours first (higher thread level), so a suffix minimum is read only once complete.
    Idle post-decision states are excluded (G = inf there before the passes). The updates are
    selects, not branches: which neighbour wins is data-dependent and a mispredicted branch per
    pair made this pass 2.4x slower (case 8, 96,075 states, 195,660 pairs).
    """
    n = V.size
    for s in range(n):
        G[s] = np.inf if idle[s] else V[s]
        A[s] = s
    for t in range(order.size):
        s = order[t]
        j = nb[t]
        gj = G[j]
        gs = G[s]
        better = gj < gs - tol
        G[s] = gj if better else gs
        A[s] = A[j] if better else A[s]


@numba.njit(cache=True, nogil=True)
def box_value(V, idle, order, nb, G):  # type: ignore[no-untyped-def]
    """G of :func:`box_minimum` without the argmin: what a Bellman step needs (5x faster, no
    branch and no second array; the decision is taken once, after the iteration)."""
    n = V.size
    for s in range(n):
        G[s] = np.inf if idle[s] else V[s]
    for t in range(order.size):
        s = order[t]
        G[s] = min(G[s], G[nb[t]])


@numba.njit(cache=True, nogil=True)
def bellman_step(indptr, indices, data, cost, V, idle, order, nb, G, TV):  # type: ignore[no-untyped-def]
    """One Bellman step TV = cost + P_E·H(V) into the caller's buffers; returns (min, max) of TV − V.

    The allocation-free single sweep the accelerated solvers call once per iteration.
    """
    n = V.size
    box_value(V, idle, order, nb, G)
    lo = np.inf
    hi = -np.inf
    for x in range(n):
        acc = cost[x]
        for t in range(indptr[x], indptr[x + 1]):
            acc += data[t] * G[indices[t]]
        TV[x] = acc
        d = acc - V[x]
        if d < lo:
            lo = d
        if d > hi:
            hi = d
    return lo, hi


@numba.njit(cache=True, nogil=True)
def rvi_sweeps(indptr, indices, data, cost, V, idle, order, nb, max_sweeps, tol):  # type: ignore[no-untyped-def]
    """Up to ``max_sweeps`` sweeps V ← TV − TV(0); stops when span(TV − V) ≤ tol·|max(TV − V)|.

    Returns (sweeps done, min(TV − V), max(TV − V), converged). ``V`` is updated in place.
    """
    n = V.size
    G = np.empty(n)
    TV = np.empty(n)
    lo = 0.0
    hi = 0.0
    for it in range(1, max_sweeps + 1):
        lo, hi = bellman_step(indptr, indices, data, cost, V, idle, order, nb, G, TV)
        ref = TV[0]
        for x in range(n):
            V[x] = TV[x] - ref
        if hi - lo <= tol * max(abs(hi), 1e-12):
            return it, lo, hi, True
    return max_sweeps, lo, hi, False


@numba.njit(cache=True, nogil=True)
def rank_rows(rows, table, cap, key):  # type: ignore[no-untyped-def]
    """Lexicographic rank of each row among vectors with sum ≤ cap (statespace.Ranker); False if a row exceeds cap.

    ``table[r, b]`` = C(b + r, r), the number of vectors of length r with sum ≤ b.
    """
    n, L = rows.shape
    ok = True
    for i in range(n):
        budget = cap
        k = 0
        for col in range(L):
            v = rows[i, col]
            if v > 0:
                b = budget if budget > 0 else 0
                lo = b - v if b - v > 0 else 0
                k += table[L - col, b] - table[L - col, lo]
            budget -= v
        if budget < 0:
            ok = False
        key[i] = k
    return ok


@numba.njit(cache=True, nogil=True)
def trim_longest(w, excess):  # type: ignore[no-untyped-def]
    """policy._trim_longest's loop itself, per row: take ``excess[i]`` requests one at a time from
    the longest queue of row i (lowest index on ties), in place."""
    m, Q = w.shape
    for i in range(m):
        for _ in range(excess[i]):
            best = 0
            for q in range(1, Q):
                if w[i, q] > w[i, best]:
                    best = q
            w[i, best] -= 1


@numba.njit(cache=True, nogil=True)
def gauss_seidel(indptr, indices, data, diag, x, sweeps):  # type: ignore[no-untyped-def]
    """In-place Gauss–Seidel sweeps for xᵀ = xᵀP (P in CSC), x[0] held fixed."""
    n = x.size
    for _ in range(sweeps):
        for j in range(1, n):
            acc = 0.0
            for t in range(indptr[j], indptr[j + 1]):
                i = indices[t]
                if i != j:
                    acc += x[i] * data[t]
            x[j] = acc / (1.0 - diag[j])
    return x


@numba.njit(cache=True, nogil=True)
def anderson_history(x, f, x_old, f_old, df, dxf, head, k, both):  # type: ignore[no-untyped-def]
    """One pass of the Anderson step (anderson.py): store Δf = f − f_old and Δx + Δf in row ``head``,
    and both[j] = (Δf_j·Δf_head, Δf_j·f) for the first ``k`` rows — the Gram row and the right side."""
    n = x.size
    for i in range(n):
        d = f[i] - f_old[i]
        df[head, i] = d
        dxf[head, i] = x[i] - x_old[i] + d
    # then one contiguous pass per stored row (the same sums in the same order as interleaving the
    # rows per entry, which strides across rows and measured 1.2-1.7x slower on 96,075 states)
    new = df[head]
    for j in range(k):
        row = df[j]
        s0 = 0.0
        s1 = 0.0
        for i in range(n):
            v = row[i]
            s0 += v * new[i]
            s1 += v * f[i]
        both[j, 0] = s0
        both[j, 1] = s1


@numba.njit(cache=True, nogil=True)
def anderson_mix(x, f, dxf, gamma, out):  # type: ignore[no-untyped-def]
    """out = x + f − Σ_j γ_j (Δx_j + Δf_j), one pass over the history (anderson.py)."""
    n = x.size
    k = gamma.size
    for i in range(n):
        acc = x[i] + f[i]
        for j in range(k):
            acc -= gamma[j] * dxf[j, i]
        out[i] = acc
