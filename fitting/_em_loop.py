"""The EM iterations of one fit, accelerated by SQUAREM with a monotone-likelihood safeguard."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._estep import Sparse, Stats, estep
from ._pattern import Pattern, mstep, pack, rescale, unpack, valid
from .data import Observations

__all__ = ["Run", "run"]


@dataclass
class Run:
    s: Sparse
    loglik: float
    trace: list[float]  # log-likelihood after each accepted update
    n_estep: int
    converged: bool


@dataclass(frozen=True)
class _Map:
    """One EM update of a fit (the M-step after an E-step, rescaled to a target mean if asked)."""

    obs: Observations
    pat: Pattern
    target_mean: float | None
    span: float

    def __call__(self, st: Stats, cur: Sparse) -> Sparse:
        new = mstep(st, cur, self.pat)
        return rescale(new, self.pat, self.target_mean) if self.target_mean is not None else new

    def valid(self, s: Sparse) -> bool:
        return valid(s, self.span)


def run(s: Sparse, obs: Observations, pat: Pattern, *, max_iter: int, rtol: float,
        target_mean: float | None, accelerate: bool = True) -> Run:
    """EM iterations, accelerated by SQUAREM (Varadhan & Roland, Scand. J. Statist. 35 (2008),
    scheme SqS3) on log-parameters; an extrapolation is kept only if its log-likelihood is at
    least that of the plain EM step, so the log-likelihood never decreases. ``max_iter`` bounds
    the number of E-steps."""
    em_map = _Map(obs, pat, target_mean, float(obs.grid[-1]))
    if target_mean is not None:
        s = rescale(s, pat, target_mean)
    st0 = estep(s, obs)
    n = 1
    trace = [st0.loglik]

    def close(a: float, b: float, factor: float = 1.0) -> bool:
        return abs(a - b) <= factor * rtol * abs(a)

    while n < max_iter:
        s1 = em_map(st0, s)
        if not em_map.valid(s1):
            return Run(s, st0.loglik, trace, n, False)
        st1 = estep(s1, obs)
        n += 1
        if close(st1.loglik, st0.loglik) or not accelerate or n + 2 > max_iter:
            conv = close(st1.loglik, st0.loglik)
            if st1.loglik >= st0.loglik:
                s, st0 = s1, st1
                trace.append(st1.loglik)
            if conv:
                return Run(s, st0.loglik, trace, n, True)
            continue
        s2 = em_map(st1, s1)
        if not em_map.valid(s2):
            trace.append(st1.loglik)
            return Run(s1, st1.loglik, trace, n, False)
        st2 = estep(s2, obs)
        n += 1
        best_s, best_st, n = _extrapolate(em_map, (s, s1, s2), st2, n, max_iter)
        done = close(best_st.loglik, st0.loglik, 3.0)
        s, st0 = best_s, best_st
        trace.append(st0.loglik)
        if done:
            return Run(s, st0.loglik, trace, n, True)
    return Run(s, st0.loglik, trace, n, False)


def _extrapolate(em_map: _Map, states: tuple[Sparse, Sparse, Sparse], st2: Stats, n: int,
                 max_iter: int) -> tuple[Sparse, Stats, int]:
    """The SQUAREM step from ``s0`` through two EM updates ``s1, s2``: the steplength is shrunk
    towards plain EM until the log-likelihood is at least ``s2``'s (else ``s2`` itself).
    Returns the state kept, its statistics and the E-step count."""
    s, s1, s2 = states
    pat = em_map.pat
    t0, t1, t2 = pack(s, pat), pack(s1, pat), pack(s2, pat)
    r = t1 - t0
    v = t2 - t1 - r
    nv = float(np.sqrt(v @ v))
    if nv <= 0:
        return s2, st2, n
    a = min(-1.0, -float(np.sqrt(r @ r)) / nv)
    while a < -1.0 and n < max_iter:
        sx = unpack(np.clip(t0 - 2 * a * r + a * a * v, t2 - 5.0, t2 + 5.0), s, pat)
        if em_map.target_mean is not None and em_map.valid(sx):
            sx = rescale(sx, pat, em_map.target_mean)
        if em_map.valid(sx):
            stx = estep(sx, em_map.obs)
            n += 1
            if np.isfinite(stx.loglik) and stx.loglik >= st2.loglik:
                return sx, stx, n
        a = min(-1.0, a / 4.0) if a < -4.0 else -1.0
    return s2, st2, n
