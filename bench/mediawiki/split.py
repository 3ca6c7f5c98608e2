"""Where a request's time goes: the client's view joined with Apache's log and its time split.

For every request of a replay that Apache logged (joined on ``X-Bench-Id``), the client's time
of that request (first byte sent to last byte received) is cut into

* ``outside_apache``: client time - Apache's ``%D``: the sidecar's queue and the proxy's hand-off
  (under an arm without a sidecar, only the loopback and Apache's accept);
* ``apache_other``: ``%D`` - the handler's wall time: Apache's own work before and after the
  handler (mod_overtake_prio's gate, reading the request, logging);
* ``blocked``: off the CPU and not runnable in the handler: under mod_php, waiting for SQLite's
  lock (its busy handler sleeps); behind PHP-FPM, waiting for the FPM worker (the whole PHP time);
* ``run_queue``: runnable, waiting for the core;
* ``cpu``: the handler thread's CPU time;

the last three from mod_overtake_prio's request-time split (``OvertakeRequestTimes On``).
Means per stage (preview, view) and article size (``small``: at most the wiki's median number of
sections, ``large``: above), with the count of requests each mean is over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .server import AccessLine
from .workload import Replayed

__all__ = ["COMPONENTS", "time_split"]

COMPONENTS = ("client", "outside_apache", "apache_other", "blocked", "run_queue", "cpu")


def time_split(log: Sequence[AccessLine], got: Replayed, article: np.ndarray, units: np.ndarray) -> dict[str, Any]:
    """Mean seconds of each component (module docstring) per ``<stage>_<size>`` group; requests
    without the split count in ``client``, ``outside_apache`` only (``n_split`` says how many had it)."""
    median = float(np.median(units))
    rows: dict[str, list[list[float]]] = {}
    for x in log:
        if x.rid is None:
            continue
        _, i_s, st = x.rid.split("-")
        i, col = int(i_s), 0 if st == "p" else 1
        client = float(got.stages[i, col])
        if not np.isfinite(client):
            continue
        d = x.duration_us / 1e6
        if x.times is not None:
            wall, cpu, wait, blocked = (v / 1e6 for v in x.times)
            row = [client, client - d, d - wall, blocked, wait, cpu]
        else:
            row = [client, client - d, np.nan, np.nan, np.nan, np.nan]
        size = "large" if units[int(article[i])] > median else "small"
        rows.setdefault(f"{'preview' if col == 0 else 'view'}_{size}", []).append(row)
    out: dict[str, Any] = {}
    for group, r in sorted(rows.items()):
        a = np.asarray(r)
        has = ~np.isnan(a[:, 3])
        out[group] = {c: float(np.mean(a[has if j >= 2 else slice(None), j])) if (has.any() or j < 2) else None
                      for j, c in enumerate(COMPONENTS)} | {"n": int(a.shape[0]), "n_split": int(has.sum())}
    return out
