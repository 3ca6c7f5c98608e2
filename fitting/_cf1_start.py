"""Starting points of a CF1 (and, from it, Coxian or general) fit.

Candidates from three-moment matching, from the best hyper-Erlang fit converted to CF1, from a
grid of geometric rate ladders (as mapfit's ``cf1.diff.init``/``cf1.scale.init``), optionally
from a convex mixture fit (cvxpy) and from seeded perturbations; the EM driver screens them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from overtake import install_hint

from ._her_fit import fit_her_exact
from .data import Observations
from .errors import FittingInputError
from .families import coxian, sort_cf1, to_cf1
from .phase_type import PhaseType

__all__ = ["candidates", "cf1_to_coxian", "densify", "ladder"]

FloatArray = npt.NDArray[np.float64]


def ladder(p: int, mean: float, spread: float, scale: float) -> PhaseType:
    """CF1 with geometric ascending rates spanning ``spread`` and uniform entry."""
    rates = spread ** (np.arange(p) / max(p - 1, 1))
    alpha = np.full(p, 1.0 / p)
    ph = PhaseType(alpha, np.diag(-rates) + np.diag(rates[:-1], 1), structure="cf1")
    c = ph.mean() / (mean * scale)
    return PhaseType(alpha, ph.T * c, structure="cf1")


def quantile_ladder(x: FloatArray, w: FloatArray, p: int, lo_q: float, hi_q: float) -> PhaseType:
    """CF1 whose entry points have geometric mean times from the ``lo_q`` to the ``hi_q``
    sample quantile, entry probabilities = sample mass nearest (in log scale) to each.

    Entering CF1 phase i passes phases i..p, so its mean time is ``tau_i = sum_{j>=i} 1/lam_j``;
    a slow first phase with a small entry probability captures the tail from the start.
    """
    c = np.cumsum(w) / w.sum()
    lo = x[min(int(np.searchsorted(c, lo_q)), x.size - 1)]
    hi = x[min(int(np.searchsorted(c, hi_q)), x.size - 1)] if hi_q < 1 else x[-1]
    tau = np.geomspace(hi, max(lo, hi * 1e-6), p)  # descending: tau_0 is the slowest entry
    inv = tau - np.append(tau[1:], 0.0)
    lam = 1.0 / np.maximum(inv, 1e-300)
    near = np.abs(np.log(x)[:, None] - np.log(tau)[None, :]).argmin(axis=1)
    a = np.bincount(near, weights=w, minlength=p) + 1e-3 * w.sum() / p
    a = a / a.sum()
    a, lam = sort_cf1(a, lam)
    return PhaseType(a, np.diag(-lam) + np.diag(lam[:-1], 1), structure="cf1")


def cf1_from_moments(obs: Observations, p: int) -> PhaseType | None:
    from .moments import match_three_moments, match_two_moments

    m1, m2, m3 = obs.moments()
    try:
        ph = match_three_moments(m1, m2, m3)
    except FittingInputError:
        ph = match_two_moments(m1, max(m2 / m1**2 - 1, 1e-3))
    if ph.order > p:
        return None
    c = to_cf1(ph)
    if c.order < p:  # pad with fast phases in front of the chain (they enter with prob. 0)
        lam = -np.diag(c.T)
        extra = np.full(p - c.order, lam.min())
        rates = np.concatenate([extra, lam])
        alpha = np.concatenate([np.zeros(p - c.order), c.alpha])
        alpha = 0.98 * alpha + 0.02 / p  # small mass everywhere so EM can use every phase
        alpha, rates = sort_cf1(alpha, rates)
        return PhaseType(alpha, np.diag(-rates) + np.diag(rates[:-1], 1), structure="cf1")
    return c


def convex_init(obs: Observations, p: int, grid_size: int = 60) -> PhaseType:
    """Hyperexponential start from a concave problem (solved exactly by cvxpy).

    Over a fixed log-spaced rate grid ``lam_j``, the mixture weights ``pi`` of
    ``sum_j pi_j lam_j e^{-lam_j x}`` maximise a concave log-likelihood; the ``p`` heaviest
    grid rates (with their weights) start the EM.
    """
    from .errors import MissingDependencyError

    try:
        import cvxpy as cp
    except ImportError:
        raise MissingDependencyError(f"init='convex' needs cvxpy: {install_hint('convex')}") from None
    obs = obs.coarse()  # a few hundred weighted points: the problem stays small
    g = obs.grid
    pos = g[g > 0]
    lam = np.geomspace(0.1 / pos.max(), 10.0 / pos.min(), grid_size)
    rows, wts = [], []
    if obs.point_idx.size:
        x = g[obs.point_idx]
        rows.append(lam * np.exp(-np.outer(x, lam)))
        wts.append(obs.point_w)
    if obs.cens_idx.size:
        rows.append(np.exp(-np.outer(g[obs.cens_idx], lam)))
        wts.append(obs.cens_w)
    if obs.int_w.size:
        lo = np.exp(-np.outer(g[obs.lo_idx], lam))
        hi = np.where(obs.hi_idx[:, None] >= 0, np.exp(-np.outer(g[np.maximum(obs.hi_idx, 0)], lam)), 0.0)
        rows.append(lo - hi)
        wts.append(obs.int_w)
    Phi = np.vstack(rows)
    w = np.concatenate(wts)
    # dividing a row by a constant shifts the objective by a constant: rows scaled to max 1
    Phi = Phi / np.maximum(Phi.max(axis=1, keepdims=True), 1e-300)
    pi = cp.Variable(grid_size, nonneg=True)
    prob = cp.Problem(cp.Maximize(w / w.sum() @ cp.log(Phi @ pi)), [cp.sum(pi) == 1])
    import warnings

    with warnings.catch_warnings():
        # an inaccurate optimum is still a fine starting point: EM refines it
        warnings.simplefilter("ignore")
        prob.solve()
    if pi.value is None:
        raise FittingInputError("init='convex': the convex mixture problem could not be solved; use init='auto'")
    weights = np.clip(np.asarray(pi.value, dtype=float), 0, None)
    top = np.sort(np.argsort(weights)[::-1][:p])
    a = weights[top] + 1e-6
    a /= a.sum()
    rates = np.sort(lam[top])
    order = np.argsort(lam[top])
    return PhaseType(a[order], np.diag(-rates), structure="hyperexponential")


def candidates(obs: Observations, p: int, init: str, rng: np.random.Generator,
                n_restarts: int) -> list[PhaseType]:
    """Starting CF1 distributions (see module docstring)."""
    m1, _, _ = obs.moments()
    cands: list[PhaseType] = []
    if init in ("auto", "moments"):
        c = cf1_from_moments(obs, p)
        if c is not None:
            cands.append(c)
    if init in ("auto", "hypererlang") and obs.kind == "exact" and p >= 2:
        her = fit_her_exact(obs, p, max_iter=60, rtol=1e-6, shapes=None, refine=1)
        cands.append(to_cf1_safe(her.ph, p))
    if init in ("auto", "grid"):
        for spread in (8.0, 64.0) if p > 1 else (1.0,):
            cands.append(ladder(p, m1, spread, 1.0))
        if obs.kind == "exact" and p > 1:
            x, w = obs.exact_values()
            for lo_q, hi_q in ((0.05, 1.0), (0.01, 0.999), (0.1, 0.99)):
                cands.append(quantile_ladder(x, w, p, lo_q, hi_q))
    if init == "convex":
        cands.append(to_cf1_safe(convex_init(obs, p), p))
    base = cands[0] if cands else ladder(p, m1, 16.0, 1.0)
    for _ in range(n_restarts):
        lam = -np.diag(base.T) * np.exp(rng.normal(0.0, 0.7, p))
        a = rng.dirichlet(np.ones(p))
        a, lam = sort_cf1(a, lam)
        cands.append(PhaseType(a, np.diag(-lam) + np.diag(lam[:-1], 1), structure="cf1"))
    return cands


def to_cf1_safe(ph: PhaseType, p: int) -> PhaseType:
    c = to_cf1(ph)
    a = 0.99 * c.alpha + 0.01 / p  # keep every entry probability positive for EM
    return PhaseType(a / a.sum(), c.T, structure="cf1")


def cf1_to_coxian(ph: PhaseType) -> PhaseType:
    """Reverse the CF1 chain: the dual of CF1 is a Coxian with the same law (Cumani 1982)."""
    lam = -np.diag(ph.T)[::-1]
    a = ph.alpha[::-1]
    # Coxian from phase 0 exits at phase i with probability a_i (read in reverse)
    surv = np.concatenate([[1.0], 1.0 - np.cumsum(a)[:-1]])
    cont = np.where(surv[:-1] > 1e-300, np.clip(surv[1:] / np.maximum(surv[:-1], 1e-300), 1e-6, 1 - 1e-9), 0.5)
    return coxian(lam, cont)


def densify(ph: PhaseType, eps: float = 0.02) -> PhaseType:
    """Give every zero transition a small rate so the general EM can use it (EM keeps zeros)."""
    p = ph.order
    lam = -np.diag(ph.T)
    T = ph.T.copy()
    off = ~np.eye(p, dtype=bool)
    T[off] += eps * lam[:, None].repeat(p, axis=1)[off] / p
    t = ph.exit_rates + eps * lam
    np.fill_diagonal(T, 0.0)
    np.fill_diagonal(T, -(T.sum(axis=1) + t))
    a = (1 - eps) * ph.alpha + eps / p
    return PhaseType(a / a.sum(), T, structure="general")
