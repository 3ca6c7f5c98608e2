"""The frozen continuous phase-type distribution ``PhaseType(alpha, T)``.

A phase-type (PH) distribution is the time to absorption of a continuous-time Markov chain
with transient states ``1..p`` started from ``alpha`` (Neuts 1981; van der Weij et al., "Dynamic thread assignment", §2). With
``t = -T 1`` (the exit rates, per second),

.. math::

    f(x) = \\alpha e^{Tx} t, \\qquad \\bar F(x) = \\alpha e^{Tx} \\mathbf 1, \\qquad
    E[X^k] = k!\\, \\alpha (-T)^{-k} \\mathbf 1 .

If ``sum(alpha) < 1`` the remaining mass is an atom at zero. The object mimics a frozen
``scipy.stats`` distribution: ``pdf, logpdf, cdf, sf, logsf, ppf, rvs, mean, var, std, moment``.
Densities and tails are evaluated by uniformization over the sorted evaluation points (see
:mod:`overtake.fitting._uniformization`), so ``sf`` is computed directly and never as ``1 - cdf``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from overtake.phases import mean_order, phase_means

from . import _kernels as _u
from .errors import InvalidParameterError

__all__ = ["PhaseType", "check_random_state"]

FloatArray = npt.NDArray[np.float64]
RandomState = int | np.random.Generator | None

_TOL = 1e-9


def check_random_state(random_state: RandomState) -> np.random.Generator:
    """Normalise ``random_state`` (None, int or Generator) to a Generator; never global state."""
    if random_state is None or isinstance(random_state, (int, np.integer)):
        return np.random.default_rng(random_state)
    if isinstance(random_state, np.random.Generator):
        return random_state
    raise InvalidParameterError(
        f"random_state must be None, an int or a numpy Generator, got {type(random_state).__name__}"
    )


class PhaseType:
    """Continuous phase-type distribution with initial vector ``alpha`` and sub-generator ``T``.

    Parameters
    ----------
    alpha : array_like, shape (p,)
        Initial probabilities of the transient phases; ``sum(alpha) <= 1`` (the rest is an atom
        at zero).
    T : array_like, shape (p, p)
        Sub-generator, rates per second: ``T[i, i] < 0``, ``T[i, j] >= 0`` off the diagonal,
        row sums ``<= 0``, and absorption reachable from every phase.
    structure : str, optional
        Free-form label of the structure (``"cf1"``, ``"hypererlang"``, ...), kept in JSON.

    Raises
    ------
    InvalidParameterError
        If ``(alpha, T)`` is not a phase-type representation; the message names the entry.

    Notes
    -----
    Instances are immutable (arrays are read-only); every method is a pure function of
    ``(alpha, T)``.
    """

    __slots__ = ("_alpha", "_T", "_t", "_structure", "_sparse")
    _alpha: FloatArray
    _T: FloatArray
    _t: FloatArray
    _structure: str
    _sparse: tuple[FloatArray, npt.NDArray[np.int64], npt.NDArray[np.int64], FloatArray]

    def __init__(self, alpha: npt.ArrayLike, T: npt.ArrayLike, *, structure: str = "general") -> None:
        a, tm, t = _validate(alpha, T)
        for arr in (a, tm, t):
            arr.setflags(write=False)
        object.__setattr__(self, "_alpha", a)
        object.__setattr__(self, "_T", tm)
        object.__setattr__(self, "_t", t)
        object.__setattr__(self, "_structure", str(structure))
        object.__setattr__(self, "_sparse", _sparse(tm))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PhaseType is immutable")

    # ----------------------------------------------------------------- parameters
    @property
    def alpha(self) -> FloatArray:
        """Initial probability vector, shape (p,)."""
        return self._alpha

    @property
    def T(self) -> FloatArray:
        """Sub-generator, shape (p, p), rates per second."""
        return self._T

    @property
    def exit_rates(self) -> FloatArray:
        """Exit-rate vector ``t = -T 1``, shape (p,)."""
        return self._t

    @property
    def order(self) -> int:
        """Number of transient phases p."""
        return int(self._alpha.shape[0])

    @property
    def structure(self) -> str:
        """Structure label (``general``, ``cf1``, ``coxian``, ``hypererlang``, ...)."""
        return self._structure

    @property
    def atom(self) -> float:
        """Probability mass at zero, ``1 - sum(alpha)``."""
        return float(max(0.0, 1.0 - self._alpha.sum()))

    @property
    def n_params(self) -> int:
        """Free parameters of the structure (used by AIC/BIC)."""
        p = self.order
        s = self._structure
        if s in ("cf1",):
            return 2 * p - 1
        if s in ("coxian",):
            return 2 * p - 1
        if s in ("hyperexponential", "hyperexp", "hypererlang"):
            return 2 * int(np.count_nonzero(self._alpha)) - 1
        if s in ("erlang", "exponential"):
            return 1
        nz = int(np.count_nonzero(self._T - np.diag(np.diag(self._T))) + np.count_nonzero(self._t))
        return nz + int(np.count_nonzero(self._alpha)) - 1

    # ----------------------------------------------------------------- moments
    def moment(self, k: int) -> float:
        """Raw moment ``E[X^k] = k! alpha (-T)^{-k} 1``."""
        if int(k) != k or k < 0:
            raise InvalidParameterError(f"k must be a non-negative integer, got {k!r}")
        k = int(k)
        if k == 0:
            return 1.0
        v: FloatArray = np.ones(self.order)
        for _ in range(k):
            v = np.asarray(np.linalg.solve(-self._T, v), dtype=np.float64)
        return float(math.factorial(k) * self._alpha @ v)

    def mean(self) -> float:
        """Mean, seconds."""
        return self.moment(1)

    def var(self) -> float:
        """Variance, seconds squared."""
        m1 = self.moment(1)
        return self.moment(2) - m1 * m1

    def std(self) -> float:
        """Standard deviation, seconds."""
        return math.sqrt(max(self.var(), 0.0))

    def scv(self) -> float:
        """Squared coefficient of variation ``var / mean**2``."""
        m1 = self.moment(1)
        return self.var() / (m1 * m1)

    # ----------------------------------------------------------------- phases
    def phase_means(self) -> FloatArray:
        """Expected time to absorption from each phase, ``(-T)^{-1} 1``, seconds."""
        return phase_means(self._T)

    def by_mean(self) -> PhaseType:
        """The same distribution with its phases relabelled from the shortest mean to the longest.

        Phase ``j`` of the result has the ``j``-th smallest :meth:`phase_means` (ties keep their
        order): the numbering :mod:`overtake.phases` gives users and phase headers. Only the
        labels move (``alpha P``, ``P^T T P`` for the permutation ``P``), so every density,
        moment and sample path law is unchanged; ``structure`` is kept (a CF1 chain then runs
        from the last phase to the first)."""
        order = mean_order(self._T)
        if np.array_equal(order, np.arange(self.order)):
            return self
        return PhaseType(self._alpha[order], self._T[np.ix_(order, order)], structure=self._structure)

    # ----------------------------------------------------------------- evaluation
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

    # ----------------------------------------------------------------- serialisation
    def to_dict(self, **metadata: Any) -> dict[str, Any]:
        """``{"alpha": [...], "T": [[...]], "structure": ..., "order": ..., **metadata}``."""
        d: dict[str, Any] = {
            "alpha": [float(v) for v in self._alpha],
            "T": [[float(v) for v in row] for row in self._T],
            "structure": self._structure,
            "order": self.order,
        }
        d.update(metadata)
        return d

    def to_json(self, *, indent: int | None = 2, **metadata: Any) -> str:
        """JSON text; top-level ``alpha`` and ``T`` are what the solver reads."""
        return json.dumps(self.to_dict(**metadata), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PhaseType:
        """Inverse of :meth:`to_dict`; metadata keys other than ``structure`` are ignored."""
        if not isinstance(d, Mapping) or "alpha" not in d or "T" not in d:
            raise InvalidParameterError("JSON must be an object with keys 'alpha' and 'T'")
        return cls(d["alpha"], d["T"], structure=str(d.get("structure", "general")))

    @classmethod
    def from_json(cls, text: str) -> PhaseType:
        """Inverse of :meth:`to_json`."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidParameterError(f"not valid JSON: {exc}") from None
        return cls.from_dict(d)

    # ----------------------------------------------------------------- dunder
    def __repr__(self) -> str:
        return (
            f"PhaseType(order={self.order}, structure={self._structure!r}, "
            f"mean={self.mean():.6g}, scv={self.scv():.6g})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PhaseType):
            return NotImplemented
        return bool(np.array_equal(self._alpha, other._alpha) and np.array_equal(self._T, other._T))

    def __hash__(self) -> int:
        return hash((self._alpha.tobytes(), self._T.tobytes()))


def _sparse(T: FloatArray) -> tuple[FloatArray, npt.NDArray[np.int64], npt.NDArray[np.int64], FloatArray]:
    diag = np.ascontiguousarray(np.diag(T))
    off = T.copy()
    np.fill_diagonal(off, 0.0)
    src, dst = np.nonzero(off > 0)
    return diag, src.astype(np.int64), dst.astype(np.int64), np.ascontiguousarray(off[src, dst])


def _validate(alpha: npt.ArrayLike, T: npt.ArrayLike) -> tuple[FloatArray, FloatArray, FloatArray]:
    try:
        a = np.array(alpha, dtype=np.float64)
        tm = np.array(T, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(f"alpha and T must be numeric arrays ({exc})") from None
    if a.ndim != 1 or a.size == 0:
        raise InvalidParameterError(f"alpha must be a non-empty 1-D vector, got shape {a.shape}")
    p = a.size
    if tm.shape != (p, p):
        raise InvalidParameterError(f"T must have shape ({p}, {p}) to match alpha, got {tm.shape}")
    for name, arr in (("alpha", a), ("T", tm)):
        bad = np.argwhere(~np.isfinite(arr))
        if bad.size:
            idx = ",".join(str(int(i)) for i in bad[0])
            raise InvalidParameterError(f"{name}[{idx}] must be finite, got {arr[tuple(bad[0])]}")
    neg = np.flatnonzero(a < -_TOL)
    if neg.size:
        raise InvalidParameterError(f"alpha[{neg[0]}] must be >= 0, got {a[neg[0]]}")
    a = np.clip(a, 0.0, None)
    if a.sum() > 1 + 1e-8:
        raise InvalidParameterError(f"sum(alpha) must be <= 1, got {a.sum()!r}")
    if a.sum() <= 0:
        raise InvalidParameterError("sum(alpha) must be > 0 (all mass at zero is not a PH distribution)")
    if a.sum() > 1:
        a = a / a.sum()
    for i in range(p):
        if not tm[i, i] < 0:
            raise InvalidParameterError(f"T[{i},{i}] must be < 0, got {tm[i, i]}")
    off = tm.copy()
    np.fill_diagonal(off, 0.0)
    neg2 = np.argwhere(off < 0)
    if neg2.size:
        i, j = (int(v) for v in neg2[0])
        raise InvalidParameterError(f"T[{i},{j}] must be >= 0 off the diagonal, got {tm[i, j]}")
    t = -tm.sum(axis=1)
    scale = np.abs(np.diag(tm))
    badrow = np.flatnonzero(t < -_TOL * scale)
    if badrow.size:
        i = int(badrow[0])
        raise InvalidParameterError(f"row {i} of T must sum to <= 0 (exit rate >= 0), got sum {-t[i]}")
    t = np.where(t < _TOL * scale, 0.0, t)
    # absorption must be reachable from every phase, else T is singular
    reach = t > 0
    changed = True
    while changed:
        new = reach | ((off > 0) & reach[None, :]).any(axis=1)
        changed = bool((new != reach).any())
        reach = new
    if not reach.all():
        i = int(np.flatnonzero(~reach)[0])
        raise InvalidParameterError(f"phase {i} cannot reach absorption: T is singular (not a sub-generator)")
    return a, tm, t
