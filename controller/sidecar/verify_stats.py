"""The verdict of a live verification: is the policy's mean response time below Apache's default's?

The verifier (:mod:`overtake.controller.sidecar.verify`) runs the policy and Apache's default in
alternating windows, two per pair in a random order, and hands over one number per pair:
``d = ln(mean_default / mean_policy)``, the log ratio of the two windows' mean response times.
A log ratio because load swings scale both windows of a pair alike and cancel in it, and because
its mean maps to a gain of the means, ``gain = 1 - exp(-mean d)`` (0.2: the policy's mean
response time is 20 % below the default's).

Pairs are treated as independent draws: each pair covers its own stretch of traffic, the first
seconds of every window (where the previous window's requests still run) are not counted, and
a server forgets its queue within a few response times, far shorter than a window. Slow drift
of the load moves both windows of a pair together (the log ratio removes it), and the random
order within a pair turns what remains of a trend, or of the previous window's carry-over, into
noise of either sign rather than a bias for one arm. The CI of ``mean d`` is Student's t over the
pairs.

The verdict is read after every pair (a sequential test), so each look spends a share of the
error: with ``looks = max_pairs - min_pairs + 1`` looks, each CI is taken at confidence
``1 - (1 - level) / looks`` (Bonferroni), and the chance that any look wrongly excludes 0 on one
side stays at most ``(1 - level) / 2``, whatever the number of looks taken. :func:`judge`:

* ``keep`` (``better``): the CI lies above 0;
* ``fall_back`` (``worse``): the CI lies below 0;
* at ``max_pairs`` without either: ``keep`` (``max_pairs``) when the estimated gain is at
  least ``min_gain``, else ``fall_back`` (``no_gain``): a policy that has not shown the gain it
  costs to run is not kept;
* otherwise ``continue``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Verdict", "judge", "look_confidence", "t_quantile"]


@dataclass(frozen=True)
class Verdict:
    """What the pairs so far say."""

    decision: str  #: keep | fall_back | continue
    reason: str  #: better | worse | max_pairs | no_gain | too_few | undecided
    pairs: int
    gain: float | None  #: 1 - exp(-mean d); None before two pairs
    ci: tuple[float, float] | None  #: the gain's CI at :attr:`confidence`
    confidence: float  #: the confidence of each look's CI (Bonferroni share of the level)


def look_confidence(level: float, min_pairs: int, max_pairs: int) -> float:
    """The confidence of each look's CI so that all looks together keep ``level``."""
    return 1.0 - (1.0 - level) / (max_pairs - min_pairs + 1)


def _t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` degrees of freedom, by the finite series for an
    integer ``df`` (Abramowitz and Stegun, Handbook of Mathematical Functions, 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, acc = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        return 2.0 / math.pi * (theta + s * math.cos(theta) * acc)
    term, acc = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        acc += term
    return s * acc


def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = ``confidence`` (Student's t, ``df`` >= 1): bisection on the exact
    distribution (no scipy.stats in the sidecar's process)."""
    lo, hi = 0.0, 1.0
    while _t_within(hi, df) < confidence:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_within(mid, df) < confidence:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def _gain(d: float) -> float:
    return 1.0 - math.exp(-d)


def judge(log_ratios: Sequence[float], *, level: float = 0.95, min_pairs: int = 3, max_pairs: int = 20,
          min_gain: float = 0.02) -> Verdict:
    """The verdict on ``log_ratios`` (one ``ln(mean_default / mean_policy)`` per pair, in order).

    ``min_pairs`` >= 2 pairs are needed before any decision; at ``max_pairs`` there is always
    one (module docstring).
    """
    n = len(log_ratios)
    conf = look_confidence(level, min_pairs, max_pairs)
    if n < 2:
        return Verdict("continue", "too_few", n, None if n == 0 else _gain(log_ratios[0]), None, conf)
    mean = math.fsum(log_ratios) / n
    var = math.fsum((x - mean) ** 2 for x in log_ratios) / (n - 1)
    half = t_quantile(conf, n - 1) * math.sqrt(var / n)
    gain, ci = _gain(mean), (_gain(mean - half), _gain(mean + half))
    if n < min_pairs:
        return Verdict("continue", "too_few", n, gain, ci, conf)
    if mean - half > 0:
        return Verdict("keep", "better", n, gain, ci, conf)
    if mean + half < 0:
        return Verdict("fall_back", "worse", n, gain, ci, conf)
    if n >= max_pairs:
        return (Verdict("keep", "max_pairs", n, gain, ci, conf) if gain >= min_gain
                else Verdict("fall_back", "no_gain", n, gain, ci, conf))
    return Verdict("continue", "undecided", n, gain, ci, conf)
