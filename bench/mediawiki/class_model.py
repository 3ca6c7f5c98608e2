"""The size class on the wiki's own articles: which quantile the model says to demote above.

``--cpu-priority class`` starts a view whose predicted holding time exceeds its stage's
``class_quantile`` of recent predictions at nice 19 (controller/sidecar/size_class.py). Which
quantile is best depends on the wiki's cost distribution and the load, so the bench asks the model
with the lock instead of fixing it: an event simulation of one core shared by weight among the
requests that run (the kernel's CFS weights: 1024 at nice 0, 15 at nice 19), the preview stage
holding the database lock (one preview runs, the others wait without using the CPU), driven by
the calibration's idle service time of every article, so the preview and the view of one
transaction keep their measured correlation (a fitted tandem would lose it).

Arms simulated on the same Poisson traces (common random numbers):

* ``default``: every request runs at once, the waiting previews take the lock first come first
  served (any order blind to size gives the same mean wait);
* ``class q``: the size-class arm: the sidecar holds previews and releases the one with the
  highest response ratio (wait + predicted) / predicted first (it keys them on their body size;
  the prediction here is the article's idle preview time), each view of an article whose idle view time is above
  the ``q`` quantile of the articles' (the sidecar's predictions rank views as their idle times
  do: the key is the preview's body size, correlated with the view's cost) starts at nice 19, and
  only once a view of the same article has completed (the sidecar predicts nothing for an
  unseen key); ``class none`` is that arm with no view demoted.

:func:`choose` returns every quantile's mean response time and gain over ``default`` and the best
quantile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BUSY_DELAYS", "NICE0", "NICE19", "QUANTILES", "choose", "simulate"]

#: SQLite's busy-handler sleeps (s) between tries, the last repeated (sqlite3.c, sqliteDefaultBusyCallback)
BUSY_DELAYS = (0.001, 0.002, 0.005, 0.010, 0.015, 0.020, 0.025, 0.025, 0.025, 0.050, 0.050, 0.100)
NICE0, NICE19 = 1024.0, 15.0  # CFS load weights (kernel/sched/core.c, sched_prio_to_weight)
#: quantiles the bench evaluates (demoting the largest half down to the largest hundredth)
QUANTILES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)


@dataclass
class _Job:
    tx: int
    preview: bool
    rem: float
    weight: float


def simulate(arrival: np.ndarray, article: np.ndarray, preview_s: np.ndarray, view_s: np.ndarray, *,
             low: np.ndarray | None = None, preview_order: str = "fifo", learn: bool = True,
             low_weight: float = NICE19, readers: bool = False) -> np.ndarray:
    """Response time of every transaction (arrival to the view's end), seconds.

    ``low``: per article, whether its views start at the low weight (None: none); ``learn``: only
    once a view of the article has completed; ``preview_order``: ``fifo``, ``spt`` (shortest
    idle preview first) or ``ratio`` (the sidecar's: highest (wait + idle preview) / idle preview
    first) for the previews waiting for the lock; ``readers``: the rollback journal, where views
    read under the lock (SQLite's SHARED), so a preview's commit waits, off the CPU, until no view
    runs, trying again after the busy handler's sleeps (:data:`BUSY_DELAYS`). No view starts while a
    commit waits (views start only at a commit), so no reader ever blocks behind one here.
    """
    if preview_order not in ("fifo", "spt", "ratio"):
        raise ValueError(f"preview_order: fifo, spt or ratio, got {preview_order!r}")
    n = len(arrival)
    seen = np.zeros(len(view_s), bool)
    rt = np.full(n, np.nan)
    active: list[_Job] = []
    waiting: list[int] = []  # transactions whose preview waits for the lock
    holder = False
    t, nxt = 0.0, 0
    pending: _Job | None = None  # the preview whose commit waits for the running views
    retry, tries = np.inf, 0

    def start_preview(i: int) -> None:
        active.append(_Job(i, True, float(preview_s[article[i]]), NICE0))

    def commit(done: _Job) -> None:
        """The preview ``done`` commits: the lock to the next waiting preview, its view starts."""
        nonlocal holder
        a = int(article[done.tx])
        holder = False
        if waiting:
            pick = _next_preview(preview_order, waiting, t, arrival, preview_s[article[waiting]])
            holder = True
            start_preview(waiting.pop(pick))
        demote = low is not None and bool(low[a]) and (seen[a] or not learn)
        active.append(_Job(done.tx, False, float(view_s[a]), low_weight if demote else NICE0))

    while nxt < n or active or pending is not None:
        ta = float(arrival[nxt]) if nxt < n else np.inf
        if active:
            total = sum(j.weight for j in active)
            k = min(range(len(active)), key=lambda m: active[m].rem / active[m].weight)
            dt = active[k].rem * total / active[k].weight
        else:
            total, k, dt = 1.0, -1, np.inf
        if pending is not None and retry <= min(ta, t + dt):  # the waiting commit tries again
            for j in active:
                j.rem -= (retry - t) * j.weight / total
            t = retry
            if any(not j.preview for j in active):
                retry, tries = t + BUSY_DELAYS[min(tries, len(BUSY_DELAYS) - 1)], tries + 1
            else:
                commit(pending)
                pending, retry = None, np.inf
            continue
        if ta <= t + dt:  # an arrival first: everyone runs until then
            for j in active:
                j.rem -= (ta - t) * j.weight / total
            t = ta
            if holder:
                waiting.append(nxt)
            else:
                holder = True
                start_preview(nxt)
            nxt += 1
            continue
        for j in active:
            j.rem -= dt * j.weight / total
        t += dt
        done = active.pop(k)
        a = int(article[done.tx])
        if done.preview and readers and any(not j.preview for j in active):
            pending, retry, tries = done, t + BUSY_DELAYS[0], 1
        elif done.preview:
            commit(done)
        else:
            rt[done.tx] = t - arrival[done.tx]
            seen[a] = True
    return rt


def _next_preview(order: str, waiting: list[int], t: float, arrival: np.ndarray, cost: np.ndarray) -> int:
    """Index in ``waiting`` of the preview to take the lock (``cost``: each one's idle preview time)."""
    if order == "fifo":
        return 0
    if order == "spt":
        return int(np.argmin(cost))
    return int(np.argmax((t - arrival[waiting] + cost) / cost))


def _traces(rate: float, articles: int, transactions: int, seeds: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for s in seeds:
        rng = np.random.default_rng(s)
        out.append((np.cumsum(rng.exponential(1.0 / rate, size=transactions)), rng.integers(0, articles, size=transactions)))
    return out


def choose(preview_s: np.ndarray, view_s: np.ndarray, rate: float, *, quantiles: Sequence[float] = QUANTILES,
           transactions: int = 3000, seeds: Sequence[int] = (1, 2, 3, 4), warmup: float = 0.05,
           readers: bool = False, block: int | None = None) -> dict[str, Any]:
    """Mean response time (s) of ``default``, ``class none`` and ``class q`` for each quantile on
    the same traces, each arm's gain over ``default`` ((W_default - W_arm) / W_arm, as the bench
    measures it) and ``chosen``: the quantile with the least mean. ``readers``: the rollback
    journal's commits waiting for the views (:func:`simulate`); ``block``: each trace replayed in
    blocks of that many transactions, each from an idle server, as the bench replays it (no
    warm-up then), instead of one stationary run."""
    preview_s, view_s = np.asarray(preview_s, float), np.asarray(view_s, float)
    if preview_s.shape != view_s.shape or preview_s.ndim != 1 or preview_s.size < 2:
        raise ValueError("preview_s, view_s: one idle time per article each, the same number (>= 2)")
    if not rate > 0 or rate * float(np.mean(preview_s + view_s)) >= 1:
        raise ValueError(f"rate: the load rate x mean(preview + view) must be in (0, 1), got rate {rate!r}")
    if transactions < 100:
        raise ValueError(f"transactions: at least 100 per trace, got {transactions}")
    traces = _traces(rate, preview_s.size, transactions, seeds)
    skip = int(warmup * transactions)

    if block is not None and block < 1:
        raise ValueError(f"block: transactions per block replayed from idle, >= 1 or None, got {block!r}")

    def one(a: np.ndarray, art: np.ndarray, **kw: Any) -> np.ndarray:
        if block is None:
            return simulate(a, art, preview_s, view_s, readers=readers, **kw)[skip:]
        return np.concatenate([simulate(a[lo:lo + block] - a[lo], art[lo:lo + block], preview_s, view_s,
                                        readers=readers, **kw) for lo in range(0, a.size, block)])

    def mean(**kw: Any) -> float:
        return float(np.mean([one(a, art, **kw).mean() for a, art in traces]))

    default = mean(preview_order="fifo")
    arms = {"none": mean(preview_order="ratio")}
    for q in quantiles:
        if not 0 < q < 1:
            raise ValueError(f"quantiles: each in (0, 1), got {q!r}")
        arms[f"{q:g}"] = mean(preview_order="ratio", low=view_s > np.quantile(view_s, q))
    best = min((q for q in quantiles), key=lambda q: arms[f"{q:g}"])
    return {"default": default,
            "arms": {k: {"mean": v, "gain": default / v - 1} for k, v in arms.items()},
            "chosen": float(best), "transactions": transactions, "traces": len(traces), "rate": rate,
            "weights": [NICE0, NICE19], "readers": readers, "block": block}
