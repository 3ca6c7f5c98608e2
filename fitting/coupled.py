"""Coupled phase-type fits of two-stage transactions: each stage's PH and the routing between them.

A transaction is a pair (x, y): stage 1 takes x, stage 2 takes y, and the two correlate (on a wiki
a big article is expensive to preview and to view). The coupled PH keeps each stage's own PH
(α₁, T₁) and (α₂, T₂) and adds a routing matrix R: a request that leaves stage 1 from phase j
starts stage 2 in phase l with probability R[j, l]. Its joint density is

    f(x, y) = Σ_{j,l} a_j(x) R[j, l] b_l(y),   a_j(x) = (α₁ e^{T₁x})_j t₁_j,   b_l(y) = (e^{T₂y} t₂)_l,

and stage 2's start law is π₁R, π₁ the exit-phase law of stage 1, so independent stages are
R = 1α₂ (every row α₂).

The fit: each stage's PH by the marginal EM (:func:`overtake.fitting.fit`), then R by EM over the
joint likelihood with the PHs held: the latent pair (exit phase, start phase) has posterior
a_j R[j, l] b_l / f, and the M-step sets R[j, l] to its expected count over the expected count of
exits from j. It starts from the independent R = 1α₂, so the fit's joint likelihood is at least the
independent model's, and each EM step does not lower it. Why a routing rather than K classes each
with its own PH per stage: the routing is the tandem model's own object (it is what the MDP
solves), the marginal fits stay the ones a single-stage fit gives, and a class mixture is the
special case of block-diagonal PHs with a routing that keeps the class. It captures the
correlation the exit phase carries: hyperexponential and hyper-Erlang fits (a phase per size
class, the heavy-tailed case) carry it fully; an Erlang stage (one exit phase) carries none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .errors import DataError
from .phase_type import PhaseType, RandomState, check_random_state

if TYPE_CHECKING:
    from .result import FitResult

__all__ = ["CoupledFit", "CoupledPH", "fit_coupled", "fit_routing"]

FloatArray = npt.NDArray[np.float64]


def exit_law(ph: PhaseType) -> FloatArray:
    """P(the service ends from phase j) = (α(−T)⁻¹)_j t_j."""
    visits = np.linalg.solve(-ph.T.T, ph.alpha)
    out = np.clip(visits * ph.exit_rates, 0.0, None)
    return np.asarray(out / out.sum(), dtype=np.float64)


@dataclass(frozen=True, eq=False)
class CoupledPH:
    """Stage 1's PH, stage 2's PH (its α the start law π₁R) and the routing R between them."""

    first: PhaseType
    second: PhaseType
    routing: FloatArray

    @staticmethod
    def build(first: PhaseType, second_T: npt.ArrayLike, routing: npt.ArrayLike) -> CoupledPH:
        """The coupled PH of ``first``, stage 2's sub-generator and R; stage 2's α is π₁R."""
        R = np.asarray(routing, dtype=float)
        T2 = np.asarray(second_T, dtype=float)
        if R.shape != (first.order, T2.shape[0]):
            raise DataError(f"routing: must be {first.order}x{T2.shape[0]} (stage 1 phases x stage 2 phases), "
                            f"got shape {R.shape}")
        if np.any(~np.isfinite(R)) or np.any(R < 0) or np.any(np.abs(R.sum(axis=1) - 1) > 1e-6):
            raise DataError("routing: every row must be a probability distribution (entries >= 0, summing to 1)")
        return CoupledPH(first, PhaseType(exit_law(first) @ R, T2, structure="coupled"), R)

    def means(self) -> tuple[float, float]:
        return self.first.mean(), self.second.mean()

    def correlation(self) -> float:
        """Pearson correlation of the two stages' times.

        E[S₁S₂] = Σ_j E[S₁; exit j] · E[S₂ | start law R[j]], E[S₁; exit j] = (α₁(−T₁)⁻²)_j t₁_j.
        """
        a, T1 = self.first.alpha, self.first.T
        u = np.linalg.solve(-T1.T, np.linalg.solve(-T1.T, a))  # α(−T)⁻², as a column
        m2 = np.linalg.solve(-self.second.T, np.ones(self.second.order))
        cross = float((u * self.first.exit_rates) @ (self.routing @ m2))
        cov = cross - self.first.mean() * self.second.mean()
        return cov / (self.first.std() * self.second.std())

    def rvs(self, size: int, random_state: RandomState = None) -> tuple[FloatArray, FloatArray]:
        """``size`` transactions (x, y) drawn from the coupled PH."""
        rng = check_random_state(random_state)
        x, exit_phase = _walk(self.first, rng.choice(self.first.order, size=size, p=self.first.alpha), rng)
        cum = np.cumsum(self.routing, axis=1)
        u = rng.random(size)
        start = np.minimum((cum[exit_phase] < u[:, None]).sum(axis=1), self.second.order - 1)
        y, _ = _walk(self.second, start, rng)
        return x, y

    def by_mean(self) -> CoupledPH:
        """The same model with each stage's phases from the shortest mean to the longest (what
        ``overtake fit`` writes), the routing's rows and columns permuted alike."""
        p1 = np.argsort(self.first.phase_means(), kind="stable")
        p2 = np.argsort(self.second.phase_means(), kind="stable")
        first = PhaseType(self.first.alpha[p1], self.first.T[np.ix_(p1, p1)], structure=self.first.structure)
        return CoupledPH.build(first, self.second.T[np.ix_(p2, p2)], self.routing[np.ix_(p1, p2)])

    def to_dict(self, **metadata: Any) -> dict[str, Any]:
        """``{"stages": [{"alpha", "T"}, {"alpha", "T"}], "routing": [[...]], ...}``: a scenario's
        two ``ph`` services and its ``routing`` entry."""
        return {"stages": [{"alpha": ph.alpha.tolist(), "T": ph.T.tolist()} for ph in (self.first, self.second)],
                "routing": [self.routing.tolist()], **metadata}


def _walk(ph: PhaseType, start: npt.NDArray[np.int64], rng: np.random.Generator
          ) -> tuple[FloatArray, npt.NDArray[np.int64]]:
    """Absorption times of PH paths from ``start``, and the phase each left from."""
    T = ph.T
    rates = -np.diag(T)
    jump = np.column_stack([np.where(np.eye(ph.order, dtype=bool), 0.0, T), ph.exit_rates]) / rates[:, None]
    cum = np.cumsum(jump, axis=1)
    cum[:, -1] = 1.0 + 1e-12
    cur = start.astype(np.int64).copy()
    t = np.zeros(cur.size)
    last = cur.copy()
    alive = np.ones(cur.size, dtype=bool)
    while np.any(alive):
        idx = np.flatnonzero(alive)
        c = cur[idx]
        t[idx] += rng.exponential(1.0, idx.size) / rates[c]
        nxt = (cum[c] < rng.random(idx.size)[:, None]).sum(axis=1)
        done = nxt == ph.order
        last[idx[done]] = c[done]
        alive[idx[done]] = False
        cur[idx[~done]] = nxt[~done]
    return t, last


def _forward(ph: PhaseType, x: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(a(x) with rows scaled to sum 1, log of the scales): a_j(x) = (α e^{Tx})_j t_j."""
    from scipy.linalg import expm

    E = expm(ph.T[None, :, :] * x[:, None, None])
    a = np.einsum("j,njk->nk", ph.alpha, E) * ph.exit_rates[None, :]
    return _scaled(a)


def _backward(ph: PhaseType, y: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(b(y) with rows scaled to sum 1, log of the scales): b_l(y) = (e^{Ty} t)_l."""
    from scipy.linalg import expm

    E = expm(ph.T[None, :, :] * y[:, None, None])
    return _scaled(np.einsum("njk,k->nj", E, ph.exit_rates))


def _scaled(v: FloatArray) -> tuple[FloatArray, FloatArray]:
    s = v.sum(axis=1)
    if np.any(~(s > 0)):
        raise DataError("a duration has zero density under the stage's PH (outside its support); refit the stage")
    return v / s[:, None], np.log(s)


def _check_pairs(x: npt.ArrayLike, y: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
    xa, ya = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    if xa.size != ya.size:
        raise DataError(f"paired samples: stage 1 has {xa.size} durations, stage 2 {ya.size}; give one pair per "
                        "transaction")
    if xa.size < 10:
        raise DataError(f"paired samples: need at least 10 transactions, got {xa.size}")
    for name, v in (("stage 1", xa), ("stage 2", ya)):
        if np.any(~np.isfinite(v)) or np.any(v <= 0):
            raise DataError(f"paired samples: {name} durations must be finite and > 0")
    return xa, ya


@dataclass(frozen=True)
class CoupledFit:
    """A coupled fit: the model, its joint log-likelihood and the independent model's, the EM's steps."""

    model: CoupledPH
    loglik: float
    loglik_independent: float
    n_iter: int
    converged: bool
    n: int
    sample_correlation: float
    #: each stage's marginal fit (its order selection), when :func:`fit_coupled` made them
    marginals: tuple[FitResult, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.model.to_dict(loglik=self.loglik, loglik_independent=self.loglik_independent,
                                  n_iter=self.n_iter, converged=self.converged, n=self.n,
                                  correlation=self.model.correlation(), sample_correlation=self.sample_correlation)


def fit_routing(first: PhaseType, second: PhaseType, x: npt.ArrayLike, y: npt.ArrayLike, *,
                max_iter: int = 2000, rtol: float = 1e-9) -> CoupledFit:
    """R by EM over the joint likelihood of the pairs (x, y), the stages' PHs held (module docstring).

    Starts from the independent routing (every row ``second.alpha``); rows of phases no sample
    leaves from keep it.
    """
    xa, ya = _check_pairs(x, y)
    a, la = _forward(first, xa)
    b, lb = _backward(second, ya)
    scale = float(la.sum() + lb.sum())
    R = np.tile(second.alpha, (first.order, 1))

    def loglik(R: FloatArray) -> tuple[float, FloatArray]:
        f = np.einsum("nj,jl,nl->n", a, R, b)
        return float(np.log(f).sum()) + scale, f

    ll0, f = loglik(R)
    ll, n_iter, converged = ll0, 0, False
    while n_iter < max_iter and not converged:
        n_iter += 1
        G = (a / f[:, None]).T @ b  # Σ_n a_n b_nᵀ / f_n
        num = R * G  # expected (exit j, start l) counts, up to the E-step's normalisation
        den = num.sum(axis=1, keepdims=True)
        R = np.where(den > 0, num / np.where(den > 0, den, 1.0), R)
        new, f = loglik(R)
        converged = abs(new - ll) <= rtol * abs(ll)
        ll = new
    model = CoupledPH.build(first, second.T, R)
    return CoupledFit(model, ll, ll0, n_iter, converged, int(xa.size), float(np.corrcoef(xa, ya)[0, 1]))


def fit_coupled(x: npt.ArrayLike, y: npt.ArrayLike, *, structure: str = "hyperexp", order: int | str = 2,
                max_order: int | None = None, random_state: RandomState = None, **options: Any) -> CoupledFit:
    """Fit each stage's PH to its durations (:func:`overtake.fitting.fit_observations`, ``structure``
    and ``order``; ``order="auto"``: each stage's BIC-best of at most ``max_order`` phases), then the
    routing by :func:`fit_routing`. ``options`` go to the marginal fits."""
    from .data import samples
    from .em import fit_observations

    xa, ya = _check_pairs(x, y)
    rng = check_random_state(random_state)
    marginals = tuple(fit_observations(samples(v), structure=structure, order=order, max_order=max_order,
                                       random_state=rng, **options) for v in (xa, ya))
    first, second = marginals[0].ph, marginals[1].ph
    if first.atom > 1e-9 or second.atom > 1e-9:
        raise DataError("coupled fit: a stage's PH has an atom at zero; give positive durations")
    return replace(fit_routing(first, second, xa, ya), marginals=marginals)
