"""Distribution functions and sampling of a phase-type distribution.

Densities and tails are evaluated by uniformization over the sorted evaluation points (see
:mod:`overtake.fitting._uniformization`), so ``sf`` is computed directly and never as ``1 - cdf``;
samples come from simulating the absorbing Markov chain.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from . import _kernels as _u
from ._ph_moments import Moments
from .errors import InvalidParameterError

__all__ = ["DistributionFunctions", "RandomState", "check_random_state"]

FloatArray = npt.NDArray[np.float64]
RandomState = int | np.random.Generator | None


def check_random_state(random_state: RandomState) -> np.random.Generator:
    """Normalise ``random_state`` (None, int or Generator) to a Generator; never global state."""
    if random_state is None or isinstance(random_state, (int, np.integer)):
        return np.random.default_rng(random_state)
    if isinstance(random_state, np.random.Generator):
        return random_state
    raise InvalidParameterError(
        f"random_state must be None, an int or a numpy Generator, got {type(random_state).__name__}"
    )


class DistributionFunctions(Moments):
    """pdf, cdf, sf, ppf, log-likelihood and samples of :class:`overtake.fitting.PhaseType` (a base class of it)."""

    __slots__ = ()
    _alpha: FloatArray
    _T: FloatArray
    _t: FloatArray
    _sparse: tuple[FloatArray, npt.NDArray[np.int64], npt.NDArray[np.int64], FloatArray]

    def _evaluate(self, x: npt.ArrayLike, with_cdf: bool) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray]:
        xa = np.asarray(x, dtype=np.float64)
        flat = xa.ravel()
        ok = np.isfinite(flat) & (flat >= 0)
        grid, inv = np.unique(flat[ok], return_inverse=True)
        diag, src, dst, rate = self._sparse
        q = float(np.max(-diag))
        full = np.concatenate(([0.0], grid))
        gaps = np.diff(full)
        # refine long gaps so q*dt <= MAX_STEP between renormalisations (no underflow)
        pieces = np.maximum(np.ceil(gaps * q / _u.MAX_STEP), 1).astype(np.int64)
        dt = np.repeat(gaps / pieces, pieces)
        keep = np.cumsum(pieces)
        A, logs, cdf = _u.forward(self._alpha, diag, src, dst, rate, self._t, q, dt, with_cdf, _u.POISSON_EPS)
        A, logs, cdf = A[keep], logs[keep], cdf[keep]
        with np.errstate(divide="ignore"):
            logpdf_g = logs + np.log(A @ self._t)
        return flat, ok, inv, np.stack([logpdf_g, logs, cdf + self.atom]), xa.shape  # type: ignore[return-value]

    def _fill(self, x: npt.ArrayLike, row: int, below: float, above: float, log: bool) -> FloatArray:
        flat, ok, inv, vals, shape = self._evaluate(x, with_cdf=(row == 2))
        out = np.full(flat.shape, np.nan)
        out[ok] = vals[row][inv]
        fin = np.isfinite(flat)
        out[fin & (flat < 0)] = below
        out[np.isposinf(flat)] = above
        if not log and row != 2:
            out[ok] = np.exp(out[ok])
        return out.reshape(shape) if shape else out.reshape(())[()]

    def logpdf(self, x: npt.ArrayLike) -> FloatArray:
        """Log density (``-inf`` outside the support, no warning)."""
        return self._fill(x, 0, -np.inf, -np.inf, log=True)

    def pdf(self, x: npt.ArrayLike) -> FloatArray:
        """Density ``alpha exp(Tx) t`` (the atom at zero, if any, is not a density)."""
        return self._fill(x, 0, 0.0, 0.0, log=False)

    def logsf(self, x: npt.ArrayLike) -> FloatArray:
        """Log survival function, accurate far in the tail."""
        return self._logsf(x)

    def _logsf(self, x: npt.ArrayLike) -> FloatArray:
        flat, ok, inv, vals, shape = self._evaluate(x, with_cdf=False)
        out = np.full(flat.shape, np.nan)
        out[ok] = vals[1][inv]
        out[np.isfinite(flat) & (flat < 0)] = 0.0
        out[np.isposinf(flat)] = -np.inf
        return out.reshape(shape) if shape else out.reshape(())[()]

    def sf(self, x: npt.ArrayLike) -> FloatArray:
        """Survival function ``alpha exp(Tx) 1``, computed directly (not ``1 - cdf``)."""
        return np.exp(self._logsf(x))

    def cdf(self, x: npt.ArrayLike) -> FloatArray:
        """Distribution function, accumulated from absorption increments (accurate near 0)."""
        return self._fill(x, 2, 0.0, 1.0, log=False)

    def ppf(self, u: npt.ArrayLike) -> FloatArray:
        """Quantile function: the smallest ``x`` with ``cdf(x) >= u`` (safeguarded Newton)."""
        ua = np.asarray(u, dtype=np.float64)
        flat = ua.ravel()
        out = np.full(flat.shape, np.nan)
        valid = np.isfinite(flat) & (flat >= 0) & (flat <= 1)
        out[valid & (flat <= self.atom)] = 0.0
        out[valid & (flat == 1)] = np.inf
        todo = np.flatnonzero(valid & (flat > self.atom) & (flat < 1))
        if todo.size:
            target = flat[todo]
            lo = np.zeros(todo.size)
            hi = np.full(todo.size, self.mean())
            for _ in range(200):
                low = self.cdf(hi) < target
                if not low.any():
                    break
                hi[low] *= 2.0
            x = 0.5 * (lo + hi)
            for _ in range(100):
                c = self.cdf(x)
                f = self.pdf(x)
                below = c < target
                lo = np.where(below, x, lo)
                hi = np.where(below, hi, x)
                with np.errstate(divide="ignore", invalid="ignore"):
                    newton = x - (c - target) / f
                bad = ~np.isfinite(newton) | (newton <= lo) | (newton >= hi)
                x_new = np.where(bad, 0.5 * (lo + hi), newton)
                if np.all(np.abs(x_new - x) <= 1e-13 * np.maximum(x_new, 1e-300)):
                    x = x_new
                    break
                x = x_new
            out[todo] = x
        return out.reshape(ua.shape) if ua.shape else out.reshape(())[()]

    def isf(self, u: npt.ArrayLike) -> FloatArray:
        """Inverse survival function ``ppf(1 - u)``."""
        return self.ppf(1.0 - np.asarray(u, dtype=np.float64))

    def loglik(self, x: npt.ArrayLike, weights: npt.ArrayLike | None = None) -> float:
        """Log-likelihood ``sum_k w_k log f(x_k)`` of exact observations."""
        lp = np.asarray(self.logpdf(x), dtype=np.float64).ravel()
        if weights is None:
            return float(lp.sum())
        return float(np.asarray(weights, dtype=np.float64).ravel() @ lp)

    def rvs(self, size: int | tuple[int, ...] | None = None, random_state: RandomState = None) -> FloatArray:
        """Exact samples by simulating the absorbing Markov chain.

        Parameters
        ----------
        size : int or tuple of ints, optional
            Output shape; ``None`` returns a scalar.
        random_state : None, int or numpy.random.Generator
            Source of randomness; the global NumPy state is never used.
        """
        rng = check_random_state(random_state)
        shape = () if size is None else ((size,) if isinstance(size, (int, np.integer)) else tuple(size))
        n = int(np.prod(shape)) if shape else 1
        p = self.order
        a = np.append(self._alpha, self.atom)
        state = rng.choice(p + 1, size=n, p=a / a.sum())
        rates = -np.diag(self._T)
        jump = np.hstack([self._T / rates[:, None], (self._t / rates)[:, None]])
        jump[np.arange(p), np.arange(p)] = 0.0
        cum = np.cumsum(jump, axis=1)
        cum[:, -1] = 1.0
        out = np.zeros(n)
        alive = np.flatnonzero(state < p)
        while alive.size:
            s = state[alive]
            out[alive] += rng.standard_exponential(alive.size) / rates[s]
            u = rng.random(alive.size)
            nxt = (u[:, None] >= cum[s]).sum(axis=1)
            state[alive] = nxt
            alive = alive[nxt < p]
        return out.reshape(shape) if shape else out[0]
