"""Hyper-Erlang branch shapes and starting points for the closed-form EM of
:mod:`overtake.fitting._hypererlang` (kept apart from the compiled kernel: choosing shapes needs no numba)."""

from __future__ import annotations

import numpy as np


def partitions(n: int, max_parts: int | None = None) -> list[tuple[int, ...]]:
    """All multisets of positive branch orders summing to ``n`` (descending tuples)."""
    out: list[tuple[int, ...]] = []

    def rec(rest: int, cap: int, acc: tuple[int, ...]) -> None:
        if rest == 0:
            out.append(acc)
            return
        if max_parts is not None and len(acc) >= max_parts:
            return
        for k in range(min(rest, cap), 0, -1):
            rec(rest - k, k, acc + (k,))

    rec(n, n, ())
    return out


def initial(x: np.ndarray, w: np.ndarray, shapes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Starting point: split the sorted data into equal-weight groups, give the largest Erlang
    orders to the groups with the smallest SCV, and match each branch's mean to its group."""
    M = len(shapes)
    order = np.argsort(x)
    xs, ws = x[order], w[order]
    cw = np.cumsum(ws) / ws.sum()
    grp = np.minimum((cw * M).astype(np.int64), M - 1)
    means = np.empty(M)
    scvs = np.empty(M)
    for g in range(M):
        sel = grp == g
        if not sel.any():
            means[g] = xs.mean() if g == 0 else means[g - 1] * 2
            scvs[g] = 1.0
            continue
        wg = ws[sel]
        mu = float(wg @ xs[sel] / wg.sum())
        var = float(wg @ (xs[sel] - mu) ** 2 / wg.sum())
        means[g] = max(mu, 1e-300)
        scvs[g] = var / means[g] ** 2
    sh = np.array(sorted(shapes, reverse=True), dtype=np.float64)
    by_scv = np.argsort(scvs)
    assigned = np.empty(M)
    assigned[by_scv] = sh
    lam = assigned / means
    pi = np.full(M, 1.0 / M)
    return assigned, pi, lam
