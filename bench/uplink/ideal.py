"""Ideal twin of the uplink testbed: the same (arrival, size) schedule on a fluid link.

A single link of ``rate`` bytes/s serves every response at once, either shared equally (PS, the
fluid limit of FAIR), by exact SRPT (the smallest remaining response alone), or by SRPT bands (the
highest non-empty band of remaining bytes shared equally, as the kernel's strict-priority
classes do; Harchol-Balter et al.; Schroeder and Harchol-Balter §3). No handshakes, round trips, slow start or losses: what the
scheduling discipline alone is worth on this trace, so a measured FAIR/SRPT ratio can be set
beside the ratio the trace allows.
"""

from __future__ import annotations

import numpy as np


def fluid_response_times(
    arrivals: np.ndarray,
    sizes: np.ndarray,
    rate: float,
    discipline: str,
    cutoffs: tuple[float, ...] = (),
) -> np.ndarray:
    """Sojourn time of each job (s). ``discipline`` is ``ps``, ``srpt`` or ``bands`` (then
    ``cutoffs`` in bytes, ascending: band b holds remaining sizes in (cutoffs[b-1], cutoffs[b]])."""
    if discipline not in ("ps", "srpt", "bands"):
        raise ValueError(f"discipline: one of ps, srpt, bands, got {discipline!r}")
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 bytes/s, got {rate}")
    order = np.argsort(arrivals, kind="stable")
    arr = np.asarray(arrivals, float)[order]
    work = np.asarray(sizes, float)[order]
    cuts = np.asarray(sorted(cutoffs), float)
    n = len(arr)
    done = np.full(n, np.nan)
    ids = np.empty(0, np.int64)
    rem = np.empty(0)
    t, i = 0.0, 0
    eps = 1e-9
    while i < n or len(ids):
        if not len(ids):
            t = max(t, arr[i])
        # who is served and at what share
        if not len(ids):
            share = np.empty(0, bool)
        elif discipline == "ps":
            share = np.ones(len(ids), bool)
        elif discipline == "srpt":
            share = np.zeros(len(ids), bool)
            share[int(np.argmin(rem))] = True
        else:
            band = np.searchsorted(cuts, rem - eps, side="left")
            share = band == band.min()
        k = int(share.sum())
        dt = np.inf
        if k:
            served = rem[share]
            dt = served.min() * k / rate  # first completion in the served set
            if discipline == "bands":
                # a served job dropping into a higher band changes the served set
                band_lo = np.concatenate(([0.0], cuts))[
                    np.searchsorted(cuts, served - eps, side="left")]
                above = served - band_lo
                above = above[above > eps]
                if len(above):
                    dt = min(dt, above.min() * k / rate)
        if i < n and arr[i] - t < dt:
            dt = arr[i] - t
            arrive = True
        else:
            arrive = False
        if k:
            rem[share] -= dt * rate / k
        t += dt
        fin = rem <= eps * max(1.0, rate * 1e-6)
        if fin.any():
            done[ids[fin]] = t
            ids, rem = ids[~fin], rem[~fin]
        if arrive:
            ids = np.append(ids, i)
            rem = np.append(rem, work[i])
            i += 1
    out = np.empty(n)
    out[order] = done - arr
    return out
