"""The solver's inner loops as numba JIT kernels (cached on disk); :mod:`overtake.mdp._kernels`
runs them, or their ahead-of-time build from the same source.

The box minimum and fused relative value iteration are plain loops over precomputed index
arrays (built by :class:`overtake.mdp.bellman.ActionIndex`), so one RVI sweep touches each
state's spawn neighbours and event-matrix row once, without the temporaries a vectorised numpy
sweep allocates.
"""

from __future__ import annotations

import numpy as np

from overtake.jit import njit


@njit(cache=True, nogil=True)
def box_minimum(V, idle, order, nb, tol, G, A):  # type: ignore[no-untyped-def]
    """G(y) = min of V over y's spawn box, A(y) its argmin (bellman.py's suffix-minimum DP).

    ``order``/``nb`` list, queue after queue, each state with its one-more-thread neighbour,
    neighbours first (higher thread level), so a suffix minimum is read only once complete.
    Idle post-decision states are excluded (G = inf there before the passes). The updates are
    selects, not branches: which neighbour wins is data-dependent, so a branch per pair would be
    mispredicted about half the time.
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


@njit(cache=True, nogil=True)
def box_value(V, idle, order, nb, G):  # type: ignore[no-untyped-def]
    """G of :func:`box_minimum` without the argmin: what a Bellman step needs (no branch and no
    second array; the decision is taken once, after the iteration)."""
    n = V.size
    for s in range(n):
        G[s] = np.inf if idle[s] else V[s]
    for t in range(order.size):
        u = np.uint64(order[t])  # unsigned: no negative-index wraparound test per access
        G[u] = min(G[u], G[np.uint64(nb[t])])


@njit(cache=True, nogil=True)
def bellman_residual(indptr, indices, data, cost, V, idle, order, nb, G, TV, f):  # type: ignore[no-untyped-def]
    """One Bellman step TV = cost + P_E·H(V) into the caller's buffers, and the RVI map's residual
    f = (TV − TV(0)) − V (numpy's ``TV - TV[0] - V``, the same arithmetic) in the same pass;
    returns (min, max) of TV − V. The allocation-free single sweep of the accelerated solver."""
    n = V.size
    box_value(V, idle, order, nb, G)
    lo = np.inf
    hi = -np.inf
    tv0 = 0.0
    for x in range(n):
        acc = cost[x]
        for t in range(indptr[x], indptr[x + 1]):
            acc += data[t] * G[np.uint64(indices[t])]  # unsigned: no wraparound test
        TV[x] = acc
        if x == 0:
            tv0 = acc
        d = acc - V[x]
        f[x] = (acc - tv0) - V[x]
        if d < lo:
            lo = d
        if d > hi:
            hi = d
    return lo, hi


@njit(cache=True, nogil=True)
def residual_stats(TV, V, f):  # type: ignore[no-untyped-def]
    """The rest of :func:`bellman_residual` once TV is known: f = (TV − TV(0)) − V, and (min, max)
    of TV − V, in one pass (solve.anderson_rvi, after scipy's sparse product)."""
    lo = np.inf
    hi = -np.inf
    tv0 = TV[0]
    for x in range(TV.size):
        acc = TV[x]
        d = acc - V[x]
        f[x] = (acc - tv0) - V[x]
        if d < lo:
            lo = d
        if d > hi:
            hi = d
    return lo, hi


@njit(cache=True, nogil=True)
def rvi_sweeps(indptr, indices, data, cost, V, idle, order, nb, max_sweeps, tol):  # type: ignore[no-untyped-def]
    """Up to ``max_sweeps`` sweeps V ← TV − TV(0); stops when span(TV − V) ≤ tol·|max(TV − V)|.

    Returns (sweeps done, min(TV − V), max(TV − V), converged). ``V`` is updated in place.
    """
    n = V.size
    G = np.empty(n)
    TV = np.empty(n)
    lo = 0.0
    hi = 0.0
    f = np.empty(n)
    for it in range(1, max_sweeps + 1):
        lo, hi = bellman_residual(indptr, indices, data, cost, V, idle, order, nb, G, TV, f)
        ref = TV[0]
        for x in range(n):
            V[x] = TV[x] - ref
        if hi - lo <= tol * max(abs(hi), 1e-12):
            return it, lo, hi, True
    return max_sweeps, lo, hi, False


@njit(cache=True, nogil=True, inline="always")  # inlined: called per row and event
def _rank(v, table, cap):  # type: ignore[no-untyped-def]
    """Lexicographic rank of vector ``v`` among vectors with sum <= cap (statespace.Ranker), and the
    budget left (negative: ``v`` exceeds cap). ``table[r, b]`` = C(b + r, r)."""
    L = v.size
    budget = cap
    key = 0
    for c in range(L):
        x = v[c]
        if x > 0:
            b = budget if budget > 0 else 0
            lo = b - x if b - x > 0 else 0
            key += table[L - c, b] - table[L - c, lo]
        budget -= x
    return key, budget


@njit(cache=True, nogil=True, inline="always")  # inlined: called per row and event
def _lower_bound(keys, key):  # type: ignore[no-untyped-def]
    """First position in sorted ``keys`` not below ``key`` (branch-free binary search)."""
    pos = 0
    span = keys.size
    while span > 1:
        half = span >> 1
        pos = pos + half if keys[pos + half] < key else pos
        span -= half
    if span == 1 and keys[pos] < key:
        pos += 1
    return pos



@njit(cache=True, nogil=True, inline="always")  # inlined: the search's exits
def _saved(st, n, nt, x, rebuild, status):  # type: ignore[no-untyped-def]
    """Record where a search stands in ``st`` (states, transitions, next state to expand, whether
    the hash table must be rebuilt on resuming) and return its ``status``."""
    st[0] = n
    st[1] = nt
    st[2] = x
    st[3] = rebuild
    return status


@njit(cache=True, nogil=True, inline="always")  # inlined: once per search call
def _hash_table(ht, keys, n, rebuild):  # type: ignore[no-untyped-def]
    """The shift of Fibonacci hashing (2^64/φ) for the hash table ``ht`` of (key, index) pairs (its
    size a power of two), first filled with the ``n`` states' ``keys`` when ``rebuild``."""
    size = ht.shape[0]
    mask = size - 1
    shift = 64
    while (1 << (64 - shift)) < size:
        shift -= 1
    if rebuild:
        for h in range(size):
            ht[h, 1] = -1
        for i in range(n):
            h = ((keys[i] * -7046029254386353131) >> shift) & mask
            while ht[h, 1] >= 0:
                h = (h + 1) & mask
            ht[h, 0] = keys[i]
            ht[h, 1] = i
    return shift


@njit(cache=True, nogil=True, inline="always")  # inlined: once per search call
def _resume(st, ht, keys):  # type: ignore[no-untyped-def]
    """A search's counters (states, transitions) as ``st`` left them, and its hash table's shift,
    size and mask, the table rebuilt from the states found so far when ``st[3]`` asks (then cleared)."""
    shift = _hash_table(ht, keys, st[0], st[3] != 0)
    st[3] = 0
    size = ht.shape[0]
    return st[0], st[1], shift, size, size - 1


@njit(cache=True, nogil=True)
def rank_rows(rows, table, cap, key):  # type: ignore[no-untyped-def]
    """Lexicographic rank of each row among vectors with sum ≤ cap (statespace.Ranker); False if a row exceeds cap.

    ``table[r, b]`` = C(b + r, r), the number of vectors of length r with sum ≤ b.
    """
    ok = True
    for i in range(rows.shape[0]):
        key[i], budget = _rank(rows[i], table, cap)
        if budget < 0:
            ok = False
    return ok


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def event_rows(  # type: ignore[no-untyped-def]
    rows, keys, dense, rank_table, cap, ev_src, ev_move, ev_f, per_thread, weights, weighted, lam, fill, indptr,
    indices, data, out,
):
    """The uniformized event matrix P_E of a state space (statespace.StateSpace.event_matrix) in CSR.

    ``rows`` are the states in rank order (``keys``); a destination is found through ``dense``
    (position per rank, −1: none) or, when it is empty, a binary search of ``keys``. Events and
    rates as chain_bfs (statespace.transitions' types, order and arithmetic); each row's total rate
    ``out`` is summed in that order, its entries are rate / ``lam`` and the diagonal 1 − out / lam,
    the columns sorted. ``fill`` False: only count each row's entries into indptr[x + 1]. Returns
    −1, or the first state with a destination outside the space."""
    S, L = rows.shape
    D = weights.size
    Q = L - D
    n_keys = keys.size
    use_dense = dense.size > 0
    row = np.empty(L, dtype=np.int64)
    cols = np.empty(ev_src.size + 1, dtype=np.int64)
    vals = np.empty(ev_src.size + 1)
    for x in range(S):
        # the row and event rates as in chain_bfs, written out in both: the ahead-of-time build
        # does not inline a shared njit helper taking arrays
        n_tot = 0
        K = 0
        W = 0.0
        for c in range(L):
            row[c] = rows[x, c]
            n_tot += row[c]
        for d in range(D):
            K += row[Q + d]
            W += row[Q + d] * weights[d]
        if weighted:
            pt = per_thread[K] / W if W > 0 else 0.0
        else:
            pt = per_thread[K]
        m = 0
        total = 0.0
        for e in range(ev_src.size):
            d = ev_src[e]
            if d < 0:
                if n_tot >= cap:
                    continue
                rate = ev_f[e, 0]
            else:
                kd = row[Q + d]
                if kd <= 0:
                    continue
                rate = kd * pt * weights[d] * ev_f[e, 0] * ev_f[e, 1]
            if not rate > 0:
                continue
            if fill:
                row[ev_move[e, 0]] += ev_move[e, 1]
                if ev_move[e, 2] >= 0:
                    row[ev_move[e, 2]] += ev_move[e, 3]
                key, budget = _rank(row, rank_table, cap)
                row[ev_move[e, 0]] -= ev_move[e, 1]
                if ev_move[e, 2] >= 0:
                    row[ev_move[e, 2]] -= ev_move[e, 3]
                if use_dense:
                    j = dense[key] if 0 <= key < dense.size else -1
                else:
                    pos = _lower_bound(keys, key)
                    j = pos if pos < n_keys and keys[pos] == key else -1
                if j < 0 or budget < 0:
                    return x
                cols[m] = j
                vals[m] = rate / lam
                total += rate
            m += 1
        if not fill:
            indptr[x + 1] = m + 1
            continue
        out[x] = total
        cols[m] = x
        vals[m] = 1.0 - total / lam
        m += 1
        for a in range(1, m):  # insertion sort by column: a handful of entries
            c0 = cols[a]
            v0 = vals[a]
            b = a - 1
            while b >= 0 and cols[b] > c0:
                cols[b + 1] = cols[b]
                vals[b + 1] = vals[b]
                b -= 1
            cols[b + 1] = c0
            vals[b + 1] = v0
        at = indptr[x]
        for a in range(m):
            indices[at + a] = cols[a]
            data[at + a] = vals[a]
    return -1


@njit(cache=True, nogil=True)
def reach_mark(indptr, indices, data, start, seen):  # type: ignore[no-untyped-def]
    """Mark in ``seen`` every state reachable from ``start`` along positive entries of a CSR
    matrix (evaluate.reachable); returns how many."""
    n = seen.size
    queue = np.empty(n, dtype=np.int64)
    seen[start] = True
    queue[0] = start
    head = 0
    tail = 1
    while head < tail:
        i = queue[head]
        head += 1
        for t in range(indptr[i], indptr[i + 1]):
            j = indices[t]
            if data[t] > 0 and not seen[j]:
                seen[j] = True
                queue[tail] = j
                tail += 1
    return tail


@njit(cache=True, nogil=True)
def transition_columns(t_src, t_dst, t_rate, order, inv, lam_u, ptr, idx, val, diag):  # type: ignore[no-untyped-def]
    """The uniformized chain of a breadth-first search's transitions (chain.compiled_search) as the
    stationary solve reads it: P's off-diagonal entries by column (CSC: ``ptr``, source ``idx``,
    ``val``; coinciding transitions summed, sources ascending) and its diagonal ``diag``, states
    numbered ``inv[old]`` (``order`` its inverse). ``t_src`` must be nondecreasing (the search
    expands states in index order). Returns the entries written.

    The columns are written once, row after row of the new numbering, without the coordinate
    matrix, the sort by row and the transpose that assembling P and then its columns would cost.
    """
    n = order.size
    nt = t_src.size
    start = np.zeros(n + 1, dtype=np.int64)
    pos = np.zeros(n + 1, dtype=np.int64)
    for t in range(nt):
        start[t_src[t] + 1] += 1
        if t_dst[t] != t_src[t]:
            pos[inv[t_dst[t]] + 1] += 1
    for x in range(n):
        start[x + 1] += start[x]
        pos[x + 1] += pos[x]
    first = pos.copy()  # each column's first slot while it is written
    for i in range(n):
        x = order[i]
        out = 0.0
        stay = 0.0
        for t in range(start[x], start[x + 1]):
            r = t_rate[t]
            out += r
            d = t_dst[t]
            if d == x:
                stay += r / lam_u
                continue
            j = inv[d]
            p = pos[j]
            if p > first[j] and idx[p - 1] == i:  # a coinciding transition of this row
                val[p - 1] += r / lam_u
            else:
                idx[p] = i
                val[p] = r / lam_u
                pos[j] = p + 1
        diag[i] = (1.0 - out / lam_u) + stay
    nnz = 0
    ptr[0] = 0
    for j in range(n):  # close the gaps the summed transitions left
        for p in range(first[j], pos[j]):
            idx[nnz] = idx[p]
            val[nnz] = val[p]
            nnz += 1
        ptr[j + 1] = nnz
    return nnz


@njit(cache=True, nogil=True)
def gauss_seidel(indptr, indices, data, diag, x, sweeps):  # type: ignore[no-untyped-def]
    """In-place Gauss–Seidel sweeps for xᵀ = xᵀP (P in CSC), x[0] held fixed."""
    n = x.size
    for _ in range(sweeps):
        for j in range(1, n):
            acc = 0.0
            for t in range(indptr[j], indptr[j + 1]):
                i = indices[t]
                if i != j:
                    acc += x[np.uint64(i)] * data[t]
            x[j] = acc / (1.0 - diag[j])
    return x


@njit(cache=True, nogil=True)
def anderson_history(x, f, x_old, f_old, df, dxf, head, k, both):  # type: ignore[no-untyped-def]
    """One pass of the Anderson step (anderson.py): store Δf = f − f_old and Δx + Δf in row ``head``,
    and both[j] = (Δf_j·Δf_head, Δf_j·f) for the first ``k`` rows — the Gram row and the right side.

    Stored rows are read two at a time: four independent sums instead of two, each still adding its
    terms in index order (so bit for bit the sums of one row at a time): a pass bound by the
    latency of its additions overlaps two chains of them (interleaving every row per entry would
    stride through memory instead).
    """
    n = x.size
    for i in range(n):
        d = f[i] - f_old[i]
        df[head, i] = d
        dxf[head, i] = x[i] - x_old[i] + d
    j = 0
    while j < k:
        if j + 1 < k:
            a0 = 0.0
            a1 = 0.0
            b0 = 0.0
            b1 = 0.0
            for i in range(n):
                new = df[head, i]
                fi = f[i]
                v0 = df[j, i]
                v1 = df[j + 1, i]
                a0 += v0 * new
                b0 += v0 * fi
                a1 += v1 * new
                b1 += v1 * fi
            both[j, 0] = a0
            both[j, 1] = b0
            both[j + 1, 0] = a1
            both[j + 1, 1] = b1
            j += 2
        else:
            a0 = 0.0
            b0 = 0.0
            for i in range(n):
                v0 = df[j, i]
                a0 += v0 * df[head, i]
                b0 += v0 * f[i]
            both[j, 0] = a0
            both[j, 1] = b0
            j += 1


@njit(cache=True, nogil=True)
def anderson_mix(x, f, dxf, gamma, out):  # type: ignore[no-untyped-def]
    """out = x + f − Σ_j γ_j (Δx_j + Δf_j), one pass over the history (anderson.py)."""
    n = x.size
    k = gamma.size
    for i in range(n):
        acc = x[i] + f[i]
        for j in range(k):
            acc -= gamma[j] * dxf[j, i]
        out[i] = acc


@njit(cache=True, nogil=True)
def anderson_gamma(gram, k, both, gamma):  # type: ignore[no-untyped-def]
    """γ = (G + εI)⁻¹ r, G the leading k×k block of ``gram``, r = ``both[:k, 1]`` and
    ε = 1e-13·trace(G) + 1e-300: anderson.py's regularised normal equations, by Gaussian
    elimination with partial pivoting (LAPACK's dgesv does the same, but on so small a system
    numpy's call overhead is most of the cost, once per mixing step). False (γ not written) when
    a pivot is zero or not finite: the caller drops its history."""
    a = np.empty((k, k + 1))
    tr = 0.0
    for i in range(k):
        tr += gram[i, i]
    reg = 1e-13 * tr + 1e-300
    for i in range(k):
        for j in range(k):
            a[i, j] = gram[i, j]
        a[i, i] += reg
        a[i, k] = both[i, 1]
    for c in range(k):
        p = c
        best = abs(a[c, c])
        for r in range(c + 1, k):
            if abs(a[r, c]) > best:
                best = abs(a[r, c])
                p = r
        if not (best > 0.0 and best < np.inf):
            return False
        if p != c:
            for j in range(c, k + 1):
                t = a[c, j]
                a[c, j] = a[p, j]
                a[p, j] = t
        for r in range(c + 1, k):
            m = a[r, c] / a[c, c]
            for j in range(c, k + 1):
                a[r, j] -= m * a[c, j]
    for i in range(k - 1, -1, -1):
        acc = a[i, k]
        for j in range(i + 1, k):
            acc -= a[i, j] * gamma[j]
        gamma[i] = acc / a[i, i]
    return True


# ---- breadth-first construction of a policy's chain (chain.py) -------------------------------


@njit(cache=True, nogil=True)
def chain_bfs(  # type: ignore[no-untyped-def]
    st, rows, keys, level, ht, t_src, t_dst, t_rate, rank_table, cap, k_max, max_states, ev_src, ev_move, ev_f,
    per_thread, weights, weighted, sp_ptr, sp_coord, sp_prob, deterministic, kind, param, rkeys, rdense, rspawn,
    rtable, rcap, rkmax, queue_stage, coord_stage, prio,
):
    """Breadth-first search of the post-decision states a rule reaches from ``rows[0]`` (chain.py).

    ``st`` = [states found, transitions, next state to expand, rebuild the hash table]: the search
    resumes from it, so when the buffers fill (return 1) the caller enlarges them and calls again
    (the state being expanded is expanded anew). Returns 0 when done, 2 beyond ``max_states``.

    Each state's events are those of statespace.transitions (``ev_src`` −1: an arrival, while the
    system holds fewer than ``cap``; else the busy coordinate it needs), with the same rate
    arithmetic; the rule then starts threads as chain._apply_rule does: all at once with phases
    known (``deterministic``), else one at a time, each phase drawn (a tree of outcomes), the rule
    asked again after each. Rules (``kind``): 0 a policy table (Policy.actions: trim the longest
    queue beyond ``rcap``, nothing beyond ``rkmax`` threads, the spawn counts of the table's row
    found through ``rdense`` (position per rank) or a binary search of ``rkeys``), 1 π(∞),
    2 π(k) (k = param[0], queues in ``prio`` order), 3 π(k1,…,kN) (param per stage).
    Transitions are (source, destination discovery index, rate); ``level`` is each state's depth.
    A post-decision state's key is its rank (statespace.Ranker); the hash table holds (key, index)
    pairs side by side. Written without array views or per-transition helper calls taking arrays
    (_rank excepted; the hash table's set-up and the exits, _resume and _saved, run once a
    call): each costs atomic reference counts per use, most of the time of this loop.
    """
    L = rows.shape[1]
    Q = sp_ptr.size - 1
    D = L - Q
    n, nt, shift, size, mask = _resume(st, ht, keys)
    cap_states = rows.shape[0]
    cap_trans = t_src.size
    n_stage = 1
    for d in range(D):
        n_stage = max(n_stage, coord_stage[d] + 1)
    tmp = np.empty(L, dtype=np.int64)
    room = np.empty(n_stage, dtype=np.int64)
    counts = np.empty(Q, dtype=np.int64)
    row = np.empty(L, dtype=np.int64)
    cur = np.empty(L, dtype=np.int64)
    max_branch = 1
    for q in range(Q):
        max_branch = max(max_branch, sp_ptr[q + 1] - sp_ptr[q])
    depth = (k_max + 1) * max_branch + 1
    stack = np.empty((depth, L), dtype=np.int64)
    stack_p = np.empty(depth)
    n_rkeys = rkeys.size
    use_dense = rdense.size > 0
    x = st[2]
    while x < n:
        n0 = n
        nt0 = nt
        full = False
        n_tot = 0
        K = 0
        W = 0.0
        for c in range(L):
            row[c] = rows[x, c]
            n_tot += row[c]
        for d in range(D):
            K += row[Q + d]
            W += row[Q + d] * weights[d]
        if weighted:
            pt = per_thread[K] / W if W > 0 else 0.0
        else:
            pt = per_thread[K]
        lev = level[x] + 1
        for e in range(ev_src.size):
            d = ev_src[e]
            if d < 0:
                if n_tot >= cap:
                    continue
                rate = ev_f[e, 0]
            else:
                kd = row[Q + d]
                if kd <= 0:
                    continue
                rate = kd * pt * weights[d] * ev_f[e, 0] * ev_f[e, 1]
            if not rate > 0:
                continue
            for c in range(L):
                stack[0, c] = row[c]
            stack[0, ev_move[e, 0]] += ev_move[e, 1]
            if ev_move[e, 2] >= 0:
                stack[0, ev_move[e, 2]] += ev_move[e, 3]
            stack_p[0] = rate
            top = 1
            while top > 0:
                top -= 1
                threads = 0
                total = 0
                for c in range(L):
                    v = stack[top, c]
                    cur[c] = v
                    total += v
                    if c >= Q:
                        threads += v
                prob = stack_p[top]
                # the rule's spawn counts, at most the waiting requests
                for q in range(Q):
                    counts[q] = 0
                if kind == 0:  # policy table
                    if threads <= rkmax:
                        for c in range(L):
                            tmp[c] = cur[c]
                        for _ in range(total - rcap):  # beyond its cap: trim the longest queue first
                            best = 0
                            for q in range(1, Q):
                                if tmp[q] > tmp[best]:
                                    best = q
                            tmp[best] -= 1
                        key, _ = _rank(tmp, rtable, rcap)
                        if use_dense:
                            pos = rdense[key]
                            found = pos >= 0
                        else:
                            pos = _lower_bound(rkeys, key)
                            found = pos < n_rkeys and rkeys[pos] == key
                        if found:
                            for q in range(Q):
                                counts[q] = min(rspawn[pos, q], cur[q])
                elif kind == 1:  # π(∞)
                    for q in range(Q):
                        counts[q] = cur[q]
                elif kind == 2:  # π(k): later stages first
                    left = param[0] - threads
                    if left < 0:
                        left = 0
                    for t in range(prio.size):
                        q = prio[t]
                        take = min(cur[q], left)
                        counts[q] = take
                        left -= take
                else:  # π(k1, …, kN)
                    for i in range(n_stage):
                        room[i] = 0
                    for d in range(D):
                        room[coord_stage[d]] += cur[Q + d]
                    for i in range(n_stage):
                        r = param[i] - room[i]
                        room[i] = r if r > 0 else 0
                    for q in range(Q):
                        counts[q] = min(cur[q], room[queue_stage[q]])
                want = 0
                first = -1
                for q in range(Q):
                    if counts[q] > 0:
                        want += counts[q]
                        if first < 0:
                            first = q
                if want > 0 and threads < k_max:
                    if deterministic:  # every thread at once, up to the thread cap
                        for q in range(Q):
                            take = min(counts[q], k_max - threads)
                            cur[q] -= take
                            cur[Q + sp_coord[sp_ptr[q]]] += take
                            threads += take
                    else:  # one thread from the first queue, its phase drawn; the rule is asked again
                        for t in range(sp_ptr[first], sp_ptr[first + 1]):
                            for c in range(L):
                                stack[top, c] = cur[c]
                            stack[top, first] -= 1
                            stack[top, Q + sp_coord[t]] += 1
                            stack_p[top] = prob * sp_prob[t]
                            top += 1
                        continue
                # a post-decision state: its rank, found or added, and the transition (written out
                # in both searches: a helper taking the nine arrays, inlined or not, costs the
                # ahead-of-time build their reference counts per transition, half this loop's time)
                key, _ = _rank(cur, rank_table, cap)
                h = ((key * -7046029254386353131) >> shift) & mask
                while True:
                    j = ht[h, 1]
                    if j < 0 or ht[h, 0] == key:
                        break
                    h = (h + 1) & mask
                if j < 0:
                    if n >= cap_states or 2 * (n + 1) > size:
                        full = True
                        break
                    j = n
                    ht[h, 0] = key
                    ht[h, 1] = j
                    for c in range(L):
                        rows[j, c] = cur[c]
                    keys[j] = key
                    level[j] = lev
                    n += 1
                if nt >= cap_trans:
                    full = True
                    break
                t_src[nt] = x
                t_dst[nt] = j
                t_rate[nt] = prob
                nt += 1
            if full:
                break
        if full:  # undo this state's expansion; the caller enlarges the buffers and resumes here
            return _saved(st, n0, nt0, x, 1, 1)
        x += 1
        if n > max_states:
            return _saved(st, n, nt, x, 0, 2)
    return _saved(st, n, nt, x, 0, 0)
