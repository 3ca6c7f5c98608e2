"""Per-arm figures and the paired gain of an arm over Apache's default.

Conventions (those of :mod:`overtake.controller.harness.loadgen`, whose paired CI is reused):
failed transactions are left out of the times and counted apart; the first 5 % of the
successful transactions are warm-up. The gain of an arm over the default is
``(W_default - W_arm) / W_arm`` over the transactions that succeeded under both (positive: the
arm is faster), its 95 % half-width from 20 paired batch means of the per-transaction
differences (Student t, 19 degrees of freedom), as :func:`~overtake.controller.harness.loadgen.paired_gain_ci`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from overtake.controller.harness.loadgen import paired_gain_ci

__all__ = ["WARMUP", "arm_summary", "paired_gain", "slowdowns", "spread"]

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
