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

import numpy as np
import numpy.typing as npt

from ._cf1_start import candidates, cf1_to_coxian, densify, ladder
from ._em_loop import Run, run
from ._her_fit import fit_her_exact, fit_her_general
from ._pattern import pattern, to_ph, to_sparse
from .data import Observations, binned, samples
from .errors import FittingInputError
from .phase_type import PhaseType, RandomState, check_random_state
from .result import FitResult, OrderScore

__all__ = ["MAX_AUTO_ORDER", "STRUCTURES", "fit", "fit_binned", "fit_observations"]

STRUCTURES = ("cf1", "coxian", "general", "hyperexp", "hypererlang")
MAX_AUTO_ORDER = 12


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
    _check_options(structure, init, max_iter, rtol)
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
    target_mean = _target_mean(obs) if preserve_mean else None
    if structure in ("hyperexp", "hypererlang"):
        if structure == "hyperexp":
            shapes = (1,) * p
        if obs.kind == "exact" and target_mean is None:
            return fit_her_exact(obs, p, max_iter=max_iter, rtol=rtol, shapes=shapes, structure=structure)
        res = fit_her_general(obs, p, max_iter=max_iter, rtol=rtol, shapes=shapes, structure=structure,
                              target_mean=target_mean)
        return _finish_mean(res, obs, target_mean)
    rng = check_random_state(random_state)
    cands = [ladder(1, obs.moments()[0], 1.0, 1.0)] if p == 1 else candidates(obs, p, init, rng, n_restarts)
    res = _fit_chain(obs, structure, cands, max_iter=max_iter, rtol=rtol, init_iter=init_iter,
                     target_mean=target_mean)
    return _finish_mean(res, obs, target_mean)


def _check_options(structure: str, init: str, max_iter: int, rtol: float) -> None:
    if structure not in STRUCTURES:
        raise FittingInputError(f"structure must be one of {', '.join(STRUCTURES)}, got {structure!r}")
    if init not in ("auto", "moments", "hypererlang", "grid", "convex"):
        raise FittingInputError(f"init must be auto, moments, hypererlang, grid or convex, got {init!r}")
    if not (isinstance(max_iter, (int, np.integer)) and max_iter >= 1):
        raise FittingInputError(f"max_iter must be an integer >= 1, got {max_iter!r}")
    if not (isinstance(rtol, float | int) and 0 < rtol < 1):
        raise FittingInputError(f"rtol must be in (0, 1), got {rtol!r}")


def _target_mean(obs: Observations) -> float:
    if obs.kind != "exact":
        raise FittingInputError("preserve_mean needs exact samples: the mean of censored or binned data is unknown")
    x, w = obs.exact_values()
    return float(w @ x / w.sum())


def _fit_chain(obs: Observations, structure: str, cands: list[PhaseType], *, max_iter: int, rtol: float,
               init_iter: int, target_mean: float | None) -> FitResult:
    """CF1, Coxian or general PH from CF1 starting points.

    The candidates are screened with a few EM steps of the CF1 structure on aggregated data, the
    best is converged there (cheap), and the fit finishes on the full data."""
    p = cands[0].order
    pat_cf1 = pattern("cf1", p)
    coarse = obs.coarse()
    best: Run | None = None
    for c in cands:
        r = run(to_sparse(c, pat_cf1), coarse, pat_cf1, max_iter=init_iter, rtol=rtol, target_mean=target_mean)
        if best is None or r.loglik > best.loglik:
            best = r
    assert best is not None
    if coarse is not obs:
        best = run(best.s, coarse, pat_cf1, max_iter=max_iter, rtol=rtol, target_mean=target_mean)
    start = to_ph(best.s, pat_cf1)
    pat = pat_cf1
    if structure == "coxian":
        pat, start = pattern("coxian", p), cf1_to_coxian(start)
    elif structure == "general":
        pat, start = pattern("general", p), densify(start)
    r = run(to_sparse(start, pat), obs, pat, max_iter=max_iter, rtol=rtol, target_mean=target_mean)
    ph = to_ph(r.s, pat)
    k = ph.n_params
    aic, bic = FitResult.criteria(r.loglik, k, obs.n)
    return FitResult(ph, float(r.loglik), tuple(r.trace), r.n_estep, r.converged, aic, bic, obs.n, k, structure)


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
