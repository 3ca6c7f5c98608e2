"""The compiled event loop of :mod:`overtake.mdp.simulation` (numba ``njit``; one function, no Python calls).

Processor sharing in virtual time: with K active threads every thread progresses at rate
r(K) = c(K)/K, so one virtual clock V (dV/dt = r(K)) serves all threads. A thread's next phase
event is stored as an absolute virtual time in a binary heap; it never moves when K changes, so
each event costs O(log K) and the next real event is min(next arrival, (heap top − V)/r(K)).

Policies (``ptype``): 0 π(k) / π(∞) (later stages first, FCFS in a stage), 1 π(k1,…,kN),
2 a policy artifact's table (``full`` or ``start`` layout, with :class:`overtake.mdp.Policy`'s
projection beyond the truncation), 3 the overtaking heuristic. ``qmode`` 0 queues waiting
requests per stage, 1 per (stage, phase label) coordinate, 2 per (stage, route) for observation
tables (:mod:`overtake.mdp.observation`): a request entering stage i joins route r with
probability ``route_cum``, starts in a phase drawn from its route's prior, and the table sees
waiting per queue and threads per stage, answers at arrivals and completions only (the events
the observation shows), and its answer is started at once.

CPU priority levels (``n_lv`` > 1, :mod:`overtake.mdp.priority`): each level ℓ has its own
virtual clock V_ℓ and heap; a thread of level ℓ progresses at rate r_ℓ = min(u, θw_ℓ) with
u = 1/(1 + δK) (one core at most) and θ set so the rates sum to c(K) (water-filling; PS within a
level, weighted sharing between levels). A thread's heap key is min(next phase event, the virtual
time at which its attained service at the stage reaches its level's upper threshold); at the
latter it moves to the next level's clock with its remaining work (no decision epoch: the
policy's state does not change). With one level every line reduces to the plain PS loop, bit for
bit (same arithmetic, same random draws).

Service (``svc_mode``): 0 PH — the label *is* the phase; sojourns Exp(μ_d) in virtual time,
jumps by the embedded chain. 1 given work — the request's stage work ``work[r, i]`` is fixed;
its label path is a PH path from ``label0[r, i]`` whose time axis is stretched to end exactly
at the work (for hyper-exponential fits the label never changes).

Coupled stages (``start_cum``, a row per coordinate): a request leaving coordinate d starts the
next stage in a phase drawn from row d, the routing's start law (the next stage's α for
independent stages, one draw either way: the same random stream).

Locks (``lock_cap``, per stage; :mod:`overtake.mdp.lock`): a thread started in a stage whose
``lock_cap`` holders are all present joins the stage's FIFO of blocked threads; it counts as a
thread (K, what the policy and the thread cap see) but not in the processor's share (Kr), and
its service starts when a holder leaves the stage. PH service only.

Readers (``read_stage``, per stage, under the lock of stage ``rd_lock``; SQLite's SHARED lock in
rollback-journal mode): a holder's service end is its commit, which waits while readers run; the
holder then leaves the processor (pending: SQLite's PENDING), a reader started meanwhile joins a
FIFO of blocked readers (a thread, no CPU), and the commit happens when the last reader ends, or,
with ``busy`` sleeps (SQLite's busy handler), at the holder's first try after that; at the commit
the blocked readers all start.
"""

from __future__ import annotations

import numpy as np

from overtake.jit import njit

from ._heurkernel import heuristic_decide
from .model import capacity_compiled as _cap

LMAX = 64


@njit(cache=True)
def _heap_push(hv, hs, size, v, s):  # type: ignore[no-untyped-def]
    i = size
    hv[i] = v
    hs[i] = s
    while i > 0:
        p = (i - 1) >> 1
        if hv[p] <= hv[i]:
            break
        hv[p], hv[i] = hv[i], hv[p]
        hs[p], hs[i] = hs[i], hs[p]
        i = p
    return size + 1


@njit(cache=True)
def _heap_pop(hv, hs, size):  # type: ignore[no-untyped-def]
    s = hs[0]
    size -= 1
    hv[0] = hv[size]
    hs[0] = hs[size]
    i = 0
    while True:
        lft = 2 * i + 1
        if lft >= size:
            break
        c = lft
        if lft + 1 < size and hv[lft + 1] < hv[lft]:
            c = lft + 1
        if hv[i] <= hv[c]:
            break
        hv[c], hv[i] = hv[i], hv[c]
        hs[c], hs[i] = hs[i], hs[c]
        i = c
    return s, size


@njit(cache=True)
def _level_rates(nlev, w, K, cores, overhead, out):  # type: ignore[no-untyped-def]
    """Per-thread rate of each level: water-filling of c(K) by weight, each thread capped at one core."""
    n_lv = nlev.size
    u = 1.0 / (1.0 + overhead * K)
    for lv in range(n_lv):
        out[lv] = 0.0
    if K <= cores:
        for lv in range(n_lv):
            if nlev[lv] > 0:
                out[lv] = u
        return
    cap_left = _cap(K, cores, overhead)
    done = np.zeros(n_lv, np.bool_)
    while True:
        wsum = 0.0
        for lv in range(n_lv):
            if nlev[lv] > 0 and not done[lv]:
                wsum += nlev[lv] * w[lv]
        if wsum <= 0.0:
            return
        theta = cap_left / wsum
        capped = False
        for lv in range(n_lv):
            if nlev[lv] > 0 and not done[lv] and theta * w[lv] > u:
                out[lv] = u
                done[lv] = True
                cap_left -= nlev[lv] * u
                capped = True
        if not capped:
            for lv in range(n_lv):
                if nlev[lv] > 0 and not done[lv]:
                    out[lv] = theta * w[lv]
            return


@njit(cache=True)
def _fifo_append(head, tail, nxt, q, x):  # type: ignore[no-untyped-def]
    """Append ``x`` to FIFO ``q`` (linked through ``nxt``)."""
    nxt[x] = -1
    if tail[q] >= 0:
        nxt[tail[q]] = x
    else:
        head[q] = x
    tail[q] = x


@njit(cache=True)
def _start_ph(s, lab, i, Vl, lv_start, lv_thr, n_lv, slot_lv, nlev, thr_v, ev_v, mu, hv2, hs2, hsz):  # type: ignore[no-untyped-def]
    """Start the PH service of slot ``s`` (label ``lab``, stage ``i``) now: its level, its first
    phase event on that level's clock."""
    lv = lv_start[lab]
    slot_lv[s] = lv
    nlev[lv] += 1
    V = Vl[lv]
    thr_v[s] = V + lv_thr[i, lv] if lv < n_lv - 1 else np.inf
    ev_v[s] = V + np.random.exponential(1.0) / mu[lab]
    hsz[lv] = _heap_push(hv2[lv], hs2[lv], hsz[lv], min(ev_v[s], thr_v[s]), s)


@njit(cache=True)
def _pick(cum, row, ncols):  # type: ignore[no-untyped-def]
    u = np.random.random()
    for c in range(ncols):
        if u < cum[row, c]:
            return c
    return ncols - 1


@njit(cache=True)
def _table_lookup(row, L, Q, C, kmax, keys, spawn, ntab, out, counts_only):  # type: ignore[no-untyped-def]
    """mdp.Policy.action: rank lookup with the documented projection beyond the truncation."""
    K = 0
    tot = 0
    for c in range(L):
        tot += row[c]
        if c >= Q:
            K += row[c]
    for q in range(Q):
        out[q] = 0
    if K > kmax and not counts_only:
        return
    proj = row.copy()
    excess = tot - C
    while excess > 0:
        best = 0
        # observation tables shrink the largest count of all, the others the longest queue
        for q in range(1, L if counts_only else Q):
            if proj[q] > proj[best]:
                best = q
        proj[best] -= 1
        excess -= 1
    if counts_only:
        K = 0
        for c in range(Q, L):
            K += proj[c]
        if K > kmax:
            return
    budget = C
    key = 0
    for c in range(L):
        v = proj[c]
        r = L - c - 1
        if v > 0:
            key += ntab[r + 1, budget] - ntab[r + 1, budget - v]
        budget -= v
    i = np.searchsorted(keys, key)
    if i < keys.size and keys[i] == key:
        for q in range(Q):
            out[q] = min(spawn[i, q], row[q])


@njit(cache=True)
def run_kernel(  # type: ignore[no-untyped-def]
    n_total, n_warm, n_meas, lam, seed,
    coord_stage, stage_off, alpha_cum, mu, jump_cum,
    svc_mode, work, label0,
    cores, overhead,
    ptype, qmode, base_total, base_caps,
    tab_keys, tab_spawn, tab_ntab, tab_C, tab_kmax,
    h_remaining, h_min_pair, h_wait, h_order, h_variant,
    max_slots,
    lv_w, lv_thr, lv_start, lv_area,
    route_cum, route_q0, queue_alpha_cum,
    lock_cap,
    start_cum,
    read_stage, rd_lock, busy,
):
    np.random.seed(seed)
    N = stage_off.size - 1
    D = coord_stage.size
    Q = N if qmode == 0 else (D if qmode == 1 else route_q0[N])
    # requests
    arr_t = np.zeros(n_total)
    enter_t = np.zeros(n_total)
    label = np.zeros(n_total, np.int64)
    stage = np.zeros(n_total, np.int64)
    nxt = np.full(n_total, -1, np.int64)
    resp = np.zeros(n_meas)
    # queues
    q_head = np.full(Q, -1, np.int64)
    q_tail = np.full(Q, -1, np.int64)
    wq = np.zeros(Q, np.int64)
    kc = np.zeros(D, np.int64)
    ks = np.zeros(N, np.int64)
    # threads
    slot_req = np.zeros(max_slots, np.int64)
    slot_pos = np.zeros(max_slots, np.int64)
    path_ph = np.zeros((max_slots, LMAX), np.int64) if svc_mode == 1 else np.zeros((1, 1), np.int64)
    path_v = np.zeros((max_slots, LMAX)) if svc_mode == 1 else np.zeros((1, 1))
    path_len = np.zeros(max_slots, np.int64)
    free = np.arange(max_slots - 1, -1, -1).astype(np.int64)
    n_free = max_slots
    # priority levels: one heap and one virtual clock per level (n_lv = 1: plain PS)
    n_lv = lv_w.size
    hv2 = np.zeros((n_lv, max_slots))
    hs2 = np.zeros((n_lv, max_slots), np.int64)
    hsz = np.zeros(n_lv, np.int64)
    Vl = np.zeros(n_lv)
    rl = np.zeros(n_lv)
    nlev = np.zeros(n_lv, np.int64)
    slot_lv = np.zeros(max_slots, np.int64)
    ev_v = np.zeros(max_slots)   # next phase event of the slot, on its level's clock
    thr_v = np.full(max_slots, np.inf)  # demotion epoch of the slot, on its level's clock
    # statistics
    stage_soj = np.zeros(N)
    stage_wait = np.zeros(N)
    area_K = 0.0
    area_N = 0.0
    area_ks = np.zeros(N)
    t_open = -1.0
    t_close = -1.0
    in_window = False
    n_sys = 0
    done_meas = 0
    events = 0
    overflow = False
    # policy buffers
    L = Q + D if qmode != 2 else Q + N
    row = np.zeros(L, np.int64)
    cnt = np.zeros(max(Q, D), np.int64)
    caps_room = np.zeros(N, np.int64)
    # locks: per stage its holders and a FIFO of blocked slots (they hold a thread, use no CPU)
    held = np.zeros(N, np.int64)
    blk_head = np.full(N, -1, np.int64)
    blk_tail = np.full(N, -1, np.int64)
    blk_next = np.full(max_slots, -1, np.int64)
    # readers under stage rd_lock's lock: those running, the holder whose commit waits for them
    # (pend, -1: none), its next try (busy sleeps) or due now, and the FIFO of blocked readers
    readers = 0
    pend = -1
    pend_try = np.inf
    pend_due = False
    tries = 0
    rb_head = np.full(1, -1, np.int64)
    rb_tail = np.full(1, -1, np.int64)

    t = 0.0
    K = 0  # threads, blocked ones included: what the policy and the thread cap count
    Kr = 0  # threads progressing: what shares the processor
    next_arr = np.random.exponential(1.0 / lam)
    n_arr = 0
    inf = np.inf
    while done_meas < n_meas:
        # ---- next event --------------------------------------------------------------
        lv_ev = 0
        if n_lv == 1:
            r = _cap(Kr, cores, overhead) / Kr if Kr > 0 else 0.0
            rl[0] = r
            dt_thr = (hv2[0, 0] - Vl[0]) / r if Kr > 0 else inf
        else:
            _level_rates(nlev, lv_w, Kr, cores, overhead, rl)
            dt_thr = inf
            for lv in range(n_lv):
                if nlev[lv] > 0 and rl[lv] > 0.0:
                    d_lv = (hv2[lv, 0] - Vl[lv]) / rl[lv]
                    if d_lv < dt_thr:
                        dt_thr = d_lv
                        lv_ev = lv
        dt_arr = next_arr - t if n_arr < n_total else inf
        is_arr = dt_arr <= dt_thr
        dt = dt_arr if is_arr else dt_thr
        is_cm = False
        if pend >= 0:
            dt_cm = 0.0 if pend_due else pend_try - t
            if dt_cm <= dt:
                is_cm = True
                is_arr = False
                dt = dt_cm
        if dt == inf:
            break
        if dt < 0.0:
            dt = 0.0
        if in_window:
            area_K += K * dt
            area_N += n_sys * dt
            for i in range(N):
                area_ks[i] += ks[i] * dt
            for lv in range(n_lv):
                lv_area[lv] += nlev[lv] * dt
        t += dt
        if n_lv == 1:
            if Kr > 0:
                Vl[0] += rl[0] * dt
        else:
            for lv in range(n_lv):
                if nlev[lv] > 0:
                    Vl[lv] += rl[lv] * dt
        events += 1
        if is_arr:
            req = n_arr
            n_arr += 1
            arr_t[req] = t
            if req == n_warm:
                in_window = True
                t_open = t
            if req == n_warm + n_meas - 1:
                in_window = False
                t_close = t
            next_arr = t + np.random.exponential(1.0 / lam)
            n_sys += 1
            i_new = 0
            d_exit = -1
            seen = True
        elif is_cm and readers > 0:
            # the holder's try failed: readers still run; it sleeps again
            pend_try = t + busy[min(tries, busy.size - 1)]
            tries += 1
            continue
        else:
            s = pend
            completes = is_cm
            if not is_cm:
                s, hsz[lv_ev] = _heap_pop(hv2[lv_ev], hs2[lv_ev], hsz[lv_ev])
            if not is_cm and thr_v[s] < ev_v[s]:
                # demotion: the attained service at the stage reached the level's upper threshold
                lv0 = lv_ev
                lv1 = lv0 + 1
                i_s = stage[slot_req[s]]
                shift = Vl[lv1] - Vl[lv0]
                ev_v[s] += shift
                if svc_mode == 1:
                    for m in range(slot_pos[s], path_len[s]):
                        path_v[s, m] += shift
                thr_v[s] = Vl[lv1] + (lv_thr[i_s, lv1] - lv_thr[i_s, lv0]) if lv1 < n_lv - 1 else inf
                slot_lv[s] = lv1
                nlev[lv0] -= 1
                nlev[lv1] += 1
                hsz[lv1] = _heap_push(hv2[lv1], hs2[lv1], hsz[lv1], min(ev_v[s], thr_v[s]), s)
                continue
            req = slot_req[s]
            d = label[req]
            d_exit = d
            if is_cm:
                # the commit: no reader runs any more; the blocked readers start after it
                pend = -1
                pend_due = False
                pend_try = inf
            elif svc_mode == 0:
                nd = _pick(jump_cum, d, D + 1)
                if nd == D:
                    completes = True
                else:
                    kc[d] -= 1
                    kc[nd] += 1
                    label[req] = nd
                    ev_v[s] = Vl[lv_ev] + np.random.exponential(1.0) / mu[nd]
                    hsz[lv_ev] = _heap_push(hv2[lv_ev], hs2[lv_ev], hsz[lv_ev], min(ev_v[s], thr_v[s]), s)
            else:
                pos = slot_pos[s] + 1
                if pos >= path_len[s]:
                    completes = True
                else:
                    nd = path_ph[s, pos]
                    slot_pos[s] = pos
                    kc[d] -= 1
                    kc[nd] += 1
                    label[req] = nd
                    ev_v[s] = path_v[s, pos]
                    hsz[lv_ev] = _heap_push(hv2[lv_ev], hs2[lv_ev], hsz[lv_ev], min(ev_v[s], thr_v[s]), s)
            i_new = -1
            seen = completes  # a phase change is invisible to an observation table
            if completes and not is_cm:
                Kr -= 1
                nlev[lv_ev] -= 1
                if stage[req] == rd_lock and readers > 0:
                    # the commit waits for the readers, off the processor, holding the lock
                    completes = False
                    seen = False
                    pend = s
                    pend_due = False
                    pend_try = inf
                    tries = 0
                    if busy.size > 0:
                        pend_try = t + busy[0]
                        tries = 1
            if completes:
                kc[d] -= 1
                K -= 1
                i_old = stage[req]
                ks[i_old] -= 1
                free[n_free] = s
                n_free += 1
                held[i_old] -= 1
                s3 = blk_head[i_old]
                if s3 >= 0:
                    # the lock passes to the oldest blocked thread of the stage: its service starts
                    blk_head[i_old] = blk_next[s3]
                    if blk_head[i_old] < 0:
                        blk_tail[i_old] = -1
                    held[i_old] += 1
                    Kr += 1
                    _start_ph(s3, label[slot_req[s3]], i_old, Vl, lv_start, lv_thr, n_lv, slot_lv, nlev, thr_v, ev_v,
                              mu, hv2, hs2, hsz)
                if i_old == rd_lock:
                    # the commit done: the readers it held up start
                    s4 = rb_head[0]
                    while s4 >= 0:
                        readers += 1
                        Kr += 1
                        _start_ph(s4, label[slot_req[s4]], stage[slot_req[s4]], Vl, lv_start, lv_thr, n_lv, slot_lv,
                                  nlev, thr_v, ev_v, mu, hv2, hs2, hsz)
                        s4 = blk_next[s4]
                    rb_head[0] = -1
                    rb_tail[0] = -1
                elif read_stage[i_old] != 0:
                    readers -= 1
                    if readers == 0 and pend >= 0 and busy.size == 0:
                        pend_due = True
                if req >= n_warm and req < n_warm + n_meas:
                    stage_soj[i_old] += t - enter_t[req]
                if i_old + 1 < N:
                    i_new = i_old + 1
                else:
                    n_sys -= 1
                    if req >= n_warm and req < n_warm + n_meas:
                        resp[req - n_warm] = t - arr_t[req]
                        done_meas += 1
        if i_new >= 0:
            # the request enters stage i_new: its starting label, then its queue
            stage[req] = i_new
            enter_t[req] = t
            qr = 0
            if qmode == 2:
                qr = route_q0[i_new] + _pick(route_cum, i_new, route_q0[i_new + 1] - route_q0[i_new])
            if svc_mode == 0:
                if qmode == 2:
                    lab = stage_off[i_new] + _pick(queue_alpha_cum, qr, stage_off[i_new + 1] - stage_off[i_new])
                elif d_exit >= 0:
                    # the start law at the next stage given the phase the request left from
                    lab = stage_off[i_new] + _pick(start_cum, d_exit, stage_off[i_new + 1] - stage_off[i_new])
                else:
                    lab = stage_off[i_new] + _pick(alpha_cum, i_new, stage_off[i_new + 1] - stage_off[i_new])
            else:
                lab = stage_off[i_new] + label0[req, i_new]
            label[req] = lab
            q = i_new if qmode == 0 else (lab if qmode == 1 else qr)
            _fifo_append(q_head, q_tail, nxt, q, req)
            wq[q] += 1
        # ---- decision epoch: the policy sees (waiting per queue, threads per coordinate) --
        while qmode != 2 or seen:
            for q in range(max(Q, D)):
                cnt[q] = 0
            if ptype == 0:
                room = (1 << 62) if base_total < 0 else base_total - K
                for i in range(N - 1, -1, -1):
                    take = min(wq[i], room) if room > 0 else 0
                    cnt[i] = take
                    room -= take
            elif ptype == 1:
                for i in range(N):
                    caps_room[i] = base_caps[i] - ks[i]
                    cnt[i] = min(wq[i], caps_room[i]) if caps_room[i] > 0 else 0
            elif ptype == 2:
                for q in range(Q):
                    row[q] = wq[q]
                if qmode == 2:
                    for i in range(N):
                        row[Q + i] = ks[i]
                else:
                    for d2 in range(D):
                        row[Q + d2] = kc[d2]
                _table_lookup(row, L, Q, tab_C, tab_kmax, tab_keys, tab_spawn, tab_ntab, cnt, qmode == 2)
                if qmode == 0:
                    # phase at start: one thread, then ask again once its phase is known
                    first = -1
                    for q in range(Q):
                        if cnt[q] > 0:
                            first = q
                            break
                    for q in range(Q):
                        cnt[q] = 0
                    if first >= 0 and K < tab_kmax:
                        cnt[first] = 1
            else:
                heuristic_decide(wq, kc, h_remaining, h_min_pair, h_wait, h_order, coord_stage, h_variant,
                                 cores, overhead, 1 << 62, cnt)
            started = 0
            for q in range(Q):
                for _ in range(cnt[q]):
                    if wq[q] <= 0:
                        break
                    if n_free == 0:
                        overflow = True
                        break
                    rq = q_head[q]
                    q_head[q] = nxt[rq]
                    if q_head[q] < 0:
                        q_tail[q] = -1
                    wq[q] -= 1
                    n_free -= 1
                    s2 = free[n_free]
                    slot_req[s2] = rq
                    i2 = stage[rq]
                    if rq >= n_warm and rq < n_warm + n_meas:
                        stage_wait[i2] += t - enter_t[rq]
                    lab2 = label[rq]
                    kc[lab2] += 1
                    ks[i2] += 1
                    K += 1
                    started += 1
                    if read_stage[i2] != 0 and pend >= 0:
                        # a commit is pending: a new reader waits for it, holding its slot
                        _fifo_append(rb_head, rb_tail, blk_next, 0, s2)
                        continue
                    if read_stage[i2] != 0:
                        readers += 1
                    if held[i2] >= lock_cap[i2]:
                        # the stage's lock is full: the thread waits for it, holding its slot
                        _fifo_append(blk_head, blk_tail, blk_next, i2, s2)
                        continue
                    held[i2] += 1
                    Kr += 1
                    lv2 = lv_start[lab2]
                    slot_lv[s2] = lv2
                    nlev[lv2] += 1
                    V = Vl[lv2]
                    thr_v[s2] = V + lv_thr[i2, lv2] if lv2 < n_lv - 1 else inf
                    if svc_mode == 0:
                        ev_v[s2] = V + np.random.exponential(1.0) / mu[lab2]
                        hsz[lv2] = _heap_push(hv2[lv2], hs2[lv2], hsz[lv2], min(ev_v[s2], thr_v[s2]), s2)
                    else:
                        # a PH path from the label, stretched to end exactly at the request's work
                        cur = lab2
                        total = 0.0
                        n_p = 0
                        while True:
                            total += np.random.exponential(1.0) / mu[cur]
                            if n_p < LMAX:
                                path_ph[s2, n_p] = cur
                                path_v[s2, n_p] = total
                                n_p += 1
                            nd2 = _pick(jump_cum, cur, D + 1)
                            if nd2 == D:
                                break
                            cur = nd2
                        w_req = work[rq, i2]
                        for m in range(n_p):
                            path_v[s2, m] = V + w_req * path_v[s2, m] / total
                        path_v[s2, n_p - 1] = V + w_req
                        path_len[s2] = n_p
                        slot_pos[s2] = 0
                        ev_v[s2] = path_v[s2, 0]
                        hsz[lv2] = _heap_push(hv2[lv2], hs2[lv2], hsz[lv2], min(ev_v[s2], thr_v[s2]), s2)
                if overflow:
                    break
            if overflow or not (ptype == 2 and qmode == 0 and started > 0):
                break
        if overflow:
            break
    return resp, stage_soj, stage_wait, area_K, area_N, area_ks, t_close - t_open, events, overflow, done_meas
