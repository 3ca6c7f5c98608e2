"""Maximum-likelihood phase-type fitting by EM.

* General PH, CF1 and Coxian: the Asmussen–Nerman–Olsson EM (Scand. J. Statist. 23 (1996)
  419–441, cited by van der Weij et al., "Dynamic thread assignment"), E-step by uniformization over the *sorted* samples so one
  Poisson series per gap serves all samples (Okamura, Dohi & Trivedi, Perform. Eval. 68 (2011);
  mapfit's engine). The M-step keeps the zero pattern of T, so CF1 (bidiagonal, ascending rates,
  Cumani 1982) and Coxian fits stay in their structure; CF1 rates are re-sorted after each
  M-step by the swap rule of :func:`overtake.fitting.families.sort_cf1`.
* Hyper-exponential / hyper-Erlang: closed-form EM (G-FIT, Thümmler, Buchholz & Telek 2006)
  over Erlang branch shapes; for censored or binned data the same structure is fitted with the
  general E-step and rates tied per branch.

Stopping rule: relative change of the log-likelihood ``|LL_k - LL_{k-1}| <= rtol |LL_k|``, or
``max_iter``; :class:`overtake.fitting.FitResult` says which. The returned parameters are those whose
log-likelihood was computed last, so ``result.loglik == result.ph``'s log-likelihood.

Initialisation (CF1, Coxian, general): candidates from three-moment matching, from the best
hyper-Erlang fit converted to CF1, from a grid of geometric rate ladders (as mapfit's
``cf1.diff.init``/``cf1.scale.init``), optionally from a convex mixture fit (cvxpy) and from
``n_restarts`` seeded perturbations; each runs ``init_iter`` EM steps and the best continues.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from overtake import install_hint

from . import _her_start as _her
from . import _kernels
from ._estep import Sparse, Stats, estep
from .data import Observations, binned, samples
from .errors import FittingInputError
from .families import sort_cf1, to_cf1
from .phase_type import PhaseType, RandomState, check_random_state
from .result import FitResult, OrderScore

__all__ = ["STRUCTURES", "fit", "fit_binned", "fit_observations"]

FloatArray = npt.NDArray[np.float64]

STRUCTURES = ("cf1", "coxian", "general", "hyperexp", "hypererlang")
MAX_AUTO_ORDER = 12


# ---------------------------------------------------------------------------- structures
@dataclass(frozen=True)
class _Pattern:
    """Zero pattern of a structure and its M-step."""

    name: str
    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    has_exit: npt.NDArray[np.bool_]
    branches: tuple[tuple[int, ...], ...] = ()  # tied-rate groups (hyper-Erlang)
    free_alpha: bool = True


def _pattern(structure: str, p: int, shapes: tuple[int, ...] | None = None) -> _Pattern:
    idx = np.arange(p)
    if structure in ("cf1", "coxian"):
        ex = np.zeros(p, dtype=bool) if structure == "cf1" else np.ones(p, dtype=bool)
        ex[-1] = True
        return _Pattern(structure, idx[:-1].copy(), idx[1:].copy(), ex, free_alpha=structure == "cf1")
    if structure == "general":
        src, dst = np.nonzero(~np.eye(p, dtype=bool))
        return _Pattern(structure, src.astype(np.int64), dst.astype(np.int64), np.ones(p, dtype=bool))
    assert shapes is not None
    src_l, dst_l, ex = [], [], np.zeros(p, dtype=bool)
    branches = []
    start = 0
    for k in shapes:
        ph = tuple(range(start, start + k))
        branches.append(ph)
        src_l += list(ph[:-1])
        dst_l += list(ph[1:])
        ex[ph[-1]] = True
        start += k
    return _Pattern(structure, np.array(src_l, dtype=np.int64), np.array(dst_l, dtype=np.int64), ex,
                    branches=tuple(branches))


def _to_sparse(ph: PhaseType, pat: _Pattern) -> Sparse:
    T = ph.T
    rate = T[pat.src, pat.dst].astype(np.float64)
    exitv = np.where(pat.has_exit, ph.exit_rates, 0.0)
    diag = -(np.asarray(np.bincount(pat.src, weights=rate, minlength=ph.order), dtype=np.float64) + exitv)
    return Sparse(ph.alpha.astype(np.float64).copy(), diag, pat.src, pat.dst, rate, exitv)


def _to_ph(s: Sparse, pat: _Pattern) -> PhaseType:
    label = {"hyperexp": "hyperexponential"}.get(pat.name, pat.name)
    return PhaseType(s.alpha, s.dense(), structure=label)


def _mstep(st: Stats, s: Sparse, pat: _Pattern) -> Sparse:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return _mstep_raw(st, s, pat)


def _mstep_raw(st: Stats, s: Sparse, pat: _Pattern) -> Sparse:
    p = s.alpha.size
    Z = np.where(st.Z > 1e-300, st.Z, 1e-300)
    alpha = st.B / st.B.sum() if pat.free_alpha else s.alpha
    rate = st.N / Z[pat.src]
    exitv = np.where(pat.has_exit, st.E / Z, 0.0)
    if pat.branches:
        rate = rate.copy()
        exitv = exitv.copy()
        for br in pat.branches:
            b = np.array(br)
            flows = st.E[b[-1]] + st.N[np.isin(pat.src, b)].sum()
            lam = flows / Z[b].sum()
            rate[np.isin(pat.src, b)] = lam
            exitv[b[-1]] = lam
    if pat.name == "cf1":
        lam = np.append(rate, exitv[-1])
        alpha, lam = sort_cf1(alpha, lam)
        rate, exitv = lam[:-1].copy(), np.zeros(p)
        exitv[-1] = lam[-1]
    diag = -(np.asarray(np.bincount(pat.src, weights=rate, minlength=p), dtype=np.float64) + exitv)
    return Sparse(alpha, diag, pat.src, pat.dst, rate, exitv)


def _rescale(s: Sparse, pat: _Pattern, target_mean: float) -> Sparse:
    ph = _to_ph(s, pat)
    c = ph.mean() / target_mean
    return Sparse(s.alpha, s.diag * c, s.src, s.dst, s.rate * c, s.exitv * c)


def _pack(s: Sparse, pat: _Pattern) -> FloatArray:
    parts = [s.rate, s.exitv[pat.has_exit]]
    if pat.free_alpha:
        parts.insert(0, s.alpha)
    return np.log(np.maximum(np.concatenate(parts), 1e-200))


def _unpack(theta: FloatArray, s: Sparse, pat: _Pattern) -> Sparse:
    p = s.alpha.size
    v = np.exp(np.clip(theta, -460.0, 460.0))
    k = 0
    alpha = s.alpha
    if pat.free_alpha:
        alpha = v[:p] / v[:p].sum()
        k = p
    ne = pat.src.size
    rate = v[k:k + ne]
    exitv = np.zeros(p)
    exitv[pat.has_exit] = v[k + ne:]
    if pat.branches:  # keep branch rates tied
        for br in pat.branches:
            b = np.array(br)
            inb = np.isin(pat.src, b)
            lam = np.exp(np.mean(np.log(np.append(rate[inb], exitv[b[-1]]))))
            rate[inb] = lam
            exitv[b[-1]] = lam
    if pat.name == "cf1":
        lam = np.append(rate, exitv[-1])
        alpha, lam = sort_cf1(alpha, lam)
        rate, exitv = lam[:-1].copy(), np.zeros(p)
        exitv[-1] = lam[-1]
    diag = -(np.asarray(np.bincount(pat.src, weights=rate, minlength=p), dtype=np.float64) + exitv)
    return Sparse(alpha, diag, pat.src, pat.dst, rate, exitv)


MAX_POISSON_TERMS = 2e6  # q * (largest sample): bounds the cost of one E-step


def _valid(s: Sparse, span: float) -> bool:
    return bool(np.all(np.isfinite(s.rate)) and np.all(np.isfinite(s.exitv)) and np.all(s.diag < 0)
                and np.all(np.isfinite(s.alpha)) and s.exitv.sum() > 0 and abs(s.alpha.sum() - 1) < 1e-6
                and float(np.max(-s.diag)) * span < MAX_POISSON_TERMS)


@dataclass
class _Run:
    s: Sparse
    loglik: float
    trace: list[float]  # log-likelihood after each accepted update
    n_estep: int
    converged: bool


def _run(s: Sparse, obs: Observations, pat: _Pattern, *, max_iter: int, rtol: float,
         target_mean: float | None, accelerate: bool = True) -> _Run:
    """EM iterations, accelerated by SQUAREM (Varadhan & Roland, Scand. J. Statist. 35 (2008),
    scheme SqS3) on log-parameters; an extrapolation is kept only if its log-likelihood is at
    least that of the plain EM step, so the log-likelihood never decreases. ``max_iter`` bounds
    the number of E-steps."""
    span = float(obs.grid[-1])

    def em_map(st: Stats, cur: Sparse) -> Sparse:
        new = _mstep(st, cur, pat)
        if target_mean is not None:
            new = _rescale(new, pat, target_mean)
        return new

    if target_mean is not None:
        s = _rescale(s, pat, target_mean)
    st0 = estep(s, obs)
    n = 1
    trace = [st0.loglik]

    def close(a: float, b: float, factor: float = 1.0) -> bool:
        return abs(a - b) <= factor * rtol * abs(a)

    while n < max_iter:
        s1 = em_map(st0, s)
        if not _valid(s1, span):
            return _Run(s, st0.loglik, trace, n, False)
        st1 = estep(s1, obs)
        n += 1
        if close(st1.loglik, st0.loglik) or not accelerate or n + 2 > max_iter:
            conv = close(st1.loglik, st0.loglik)
            if st1.loglik >= st0.loglik:
                s, st0 = s1, st1
                trace.append(st1.loglik)
            if conv:
                return _Run(s, st0.loglik, trace, n, True)
            continue
        s2 = em_map(st1, s1)
        if not _valid(s2, span):
            trace.append(st1.loglik)
            return _Run(s1, st1.loglik, trace, n, False)
        st2 = estep(s2, obs)
        n += 1
        t0, t1, t2 = _pack(s, pat), _pack(s1, pat), _pack(s2, pat)
        r = t1 - t0
        v = t2 - t1 - r
        nv = float(np.sqrt(v @ v))
        best_s, best_st = s2, st2
        if nv > 0:
            a = min(-1.0, -float(np.sqrt(r @ r)) / nv)
            while a < -1.0 and n < max_iter:  # shrink towards plain EM until the LL does not drop
                sx = _unpack(np.clip(t0 - 2 * a * r + a * a * v, t2 - 5.0, t2 + 5.0), s, pat)
                if target_mean is not None and _valid(sx, span):
                    sx = _rescale(sx, pat, target_mean)
                if _valid(sx, span):
                    stx = estep(sx, obs)
                    n += 1
                    if np.isfinite(stx.loglik) and stx.loglik >= st2.loglik:
                        best_s, best_st = sx, stx
                        break
                a = min(-1.0, a / 4.0) if a < -4.0 else -1.0
        done = close(best_st.loglik, st0.loglik, 3.0)
        s, st0 = best_s, best_st
        trace.append(st0.loglik)
        if done:
            return _Run(s, st0.loglik, trace, n, True)
    return _Run(s, st0.loglik, trace, n, False)


# ---------------------------------------------------------------------------- initialisation
def _ladder(p: int, mean: float, spread: float, scale: float) -> PhaseType:
    """CF1 with geometric ascending rates spanning ``spread`` and uniform entry."""
    rates = spread ** (np.arange(p) / max(p - 1, 1))
    alpha = np.full(p, 1.0 / p)
    ph = PhaseType(alpha, np.diag(-rates) + np.diag(rates[:-1], 1), structure="cf1")
    c = ph.mean() / (mean * scale)
    return PhaseType(alpha, ph.T * c, structure="cf1")


def _quantile_ladder(x: FloatArray, w: FloatArray, p: int, lo_q: float, hi_q: float) -> PhaseType:
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


def _cf1_from_moments(obs: Observations, p: int) -> PhaseType | None:
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


def _convex_init(obs: Observations, p: int, grid_size: int = 60) -> PhaseType:
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


def _candidates(obs: Observations, p: int, init: str, rng: np.random.Generator,
                n_restarts: int) -> list[PhaseType]:
    """Starting CF1 distributions (see module docstring)."""
    m1, _, _ = obs.moments()
    cands: list[PhaseType] = []
    if init in ("auto", "moments"):
        c = _cf1_from_moments(obs, p)
        if c is not None:
            cands.append(c)
    if init in ("auto", "hypererlang") and obs.kind == "exact" and p >= 2:
        her = _fit_her_exact(obs, p, max_iter=60, rtol=1e-6, shapes=None, refine=1)
        cands.append(_to_cf1_safe(her.ph, p))
    if init in ("auto", "grid"):
        for spread in (8.0, 64.0) if p > 1 else (1.0,):
            cands.append(_ladder(p, m1, spread, 1.0))
        if obs.kind == "exact" and p > 1:
            x, w = obs.exact_values()
            for lo_q, hi_q in ((0.05, 1.0), (0.01, 0.999), (0.1, 0.99)):
                cands.append(_quantile_ladder(x, w, p, lo_q, hi_q))
    if init == "convex":
        cands.append(_to_cf1_safe(_convex_init(obs, p), p))
    base = cands[0] if cands else _ladder(p, m1, 16.0, 1.0)
    for _ in range(n_restarts):
        lam = -np.diag(base.T) * np.exp(rng.normal(0.0, 0.7, p))
        a = rng.dirichlet(np.ones(p))
        a, lam = sort_cf1(a, lam)
        cands.append(PhaseType(a, np.diag(-lam) + np.diag(lam[:-1], 1), structure="cf1"))
    return cands


def _to_cf1_safe(ph: PhaseType, p: int) -> PhaseType:
    c = to_cf1(ph)
    a = 0.99 * c.alpha + 0.01 / p  # keep every entry probability positive for EM
    return PhaseType(a / a.sum(), c.T, structure="cf1")


# ---------------------------------------------------------------------------- hyper-Erlang
def _fit_her_exact(obs: Observations, p: int, *, max_iter: int, rtol: float,
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


def _fit_her_general(obs: Observations, p: int, *, max_iter: int, rtol: float,
                     shapes: tuple[int, ...] | None, structure: str,
                     target_mean: float | None) -> FitResult:
    """Hyper-Erlang on censored/binned data: ANO E-step, branch rates tied in the M-step."""
    from .families import hyper_erlang

    m1, _, _ = obs.moments()
    cands = [shapes] if shapes is not None else (_her.partitions(p) if structure == "hypererlang" else [(1,) * p])
    best: tuple[_Run, _Pattern, tuple[int, ...]] | None = None
    for sh in cands:
        M = len(sh)
        lam = np.array(sh, dtype=float) / (m1 * np.geomspace(0.3, 3.0, M) if M > 1 else np.array([m1]))
        ph0 = hyper_erlang(np.full(M, 1.0 / M), sh, lam)
        pat = _pattern("hypererlang", p, sh)
        run = _run(_to_sparse(ph0, pat), obs, pat, max_iter=max_iter, rtol=rtol, target_mean=target_mean)
        if best is None or run.loglik > best[0].loglik:
            best = (run, pat, sh)
    assert best is not None
    run, pat, sh = best
    ph = _to_ph(run.s, pat)
    k = 2 * len(sh) - 1
    aic, bic = FitResult.criteria(run.loglik, k, obs.n)
    return FitResult(ph, float(run.loglik), tuple(run.trace), run.n_estep, run.converged, aic, bic, obs.n, k,
                     structure, shapes=sh)


# ---------------------------------------------------------------------------- public API
def fit_observations(
    obs: Observations,
    *,
    structure: str = "cf1",
    order: int | str = 4,
    shapes: tuple[int, ...] | None = None,
    max_iter: int = 5000,
    rtol: float = 1e-9,
    init: str = "auto",
    init_iter: int = 20,
    n_restarts: int = 2,
    preserve_mean: bool = False,
    random_state: RandomState = None,
    max_order: int | None = None,
) -> FitResult:
    """Fit a phase-type distribution to validated :class:`overtake.fitting.data.Observations`.

    See :func:`fit` for the parameters. ``max_order`` (with ``order="auto"``): the order chosen is
    the BIC-best of at most ``max_order`` phases (a budget of the solver's); every order is still
    scored, so ``result.selection`` shows where BIC alone would have gone.
    """
    if structure not in STRUCTURES:
        raise FittingInputError(f"structure must be one of {', '.join(STRUCTURES)}, got {structure!r}")
    if init not in ("auto", "moments", "hypererlang", "grid", "convex"):
        raise FittingInputError(f"init must be auto, moments, hypererlang, grid or convex, got {init!r}")
    if not (isinstance(max_iter, (int, np.integer)) and max_iter >= 1):
        raise FittingInputError(f"max_iter must be an integer >= 1, got {max_iter!r}")
    if not (isinstance(rtol, float | int) and 0 < rtol < 1):
        raise FittingInputError(f"rtol must be in (0, 1), got {rtol!r}")
    if isinstance(order, str):
        if order != "auto":
            raise FittingInputError(f"order must be an integer in 1..{MAX_AUTO_ORDER} or 'auto', got {order!r}")
        if max_order is not None and not (isinstance(max_order, (int, np.integer)) and max_order >= 1):
            raise FittingInputError(f"max_order must be an integer >= 1, got {max_order!r}")
        return _select(obs, structure=structure, max_order=max_order, max_iter=max_iter, rtol=rtol, init=init,
                       init_iter=init_iter, n_restarts=n_restarts, preserve_mean=preserve_mean,
                       random_state=random_state)
    if int(order) != order or order < 1:
        raise FittingInputError(f"order must be an integer >= 1 or 'auto', got {order!r}")
    p = int(order)
    if shapes is not None:
        shapes = tuple(int(k) for k in shapes)
        if sum(shapes) != p or min(shapes) < 1:
            raise FittingInputError(f"shapes must be positive and sum to order={p}, got {shapes}")
    target_mean: float | None = None
    if preserve_mean:
        if obs.kind != "exact":
            raise FittingInputError("preserve_mean needs exact samples: the mean of censored or binned data is unknown")
        x, w = obs.exact_values()
        target_mean = float(w @ x / w.sum())

    if structure in ("hyperexp", "hypererlang"):
        if structure == "hyperexp":
            shapes = (1,) * p
        if obs.kind == "exact" and target_mean is None:
            return _fit_her_exact(obs, p, max_iter=max_iter, rtol=rtol, shapes=shapes, structure=structure)
        res = _fit_her_general(obs, p, max_iter=max_iter, rtol=rtol, shapes=shapes, structure=structure,
                               target_mean=target_mean)
        return _finish_mean(res, obs, target_mean)

    rng = check_random_state(random_state)
    pat_cf1 = _pattern("cf1", p)
    if p == 1:
        cands = [_ladder(1, obs.moments()[0], 1.0, 1.0)]
    else:
        cands = _candidates(obs, p, init, rng, n_restarts)
    # screen candidates with a few EM steps of the CF1 structure on aggregated data, converge the
    # best there (cheap), then finish on the full data
    coarse = obs.coarse()
    best: _Run | None = None
    for c in cands:
        run = _run(_to_sparse(c, pat_cf1), coarse, pat_cf1, max_iter=init_iter, rtol=rtol, target_mean=target_mean)
        if best is None or run.loglik > best.loglik:
            best = run
    assert best is not None
    if coarse is not obs:
        best = _run(best.s, coarse, pat_cf1, max_iter=max_iter, rtol=rtol, target_mean=target_mean)
    start = _to_ph(best.s, pat_cf1)
    if structure == "cf1":
        pat = pat_cf1
    elif structure == "coxian":
        pat = _pattern("coxian", p)
        start = _cf1_to_coxian(start)
    else:
        pat = _pattern("general", p)
        start = _densify(start)
    run = _run(_to_sparse(start, pat), obs, pat, max_iter=max_iter, rtol=rtol, target_mean=target_mean)
    ph = _to_ph(run.s, pat)
    k = ph.n_params
    aic, bic = FitResult.criteria(run.loglik, k, obs.n)
    res = FitResult(ph, float(run.loglik), tuple(run.trace), run.n_estep, run.converged, aic, bic, obs.n, k, structure)
    return _finish_mean(res, obs, target_mean)


def _finish_mean(res: FitResult, obs: Observations, target_mean: float | None) -> FitResult:
    if target_mean is None:
        return res
    ph = res.ph
    c = ph.mean() / target_mean
    ph = PhaseType(ph.alpha, ph.T * c, structure=ph.structure)
    x, w = obs.exact_values()
    ll = ph.loglik(x, w)
    aic, bic = FitResult.criteria(ll, res.n_params, res.n)
    return FitResult(ph, ll, res.loglik_trace, res.n_iter, res.converged, aic, bic, res.n, res.n_params,
                     res.structure, res.shapes, True, res.selection)


def _cf1_to_coxian(ph: PhaseType) -> PhaseType:
    """Reverse the CF1 chain: the dual of CF1 is a Coxian with the same law (Cumani 1982)."""
    lam = -np.diag(ph.T)[::-1]
    a = ph.alpha[::-1]
    # Coxian from phase 0 exits at phase i with probability a_i (read in reverse)
    surv = np.concatenate([[1.0], 1.0 - np.cumsum(a)[:-1]])
    cont = np.where(surv[:-1] > 1e-300, np.clip(surv[1:] / np.maximum(surv[:-1], 1e-300), 1e-6, 1 - 1e-9), 0.5)
    p = lam.size
    T = np.diag(-lam)
    for i in range(p - 1):
        T[i, i + 1] = lam[i] * cont[i]
    alpha = np.zeros(p)
    alpha[0] = 1.0
    return PhaseType(alpha, T, structure="coxian")


def _densify(ph: PhaseType, eps: float = 0.02) -> PhaseType:
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


def _select(obs: Observations, *, structure: str, max_order: int | None = None, **kw: object) -> FitResult:
    """Order by BIC over 1..MAX_AUTO_ORDER; stops after three orders without BIC improvement.
    The result is the BIC-best of at most ``max_order`` phases."""
    rows: list[OrderScore] = []
    best: FitResult | None = None  # the BIC-best overall: the stopping rule follows it
    kept: FitResult | None = None  # the BIC-best within max_order: the answer
    worse = 0
    for p in range(1, MAX_AUTO_ORDER + 1):
        r = fit_observations(obs, structure=structure if p > 1 or structure != "general" else "cf1", order=p, **kw)  # type: ignore[arg-type]
        rows.append(OrderScore(p, r.loglik, r.aic, r.bic, r.n_params, r.converged, r.n_iter))
        if (max_order is None or p <= max_order) and (kept is None or r.bic < kept.bic):
            kept = r
        if best is None or r.bic < best.bic:
            best, worse = r, 0
        else:
            worse += 1
            if worse >= 3:
                break
    best = kept
    assert best is not None
    return FitResult(best.ph, best.loglik, best.loglik_trace, best.n_iter, best.converged, best.aic, best.bic,
                     best.n, best.n_params, best.structure, best.shapes, best.mean_preserved, tuple(rows))


def fit(
    x: npt.ArrayLike,
    *,
    structure: str = "cf1",
    order: int | str = 4,
    weights: npt.ArrayLike | None = None,
    censored: npt.ArrayLike | None = None,
    shapes: tuple[int, ...] | None = None,
    max_iter: int = 5000,
    rtol: float = 1e-9,
    init: str = "auto",
    init_iter: int = 20,
    n_restarts: int = 2,
    preserve_mean: bool = False,
    random_state: RandomState = None,
) -> FitResult:
    """Fit a phase-type distribution to durations by maximum likelihood (EM).

    Parameters
    ----------
    x : array_like
        Durations in seconds (> 0). Where ``censored`` is True, the time at which the request
        was cut off.
    structure : {"cf1", "coxian", "general", "hyperexp", "hypererlang"}
        ``cf1`` (default) converges where unconstrained PH stalls; ``hypererlang`` searches
        the Erlang branch shapes (G-FIT).
    order : int or "auto"
        Number of phases, or ``"auto"``: BIC over 1..12 (AIC/BIC of each order in
        ``result.selection``).
    weights : array_like, optional
        Non-negative sample weights (multiplicities).
    censored : array_like of bool, optional
        Right-censoring flags (e.g. requests cut by a timeout).
    shapes : tuple of int, optional
        Fixed Erlang branch orders for ``hypererlang`` (skips the shape search).
    max_iter, rtol : int, float
        Stop when ``|ΔLL| <= rtol |LL|`` or after ``max_iter`` iterations.
    init : {"auto", "moments", "hypererlang", "grid", "convex"}
        Starting points (``convex`` needs cvxpy).
    init_iter : int
        EM iterations used to screen each starting point.
    n_restarts : int
        Extra seeded random starts.
    preserve_mean : bool
        Rescale time so the fitted mean equals the sample mean exactly (queueing solvers take the
        load from it); the log-likelihood reported is that of the rescaled distribution.
    random_state : None, int or numpy.random.Generator
        Seed for the restarts.

    Returns
    -------
    FitResult

    Raises
    ------
    DataError
        For NaN, inf, non-positive, empty, single or constant samples, or bad weights.

    Examples
    --------
    >>> import numpy as np
    >>> from fitting import fit
    >>> x = np.random.default_rng(1).lognormal(0.0, 1.0, 2000)
    >>> res = fit(x, order=4)
    >>> res.ph.mean() > 0 and res.converged
    True
    """
    obs = samples(x, weights=weights, censored=censored)
    return fit_observations(obs, structure=structure, order=order, shapes=shapes, max_iter=max_iter,
                            rtol=rtol, init=init, init_iter=init_iter, n_restarts=n_restarts,
                            preserve_mean=preserve_mean, random_state=random_state)


def fit_binned(
    edges: npt.ArrayLike,
    counts: npt.ArrayLike,
    **kwargs: object,
) -> FitResult:
    """Fit to a histogram: ``counts[i]`` durations in ``(edges[i], edges[i+1]]`` seconds.

    The last edge may be ``inf`` (Prometheus ``+Inf`` bucket). Keyword arguments as in
    :func:`fit` (``preserve_mean`` is not available: binned data do not determine the mean).
    """
    obs = binned(edges, counts)
    return fit_observations(obs, **kwargs)  # type: ignore[arg-type]

