"""Moment matching: closed-form phase-type distributions with given moments.

Two moments (Tijms, *Stochastic Models: An Algorithmic Approach*, Wiley 1994, §A.2, as used by
van der Weij et al., "Dynamic thread assignment"):

* ``scv > 1``: hyperexponential H2 with *balanced means* ``p1/mu1 = p2/mu2``,
  ``p1 = (1 + sqrt((c2-1)/(c2+1)))/2``, ``mu1 = 2 p1/m``, ``mu2 = 2 p2/m``;
* ``scv == 1``: exponential;
* ``1/k <= scv <= 1/(k-1)``: mixture of Erlang(k-1) and Erlang(k) with a common rate,
  ``p = (k c2 - sqrt(k(1+c2) - k^2 c2))/(1+c2)`` (weight of Erlang(k-1)), ``mu = (k-p)/m``.

Three moments: mixture of two Erlangs of a common order k (Johnson & Taaffe, "Matching moments
to phase distributions: mixtures of Erlang distributions of common order", Stochastic Models 5
(1989)); k = 1 is the three-moment H2 of Whitt (1982) / Tijms (1994), feasible iff
``m1 m3 > 1.5 m2^2``. The smallest feasible k is used. With ``n_j = m_j / (k (k+1) ... (k+j-1))``
the branch means ``y1, y2`` are the roots of ``y^2 - b y + c`` with
``b = (n3 - n1 n2)/(n2 - n1^2)``, ``c = b n1 - n2`` (two-point Gauss quadrature).
"""

from __future__ import annotations

import math

import numpy as np

from .errors import MomentError
from .families import erlang, exponential, hyper_erlang, hyperexponential
from .phase_type import PhaseType

__all__ = ["match_three_moments", "match_two_moments"]

MAX_ERLANG_ORDER = 500


def _positive(name: str, v: float) -> float:
    v = float(v)
    if not (math.isfinite(v) and v > 0):
        raise MomentError(f"{name} must be finite and > 0, got {v}")
    return v


def match_two_moments(mean: float, scv: float) -> PhaseType:
    """Phase-type distribution with the given mean (seconds) and squared coefficient of variation.

    Parameters
    ----------
    mean : float
        Target mean, > 0.
    scv : float
        Target ``var/mean**2``, > 0; at most ``MAX_ERLANG_ORDER`` phases are used, so
        ``scv >= 1/MAX_ERLANG_ORDER``.

    Returns
    -------
    PhaseType
        Balanced-means H2 (scv > 1), exponential (scv = 1) or mixed Erlang(k-1, k) with a
        common rate (scv < 1), following Tijms (1994) §A.2.
    """
    m = _positive("mean", mean)
    c2 = _positive("scv", scv)
    if abs(c2 - 1.0) <= 1e-12:
        return exponential(1.0 / m)
    if c2 > 1.0:
        p1 = 0.5 * (1.0 + math.sqrt((c2 - 1.0) / (c2 + 1.0)))
        p2 = 1.0 - p1
        return hyperexponential([p1, p2], [2.0 * p1 / m, 2.0 * p2 / m])
    k = math.ceil(1.0 / c2 - 1e-12)
    if k > MAX_ERLANG_ORDER:
        raise MomentError(f"scv must be >= 1/{MAX_ERLANG_ORDER} (order cap), got {c2}")
    if abs(c2 - 1.0 / k) <= 1e-12:
        return erlang(k, k / m)
    p = (k * c2 - math.sqrt(k * (1.0 + c2) - k * k * c2)) / (1.0 + c2)
    mu = (k - p) / m
    # Erlang(k-1) w.p. p and Erlang(k) w.p. 1-p on one chain: enter at phase 1 or 0
    T = np.diag(np.full(k, -mu)) + np.diag(np.full(k - 1, mu), 1)
    alpha = np.zeros(k)
    alpha[0], alpha[1] = 1.0 - p, p
    return PhaseType(alpha, T, structure="cf1")


def match_three_moments(m1: float, m2: float, m3: float) -> PhaseType:
    """Mixture of two Erlangs of common order k matching the first three raw moments.

    Parameters
    ----------
    m1, m2, m3 : float
        Raw moments ``E[X], E[X^2], E[X^3]`` (seconds, seconds², seconds³).

    Raises
    ------
    MomentError
        If the moments are not those of a positive distribution, or no common order
        ``k <= MAX_ERLANG_ORDER`` reaches them (e.g. ``m3`` too small for the variability).
    """
    m1 = _positive("m1", m1)
    m2 = _positive("m2", m2)
    m3 = _positive("m3", m3)
    if m2 <= m1 * m1:
        raise MomentError(f"m2 must exceed m1**2 = {m1 * m1} (positive variance), got {m2}")
    if m1 * m3 <= m2 * m2:
        raise MomentError(f"m3 must exceed m2**2/m1 = {m2 * m2 / m1} (Cauchy-Schwarz), got {m3}")
    for k in range(1, MAX_ERLANG_ORDER + 1):
        n1 = m1 / k
        n2 = m2 / (k * (k + 1))
        n3 = m3 / (k * (k + 1) * (k + 2))
        var = n2 - n1 * n1
        if var <= 0:
            continue  # scv <= 1/k: need a larger common order
        if n1 * n3 - n2 * n2 < 0:
            continue
        b = (n3 - n1 * n2) / var
        c = b * n1 - n2
        disc = b * b - 4.0 * c
        if c <= 0 or disc < 0:
            continue
        sq = math.sqrt(disc)
        y1, y2 = 0.5 * (b + sq), 0.5 * (b - sq)
        if y2 <= 0:
            continue
        if y1 - y2 <= 1e-12 * y1:
            return erlang(k, 1.0 / y1)
        p = (n1 - y2) / (y1 - y2)
        if not 0 <= p <= 1:
            continue
        if k == 1:
            return hyperexponential([p, 1 - p], [1.0 / y1, 1.0 / y2])
        return hyper_erlang([p, 1 - p], [k, k], [1.0 / y1, 1.0 / y2])
    raise MomentError(
        f"no mixture of two Erlangs of common order <= {MAX_ERLANG_ORDER} has moments "
        f"({m1}, {m2}, {m3}); m3 is outside the reachable region for this scv"
    )
