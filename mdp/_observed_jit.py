"""The breadth-first search of an observation table's chain as a numba JIT kernel (cached on disk);
:mod:`overtake.mdp._kernels` runs it, or its ahead-of-time build from the same source, beside the
kernels of ``_kernels_jit.py``.
"""

from __future__ import annotations

import numpy as np

from overtake.jit import njit

from ._kernels_jit import _add_transition, _event_rate, _hash_table, _load_state, _saved, _table_row


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
    n = st[0]
    nt = st[1]
    shift = _hash_table(ht, keys, n, st[3] != 0)  # (re)built from the states found so far
    st[3] = 0
    row = np.empty(L, dtype=np.int64)
    pre = np.empty(L, dtype=np.int64)
    cur = np.empty(L, dtype=np.int64)
    obs = np.empty(R, dtype=np.int64)
    obs0 = np.empty(R, dtype=np.int64)
    counts = np.empty(Q, dtype=np.int64)
    lo = np.empty(Q, dtype=np.int64)
    hi = np.empty(Q, dtype=np.int64)
    idx = np.empty(Q, dtype=np.int64)
    x = st[2]
    while x < n:
        n0 = n
        nt0 = nt
        full = False
        n_tot, pt = _load_state(rows, x, row, Q, weights, per_thread, weighted)
        for c in range(R):
            obs0[c] = 0
        for q in range(Q):
            obs0[q] = row[q]
        for d in range(D):
            obs0[Q + coord_stage[d]] += row[Q + d]
        lev = level[x] + 1
        for e in range(ev_src.size):
            rate = _event_rate(e, row, Q, n_tot, cap, pt, weights, ev_src, ev_f)
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
                    pos = _table_row(obs, rtable, rcap, rkeys, rdense)
                    if pos >= 0:
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
                # a post-decision state: its rank, found or added, and the transition
                n, nt = _add_transition(cur, rank_table, cap, lev, x, prob, n, nt, ht, shift, rows, keys, level,
                                        t_src, t_dst, t_rate)
                if n < 0:
                    full = True
                    break
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
