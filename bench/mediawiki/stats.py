"""Per-arm figures and the paired gain of an arm over Apache's default.

Conventions (those of :mod:`overtake.controller.harness.loadgen`, whose paired CI is reused):
failed transactions are left out of the times and counted apart; the first 5 % of the
successful transactions are warm-up. The gain of an arm over the default is
``(W_default - W_arm) / W_arm`` over the transactions that succeeded under both (positive: the
arm is faster), its 95 % half-width from 20 paired batch means of the per-transaction
differences (Student t, 19 degrees of freedom), as :func:`~overtake.controller.harness.loadgen.paired_gain_ci`.

When the arms replay the trace in interleaved blocks (A B, B A, ...: the machine's speed drifts
between blocks more than the effect), :func:`block_gain` is the gain's estimate and CI: the ratio
of the two arms' total response time over the transactions both completed, its 95 % half-width
from the blocks as independent clusters (a ratio estimator linearised per block, Student t with
blocks - 1 degrees of freedom), so the block-to-block drift that does not cancel is in the CI.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats as sps

from overtake.controller.harness.loadgen import paired_gain_ci

__all__ = ["WARMUP", "arm_summary", "block_gain", "block_order", "blocks", "p99_ratio", "paired_gain", "slowdowns",
           "spread"]

WARMUP = 0.05


def _steady(rt: np.ndarray) -> np.ndarray:
    x = rt[~np.isnan(rt)]
    return x[int(WARMUP * x.size):]


def arm_summary(rt: np.ndarray, outcomes: Sequence[str]) -> dict[str, Any]:
    """Mean and p99 response time (s) of the successful transactions after warm-up, the failures
    (every transaction that did not succeed, warm-up included) and their kinds."""
    x = _steady(rt)
    kinds = Counter(o for o in outcomes if o != "ok")
    return {"mean": float(x.mean()) if x.size else float("nan"),
            "p99": float(np.percentile(x, 99)) if x.size else float("nan"),
            "median": float(np.median(x)) if x.size else float("nan"),
            "failures": int(sum(kinds.values())), "failure_kinds": dict(sorted(kinds.items())),
            "transactions": len(outcomes)}


def paired_gain(arm: np.ndarray, default: np.ndarray) -> tuple[float, float]:
    """The gain of ``arm`` over ``default`` on the transactions both completed, and its 95 %
    half-width (both fractions); NaN when fewer than 40 pairs remain."""
    ok = ~(np.isnan(arm) | np.isnan(default))
    if int(ok.sum()) < 40:
        return float("nan"), float("nan")
    warm = int(WARMUP * int(ok.sum()))
    a, d = arm[ok][warm:], default[ok][warm:]
    return float((d.mean() - a.mean()) / a.mean()), paired_gain_ci(arm, default)


def blocks(n: int, size: int) -> list[tuple[int, int]]:
    """``n`` transactions cut into ``n // size`` consecutive blocks of near-equal length (at
    least one), as ``(first, end)`` index pairs."""
    if n < 1 or size < 1:
        raise ValueError(f"blocks: need n >= 1 and size >= 1, got n={n}, size={size}")
    cuts = np.linspace(0, n, max(1, n // size) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def block_order(arms: Sequence[str], run: int, block: int) -> list[str]:
    """The arms' order in one block: rotated by the run, reversed in every other block (A B, B A,
    A B, ...), so that every arm's mean position over two blocks is the same and a drift of the
    machine's speed that is linear in time cancels between the arms."""
    k = run % len(arms)
    base = list(arms[k:]) + list(arms[:k])
    return base[::-1] if block % 2 else base


def block_gain(arm: np.ndarray, default: np.ndarray, bounds: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """The gain of ``arm`` over ``default`` replayed in the blocks ``bounds``: ``(ΣW_default -
    ΣW_arm) / ΣW_arm`` over the transactions both completed, its 95 % half-width with the blocks as
    clusters (module docstring; NaN with fewer than two blocks or 40 pairs) and each block's gain."""
    ok = ~(np.isnan(arm) | np.isnan(default))
    a_b = np.array([float(arm[lo:hi][ok[lo:hi]].sum()) for lo, hi in bounds])
    d_b = np.array([float(default[lo:hi][ok[lo:hi]].sum()) for lo, hi in bounds])
    per = [float(d / a - 1) if a > 0 else float("nan") for a, d in zip(a_b, d_b, strict=True)]
    if int(ok.sum()) < 40 or not a_b.sum() > 0:
        return {"gain": float("nan"), "ci95": float("nan"), "per_block": per, "blocks": len(bounds)}
    r = d_b.sum() / a_b.sum()
    nb = len(bounds)
    if nb < 2:
        return {"gain": float(r - 1), "ci95": float("nan"), "per_block": per, "blocks": nb}
    resid = d_b - r * a_b
    se = float(np.sqrt(nb / (nb - 1) * np.sum(resid**2)) / a_b.sum())
    return {"gain": float(r - 1), "ci95": float(sps.t.ppf(0.975, nb - 1) * se), "per_block": per, "blocks": nb}


def p99_ratio(arm: np.ndarray, default: np.ndarray, bounds: Sequence[tuple[int, int]], *, reps: int = 2000,
              seed: int = 0) -> dict[str, Any]:
    """The p99 of ``arm`` over the p99 of ``default`` on the transactions both completed after
    warm-up, and its 95 % interval from a bootstrap that draws whole blocks ``bounds`` with
    replacement: a tail is made of bursts, whose transactions are neither independent nor apart
    from their block, so the transaction is the wrong unit to resample. None with fewer than 40
    pairs or two blocks."""
    ok = ~(np.isnan(arm) | np.isnan(default))
    if int(ok.sum()) < 40 or len(bounds) < 2:
        return {"ratio": None, "ci95": None, "blocks": len(bounds)}
    ok[np.flatnonzero(ok)[:int(WARMUP * int(ok.sum()))]] = False
    idx = [np.arange(lo, hi)[ok[lo:hi]] for lo, hi in bounds]

    def ratio(take: np.ndarray) -> float:
        return float(np.percentile(arm[take], 99) / np.percentile(default[take], 99))

    rng = np.random.default_rng(seed)
    boot = [ratio(np.concatenate([idx[j] for j in rng.integers(0, len(idx), len(idx))])) for _ in range(reps)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"ratio": ratio(np.flatnonzero(ok)), "ci95": [float(lo), float(hi)], "blocks": len(bounds)}


def slowdowns(begin_s: np.ndarray, duration_s: np.ndarray, idle_s: np.ndarray, is_preview: np.ndarray) -> dict[str, Any]:
    """Time in Apache over the request's idle service time, per stage, and for previews split by
    whether another preview was in Apache at any moment of their stay.

    A lock that lets one preview run at a time shows as previews that overlapped another one
    being slowed far more than those that did not (and than views), beyond what sharing one
    core explains.
    """
    end = begin_s + duration_s
    slow = duration_s / idle_s
    p = np.flatnonzero(is_preview)
    # preview i overlaps preview j when each starts before the other ends
    ov = (begin_s[p][:, None] < end[p][None, :]) & (begin_s[p][None, :] < end[p][:, None])
    np.fill_diagonal(ov, False)
    overlapped = ov.any(axis=1)

    def mean(x: np.ndarray) -> float | None:
        return float(x.mean()) if x.size else None

    return {"preview": mean(slow[p]), "view": mean(slow[~is_preview]),
            "preview_overlapped": mean(slow[p][overlapped]), "preview_alone": mean(slow[p][~overlapped]),
            "previews_overlapped": int(overlapped.sum()), "previews": int(p.size)}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, standard deviation, least and greatest of one figure over the runs."""
    v = np.asarray([x for x in values if np.isfinite(x)], float)
    if v.size == 0:
        return {"mean": float("nan"), "sd": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if v.size > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}
