"""Goodness-of-fit figures a person can judge at a glance.

* Kolmogorov–Smirnov distance ``sup |F_n - F|`` for exact samples;
* data vs fit mean, SCV and tail quantiles (p50, p90, p99, p99.9);
* for a known target density (the Bobbio–Telek benchmark, Bobbio & Telek 1994): relative entropy
  ``∫ f ln(f / f̂)``, cdf area distance ``∫ |F - F̂|`` and relative errors of the first three
  moments (:func:`distance_to_density`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .data import Observations
from .phase_type import PhaseType

__all__ = ["Diagnostics", "diagnose", "distance_to_density"]

QUANTILES = (0.5, 0.9, 0.99, 0.999)


@dataclass(frozen=True)
class Diagnostics:
    """Summary comparing observations with a fitted distribution."""

    n: float
    data_mean: float
    fit_mean: float
    data_scv: float
    fit_scv: float
    ks: float
    quantiles: tuple[tuple[float, float, float], ...]  # (level, data, fit)

    def lines(self) -> list[str]:
        """Human-readable one-liners (used by ``overtake fit``)."""
        out = [
            f"mean  data {self.data_mean:.6g} s  fit {self.fit_mean:.6g} s",
            f"scv   data {self.data_scv:.4g}  fit {self.fit_scv:.4g}",
        ]
        if np.isfinite(self.ks):
            out.append(f"KS distance {self.ks:.4f}")
        for lev, d, f in self.quantiles:
            out.append(f"p{lev * 100:g}  data {d:.6g} s  fit {f:.6g} s")
        return out


def _weighted_quantile(x: npt.NDArray[np.float64], w: npt.NDArray[np.float64], q: float) -> float:
    c = np.cumsum(w) / w.sum()
    return float(x[min(int(np.searchsorted(c, q)), x.size - 1)])


def diagnose(obs: Observations, ph: PhaseType) -> Diagnostics:
    """Diagnostics of ``ph`` against exact observations (censored/binned: moments only roughly)."""
    x, w = obs.exact_values()
    m1, m2, _ = obs.moments()
    data_scv = m2 / m1**2 - 1
    ks = float("nan")
    qs: list[tuple[float, float, float]] = []
    if obs.kind == "exact":
        F = ph.cdf(x)
        c = np.cumsum(w) / w.sum()
        ks = float(max(np.max(np.abs(c - F)), np.max(np.abs(np.concatenate(([0.0], c[:-1])) - F))))
        fq = ph.ppf(np.array(QUANTILES))
        qs = [(lev, _weighted_quantile(x, w, lev), float(f)) for lev, f in zip(QUANTILES, fq)]
    return Diagnostics(obs.n, m1, ph.mean(), data_scv, ph.scv(), ks, tuple(qs))


def distance_to_density(
    ph: PhaseType,
    pdf: Callable[[npt.NDArray[np.float64]], npt.NDArray[np.float64]],
    cdf: Callable[[npt.NDArray[np.float64]], npt.NDArray[np.float64]],
    moments: tuple[float, float, float],
    upper: float,
    n_grid: int = 20001,
    lower: float | None = None,
) -> dict[str, float]:
    """Relative entropy, cdf area distance and relative moment errors against a target density.

    Integrals use the trapezoidal rule on ``[0, upper]`` (``upper`` past the target's support
    or far in its tail), on a log-spaced grid from ``lower`` if given (heavy tails), else a
    uniform one; moment errors are ``|m_k(fit) - m_k| / m_k`` for k = 1, 2, 3.
    """
    if lower is None:
        t = np.linspace(0.0, upper, n_grid)[1:]
    else:
        t = np.concatenate((np.linspace(0.0, lower, 200)[1:], np.geomspace(lower, upper, n_grid)[1:]))
    f = np.asarray(pdf(t), dtype=float)
    fh = np.maximum(np.asarray(ph.pdf(t), dtype=float), 1e-300)
    with np.errstate(divide="ignore", invalid="ignore"):
        integrand = np.where(f > 0, f * np.log(f / fh), 0.0)
    re = float(np.trapezoid(integrand, t))
    area = float(np.trapezoid(np.abs(np.asarray(cdf(t)) - np.asarray(ph.cdf(t))), t))
    errs = {f"m{k}_relerr": abs(ph.moment(k) - moments[k - 1]) / moments[k - 1] for k in (1, 2, 3)}
    return {"relative_entropy": re, "cdf_area": area, **errs}
