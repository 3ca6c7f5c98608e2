"""Shifted phase-type fits: a service floor (a constant) followed by a phase-type body.

Real pages have a minimum time: a 20-40 ms floor under an exponential-like tail. A plain PH
needs many phases to bend its density at zero into that floor (a CF1 of order ~12), and every
phase multiplies the tandem MDP's state space. Here the floor is fitted as a constant ``c`` (the
body is fitted to ``x - c``) and handed to the solver as an Erlang of ``k`` phases of mean ``c``
in front of the body: ``k`` is what the state budget affords, the mean is kept exactly
(``k / (k/c) + E[body] = c + E[body]``), and the floor's variance ``c²/k`` is the price of
the approximation, visible as the model's log-likelihood next to the constant's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .data import Observations, samples
from .em import fit_observations
from .errors import FittingInputError
from .phase_type import PhaseType
from .result import FitResult

__all__ = ["ShiftedFit", "estimate_shift", "fit_shifted", "shifted_ph"]

FloatArray = npt.NDArray[np.float64]

#: Fractions of the floor estimate tried by ``shift="auto"``: the profile likelihood picks one,
#: so a single fast outlier below the floor does not set it alone.
_PROFILE = (0.5, 0.8, 0.9, 0.95, 1.0)


@dataclass(frozen=True)
class ShiftedFit:
    """A floor ``shift`` (seconds) then the ``body`` fit; ``ph`` is what the solver gets.

    Attributes
    ----------
    shift : float
        The constant, seconds.
    erlang_phases : int
        Phases ``k`` of the Erlang that stands for the constant in ``ph``.
    body : FitResult
        The PH fitted to the durations minus ``shift``.
    ph : PhaseType
        Erlang(k, mean ``shift``) in series with ``body.ph``: mean ``shift + body.ph.mean()``.
    loglik : float
        Log-likelihood of constant + body on the data (that of ``body`` on the shifted data).
    loglik_model : float
        Log-likelihood of ``ph`` itself on the data (the Erlang in place of the constant).
    """

    shift: float
    erlang_phases: int
    body: FitResult
    ph: PhaseType
    loglik: float
    loglik_model: float

    def result(self) -> FitResult:
        """``ph`` as a :class:`FitResult` (the fit file the solver reads), the body's criteria kept."""
        b = self.body
        n_params = b.n_params + 1  # the shift
        aic, bic = FitResult.criteria(self.loglik_model, n_params, b.n)
        return FitResult(self.ph, self.loglik_model, b.loglik_trace, b.n_iter, b.converged, aic, bic, b.n,
                         n_params, "shifted", b.shapes, b.mean_preserved, b.selection)

    def meta(self) -> dict[str, Any]:
        """What the fit file records about the floor."""
        return {"shift": self.shift, "erlang_phases": self.erlang_phases, "body_structure": self.body.structure,
                "body_order": self.body.ph.order, "body_mean": self.body.ph.mean(),
                "loglik_shifted": self.loglik, "loglik_model": self.loglik_model}


def shifted_ph(shift: float, erlang_phases: int, body: PhaseType) -> PhaseType:
    """Erlang(``erlang_phases``, mean ``shift``) then ``body``: one PhaseType, structure ``shifted``."""
    if not (math.isfinite(shift) and shift > 0):
        raise FittingInputError(f"shift must be > 0 seconds, got {shift!r}")
    if not (isinstance(erlang_phases, (int, np.integer)) and erlang_phases >= 1):
        raise FittingInputError(f"erlang_phases must be an integer >= 1, got {erlang_phases!r}")
    k, p = int(erlang_phases), body.order
    rate = k / shift
    T = np.zeros((k + p, k + p))
    for i in range(k):
        T[i, i] = -rate
        if i + 1 < k:
            T[i, i + 1] = rate
    T[k - 1, k:] = rate * body.alpha  # the floor ends: the body starts in its initial law
    T[k:, k:] = body.T
    alpha = np.zeros(k + p)
    alpha[0] = 1.0  # every request serves the floor; a body atom at zero exits right after it
    return PhaseType(alpha, T, structure="shifted")


def _exact(obs: Observations) -> tuple[FloatArray, FloatArray]:
    if obs.kind != "exact":
        raise FittingInputError("shift needs exact samples (no censoring or bins)")
    return obs.exact_values()


def estimate_shift(obs: Observations) -> float:
    """The floor's point estimate: ``min - (mean - min)/n``, just below the smallest sample (for
    a shifted exponential the unbiased estimator of the shift; every shifted sample stays > 0)."""
    x, w = _exact(obs)
    lo = float(x.min())
    n = float(w.sum())
    mean = float(w @ x / n)
    return max(lo - (mean - lo) / max(n - 1.0, 1.0), 0.0)


def _shifted_obs(obs: Observations, shift: float) -> Observations:
    x, w = _exact(obs)
    if shift >= float(x.min()):
        raise FittingInputError(f"shift: {shift:g} s is not below the smallest duration {float(x.min()):g} s")
    return samples(x - shift, weights=w)


def fit_shifted(obs: Observations, *, shift: float | str = "auto", erlang_phases: int | None = 2,
                max_phases: int | None = None, **fit_kw: Any) -> ShiftedFit:
    """Fit constant + PH to exact samples; ``fit_kw`` go to :func:`fit_observations` for the body.

    The floor gets ``erlang_phases`` phases, or (``None``) what ``max_phases`` leaves after the
    body's order, at least one.

    ``shift="auto"``: the profile likelihood over fractions of :func:`estimate_shift` (each with
    a two-phase CF1 body), then the body fitted as asked at the best.
    """
    x, w = _exact(obs)
    if isinstance(shift, str):
        if shift != "auto":
            raise FittingInputError(f"shift must be 'auto' or seconds > 0, got {shift!r}")
        s0 = estimate_shift(obs)
        if s0 <= 0:
            raise FittingInputError("shift: the smallest duration is the floor estimate's only support; "
                                    "no floor to fit (fit without --shift)")
        seed = fit_kw.get("random_state")
        scored = [(fit_observations(_shifted_obs(obs, f * s0), structure="cf1", order=2, max_iter=200,
                                    random_state=seed).loglik, f * s0) for f in _PROFILE]
        shift = max(scored)[1]
    shift = float(shift)
    body = fit_observations(_shifted_obs(obs, shift), **fit_kw)
    if erlang_phases is None:
        if max_phases is None:
            raise FittingInputError("fit_shifted: give erlang_phases or max_phases")
        erlang_phases = max(1, max_phases - body.ph.order)
    ph = shifted_ph(shift, erlang_phases, body.ph)
    return ShiftedFit(shift, int(erlang_phases), body, ph, body.loglik, ph.loglik(x, w))
