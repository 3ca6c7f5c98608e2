"""The overtaking heuristic's decision (:mod:`overtake.mdp.heuristic`) as numba kernels: one state
(called by the simulator's event loop, :mod:`overtake.mdp._simkernel`) and a block of state rows.

Apart from the rest of the heuristic so that building or simulating with it imports no numba
where the simulator's ahead-of-time extension (:mod:`overtake.mdp._simcall`) carries the loop and
the block of rows (the heuristic's ``actions`` call them through it).
"""

from __future__ import annotations

import numpy as np

from overtake.jit import njit

from .model import capacity_compiled as _cap

__all__ = ["decide_rows", "heuristic_decide"]


@njit(cache=True)
def heuristic_decide(w, k, remaining, min_pair, wait, order, coord_stage, variant, cores, overhead, k_cap, out):  # type: ignore[no-untyped-def]
    """Threads to start per coordinate queue for one state (w waiting, k active per coordinate).

    Writes ``out`` (length D, no allocation: called at every simulator event) and returns the
    number of threads started. ``w`` and ``k`` are not modified.
    """
    D = remaining.size
    K = 0
    for d in range(D):
        out[d] = 0
        K += k[d]
    started = 0
    scale = 0.0
    for d in range(D):
        scale += remaining[d]
    eps = 1e-10 * scale
    for idx in range(D):
        x = order[idx]
        while out[x] < w[x] and K < k_cap:
            accept = False
            if K == 0:
                accept = True
            else:
                # free capacity: the new thread does not slow the others down
                cK = _cap(K, cores, overhead)
                cK1 = _cap(K + 1, cores, overhead)
                if cK1 / (K + 1) >= cK / K * (1.0 - 1e-12):
                    accept = True
                elif variant == 0:
                    delta = 0.0
                    for a in range(D):
                        n_a = k[a] + out[a]  # active now, including threads started this epoch
                        if n_a > 0:
                            delta += n_a * (2.0 * min_pair[x, a] - wait[x, a])
                    accept = delta < -eps
                else:
                    for a in range(D):
                        if k[a] + out[a] > 0 and coord_stage[a] >= coord_stage[x] and remaining[x] < remaining[a] - eps:
                            accept = True
                            break
            if not accept:
                break
            out[x] += 1
            K += 1
            started += 1
    return started


@njit(cache=True)
def decide_rows(rows, remaining, min_pair, wait, order, coord_stage, variant, cores, overhead, k_cap):  # type: ignore[no-untyped-def]
    D = remaining.size
    S = rows.shape[0]
    res = np.zeros((S, D), dtype=np.int64)
    out = np.zeros(D, dtype=np.int64)
    for s in range(S):
        heuristic_decide(rows[s, :D], rows[s, D:], remaining, min_pair, wait, order, coord_stage, variant,
                         cores, overhead, k_cap, out)
        res[s, :] = out
    return res
