"""Diagnostic figure: histogram with fitted density, and log-log survival of data vs fit.

Builds a :class:`matplotlib.figure.Figure` without pyplot (no global state, no display); the
caller saves it (``fig.savefig(path)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .phase_type import PhaseType

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["fit_figure"]


def fit_figure(x: npt.ArrayLike, ph: PhaseType, *, title: str = "", censored: npt.ArrayLike | None = None) -> Figure:
    """Two panels: density (log-spaced histogram) and empirical vs fitted survival, log-log.

    Censored samples are left out of the histogram; the empirical survival is Kaplan–Meier when
    ``censored`` is given, so tails show honestly.
    """
    from matplotlib.figure import Figure

    xa = np.asarray(x, dtype=np.float64)
    c = np.zeros(xa.size, dtype=bool) if censored is None else np.asarray(censored, dtype=bool)
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    exact = xa[~c]
    lo, hi = max(exact.min(), 1e-9), exact.max()
    bins = np.geomspace(lo, hi, 60)
    ax1.hist(exact, bins=bins, density=True, alpha=0.5, label=f"data (n={exact.size})")
    grid = np.geomspace(lo, hi, 400)
    ax1.plot(grid, ph.pdf(grid), label=f"fit ({ph.structure}, p={ph.order})")
    ax1.set_xscale("log")
    ax1.set_xlabel("duration (s)")
    ax1.set_ylabel("density")
    ax1.legend()
    # empirical survival (Kaplan–Meier handles right-censoring; equals 1 - ECDF otherwise)
    order = np.argsort(xa, kind="stable")
    xs, cs = xa[order], c[order]
    at_risk = xs.size - np.arange(xs.size)
    factors = np.where(cs, 1.0, 1.0 - 1.0 / at_risk)
    surv = np.cumprod(factors)
    keep = ~cs & (surv > 0)
    ax2.step(xs[keep], surv[keep], where="post", label="data")
    ax2.plot(grid, ph.sf(grid), label="fit")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("duration (s)")
    ax2.set_ylabel("P(X > x)")
    ax2.legend()
    if title:
        fig.suptitle(title)
    return fig
