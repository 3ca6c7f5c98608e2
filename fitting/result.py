"""Frozen result objects returned by the fitters."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from overtake.phases import phase_names

from .phase_type import PhaseType

__all__ = ["FitResult", "OrderScore"]


@dataclass(frozen=True)
class OrderScore:
    """One row of an order-selection table (``order="auto"``)."""

    order: int
    loglik: float
    aic: float
    bic: float
    n_params: int
    converged: bool
    n_iter: int


@dataclass(frozen=True)
class FitResult:
    """Outcome of a phase-type fit.

    Attributes
    ----------
    ph : PhaseType
        The fitted distribution.
    loglik : float
        Log-likelihood of ``ph`` on the data (weighted; for bins, of the bin probabilities).
    loglik_trace : tuple of float
        Log-likelihood at each EM iteration of the final run.
    n_iter : int
        E-steps on the full data in the final run. Starting points are screened, and the best
        pre-converged, on an aggregated copy of the data (G-FIT-style log-spaced trace
        aggregation) first; those cheap iterations are not counted here.
    converged : bool
        Whether the relative log-likelihood change fell below ``rtol`` before ``max_iter``.
    aic, bic : float
        ``2k - 2 LL`` and ``k ln n - 2 LL`` with ``k = n_params`` and ``n`` the total weight.
    n : float
        Number of observations (total weight).
    n_params : int
        Free parameters of the structure.
    structure : str
        ``cf1``, ``coxian``, ``general``, ``hyperexp`` or ``hypererlang``.
    shapes : tuple of int, optional
        Erlang branch orders for hyper-Erlang fits.
    mean_preserved : bool
        True if the time scale was fixed so that the fitted mean equals the sample mean.
    selection : tuple of OrderScore
        AIC/BIC for every order tried when the order was chosen automatically.
    """

    ph: PhaseType
    loglik: float
    loglik_trace: tuple[float, ...]
    n_iter: int
    converged: bool
    aic: float
    bic: float
    n: float
    n_params: int
    structure: str
    shapes: tuple[int, ...] | None = None
    mean_preserved: bool = False
    selection: tuple[OrderScore, ...] = field(default=())

    @staticmethod
    def criteria(loglik: float, n_params: int, n: float) -> tuple[float, float]:
        """``(AIC, BIC)``."""
        return 2 * n_params - 2 * loglik, n_params * math.log(max(n, 1.0)) - 2 * loglik

    def to_dict(self, *, time_unit: float = 1.0) -> dict[str, Any]:
        """``alpha``, ``T`` and metadata (structure, order, loglik, n, converged, iterations, ...).

        The phases are written from the shortest mean to the longest (:meth:`PhaseType.by_mean`,
        the same distribution), so phase 1 is the shortest kind whatever the structure; ``phases``
        lists each one's name (:func:`overtake.phases.phase_names`), start probability and mean.
        ``time_unit`` is the seconds per unit of the fitted times (1: the data were seconds, as
        every reader of :mod:`overtake.fitting.io` gives them); a scenario built on this fit takes
        it as its unit.
        """
        ph = self.ph.by_mean()
        meta: dict[str, Any] = {
            "loglik": self.loglik,
            "n": self.n,
            "converged": self.converged,
            "iterations": self.n_iter,
            "aic": self.aic,
            "bic": self.bic,
            "n_params": self.n_params,
            "mean": ph.mean(),
            "scv": ph.scv(),
            "mean_preserved": self.mean_preserved,
            "time_unit": float(time_unit),
            "phases": [{"name": n, "start": float(a), "mean": float(m)}
                       for n, a, m in zip(phase_names(ph.T), ph.alpha, ph.phase_means())],
        }
        if self.shapes is not None:
            meta["shapes"] = list(self.shapes)
        if self.selection:
            meta["selection"] = [s.__dict__ for s in self.selection]
        d = ph.to_dict(**meta)
        d["structure"] = self.structure
        return d

    def to_json(self, *, indent: int | None = 2) -> str:
        """JSON text readable by :meth:`PhaseType.from_json` and by the solver."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)
