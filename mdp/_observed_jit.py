"""The breadth-first search of an observation table's chain as a numba JIT kernel (cached on disk);
:mod:`overtake.mdp._kernels` runs it, or its ahead-of-time build from the same source, beside the
kernels of ``_kernels_jit.py``.
"""

from __future__ import annotations

import numpy as np

from overtake.jit import njit

from ._kernels_jit import _lower_bound, _rank, _resume, _saved


@njit(cache=True, nogil=True)
def observed_bfs(  # type: ignore[no-untyped-def]
    st, rows, keys, level, ht, t_src, t_dst, t_rate, rank_table, cap, k_max, max_states, ev_src, ev_move, ev_f,
    per_thread, weights, weighted, coord_stage, n_stage, sp_ptr, sp_coord, comp_ptr, comp_k, comp_p,
    rkeys, rdense, rspawn, rtable, rcap, rkmax,
):
    """Breadth-first search of the post-decision states an observation table reaches from
    ``rows[0]`` (observed_chain.py), resumable as _kernels_jit.chain_bfs (``st``, return codes 0,
    1 and 2, the hash table, the transitions and the levels alike).

    Each state's events are those of statespace.transitions, with the same rate arithmetic. An
    event that changes the observation (waiting per queue, threads per stage) asks the table: its
    observation row is projected as Policy.actions does for observation policies (one less in the
    largest count, the first on ties, until it fits ``rcap``; nothing beyond ``rkmax`` threads or
    outside the table), the answer clipped to the waiting requests and to ``k_max`` threads (later
    queues first), and every queue's started threads take their phases from its prior at once:
    one transition per outcome, the queues' multinomial splits ``comp_k`` (phase counts) with
    probabilities ``comp_p``, those of n threads from queue q at ``comp_ptr[q, n] ..
    comp_ptr[q, n + 1]`` (spawn_vector's outcomes, its probability products in its order).
    """
    L = rows.shape[1]
    Q = sp_ptr.size - 1
    D = L - Q
    R = Q + n_stage
    n, nt, shift, size, mask = _resume(st, ht, keys)
    cap_states = rows.shape[0]
    cap_trans = t_src.size
    row = np.empty(L, dtype=np.int64)
    pre = np.empty(L, dtype=np.int64)
    cur = np.empty(L, dtype=np.int64)
    obs = np.empty(R, dtype=np.int64)
    obs0 = np.empty(R, dtype=np.int64)
    counts = np.empty(Q, dtype=np.int64)
    lo = np.empty(Q, dtype=np.int64)
    hi = np.empty(Q, dtype=np.int64)
    idx = np.empty(Q, dtype=np.int64)
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
        for c in range(R):
            obs0[c] = 0
        for c in range(L):
            row[c] = rows[x, c]
            n_tot += row[c]
        for q in range(Q):
            obs0[q] = row[q]
        for d in range(D):
            K += row[Q + d]
            W += row[Q + d] * weights[d]
            obs0[Q + coord_stage[d]] += row[Q + d]
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
                pre[c] = row[c]
            pre[ev_move[e, 0]] += ev_move[e, 1]
            if ev_move[e, 2] >= 0:
                pre[ev_move[e, 2]] += ev_move[e, 3]
            # the observation after the event, and whether the event changed it
            for c in range(R):
                obs[c] = 0
            for q in range(Q):
                obs[q] = pre[q]
            threads = 0
            for dd in range(D):
                obs[Q + coord_stage[dd]] += pre[Q + dd]
                threads += pre[Q + dd]
            changed = False
            for c in range(R):
                if obs[c] != obs0[c]:
                    changed = True
            for q in range(Q):
                counts[q] = 0
            if changed:
                total = 0
                for c in range(R):
                    total += obs[c]
                while total > rcap:  # beyond the table's cap: one less in the largest count
                    best = 0
                    for c in range(1, R):
                        if obs[c] > obs[best]:
                            best = c
                    obs[best] -= 1
                    total -= 1
                seen = 0
                for c in range(Q, R):
                    seen += obs[c]
                if seen <= rkmax:
                    key, _ = _rank(obs, rtable, rcap)
                    if use_dense:
                        pos = rdense[key]
                        found = pos >= 0
                    else:
                        pos = _lower_bound(rkeys, key)
                        found = pos < n_rkeys and rkeys[pos] == key
                    if found:
                        for q in range(Q):
                            a = rspawn[pos, q]
                            counts[q] = min(max(a, 0), pre[q])
                room = k_max - threads
                if room < 0:
                    room = 0
                for q in range(Q - 1, -1, -1):  # the thread cap: later queues first
                    take = min(counts[q], room)
                    counts[q] = take
                    room -= take
            # every combination of the queues' multinomial outcomes (an odometer over them)
            for q in range(Q):
                lo[q] = comp_ptr[q, counts[q]]
                hi[q] = comp_ptr[q, counts[q] + 1]
                idx[q] = lo[q]
            while True:
                prob = rate
                for c in range(L):
                    cur[c] = pre[c]
                for q in range(Q):
                    if counts[q] > 0:
                        cur[q] -= counts[q]
                        j = idx[q]
                        for t in range(sp_ptr[q], sp_ptr[q + 1]):
                            cur[Q + sp_coord[t]] += comp_k[j, t - sp_ptr[q]]
                        prob = prob * comp_p[j]
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
                # the next combination: the last queue's outcome advances first
                q = Q - 1
                while q >= 0:
                    idx[q] += 1
                    if idx[q] < hi[q]:
                        break
                    idx[q] = lo[q]
                    q -= 1
                if q < 0:
                    break
            if full:
                break
        if full:  # undo this state's expansion; the caller enlarges the buffers and resumes here
            return _saved(st, n0, nt0, x, 1, 1)
        x += 1
        if n > max_states:
            return _saved(st, n, nt, x, 0, 2)
    return _saved(st, n, nt, x, 0, 0)
