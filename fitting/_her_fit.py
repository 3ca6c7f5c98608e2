"""Hyper-exponential and hyper-Erlang fits.

Exact samples: the closed-form EM of G-FIT (Thümmler, Buchholz & Telek 2006) over Erlang branch
shapes. Censored or binned data: the same structure by the general E-step, rates tied per branch.
"""

from __future__ import annotations

import numpy as np

from . import _her_start as _her
from . import _kernels
from ._em_loop import Run, run
from ._pattern import Pattern, pattern, to_ph, to_sparse
from .data import Observations
from .result import FitResult

__all__ = ["fit_her_exact", "fit_her_general"]


def fit_her_exact(obs: Observations, p: int, *, max_iter: int, rtol: float,
                   shapes: tuple[int, ...] | None, refine: int = 2, screen_iter: int = 1000,
                   structure: str = "hypererlang") -> FitResult:
    """Closed-form G-FIT EM with branch-shape search.

    Every partition of ``p`` into branch orders (or only ``shapes``) is screened with
    ``screen_iter`` iterations; the ``refine`` best continue to convergence.
    """
    x, w = obs.exact_values()
    cands = [shapes] if shapes is not None else (_her.partitions(p, max_parts=p) if structure == "hypererlang" else [(1,) * p])
    # screen every shape on the aggregated trace (G-FIT's trace aggregation), cheap
    cx, cw = obs.coarse().exact_values()
    screened = []
    for sh in cands:
        shp, pi, lam = _her.initial(cx, cw, sh)
        trace, n_it, conv = _kernels.her_em(cx, cw, shp, pi, lam, max(2, min(screen_iter, max_iter)), rtol)
        screened.append((trace[-1], shp, pi, lam))
    screened.sort(key=lambda r: -r[0])
    best = None
    for _, shp, pi, lam in screened[:refine]:
        trace, n_it, conv = _kernels.her_em(x, w, shp, pi, lam, max_iter, rtol)
        res = (trace[-1], shp, pi, lam, trace, n_it, conv)
        if best is None or res[0] > best[0]:
            best = res
    assert best is not None
    ll, shp, pi, lam, trace, n_it, conv = best
    order = np.argsort(-pi)
    keep = [i for i in order if pi[i] > 0]
    from .families import hyper_erlang, hyperexponential

    sh_t = tuple(int(shp[i]) for i in keep)
    if all(k == 1 for k in sh_t):
        ph = hyperexponential(pi[keep], lam[keep])
    else:
        ph = hyper_erlang(pi[keep], sh_t, lam[keep])
    k = 2 * len(keep) - 1
    aic, bic = FitResult.criteria(ll, k, obs.n)
    return FitResult(ph, float(ll), tuple(float(v) for v in trace), int(n_it), bool(conv), aic, bic,
                     obs.n, k, "hyperexp" if structure == "hyperexp" else "hypererlang", shapes=sh_t)


def fit_her_general(obs: Observations, p: int, *, max_iter: int, rtol: float,
                     shapes: tuple[int, ...] | None, structure: str,
                     target_mean: float | None) -> FitResult:
    """Hyper-Erlang on censored/binned data: ANO E-step, branch rates tied in the M-step."""
    from .families import hyper_erlang

    m1, _, _ = obs.moments()
    cands = [shapes] if shapes is not None else (_her.partitions(p) if structure == "hypererlang" else [(1,) * p])
    best: tuple[Run, Pattern, tuple[int, ...]] | None = None
    for sh in cands:
        M = len(sh)
        lam = np.array(sh, dtype=float) / (m1 * np.geomspace(0.3, 3.0, M) if M > 1 else np.array([m1]))
        ph0 = hyper_erlang(np.full(M, 1.0 / M), sh, lam)
        pat = pattern("hypererlang", p, sh)
        r = run(to_sparse(ph0, pat), obs, pat, max_iter=max_iter, rtol=rtol, target_mean=target_mean)
        if best is None or r.loglik > best[0].loglik:
            best = (r, pat, sh)
    assert best is not None
    r, pat, sh = best
    ph = to_ph(r.s, pat)
    k = 2 * len(sh) - 1
    aic, bic = FitResult.criteria(r.loglik, k, obs.n)
    return FitResult(ph, float(r.loglik), tuple(r.trace), r.n_estep, r.converged, aic, bic, obs.n, k,
                     structure, shapes=sh)
