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
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from overtake.phases import mean_order

from ._ph_functions import DistributionFunctions, RandomState, check_random_state
from .errors import InvalidParameterError

__all__ = ["PhaseType", "RandomState", "check_random_state"]

FloatArray = npt.NDArray[np.float64]

_TOL = 1e-9


class PhaseType(DistributionFunctions):
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
    Moments come from :class:`overtake.fitting._ph_moments.Moments`, distribution functions and
    samples from :class:`overtake.fitting._ph_functions.DistributionFunctions`. Instances are
    immutable (arrays are read-only); every method is a pure function of
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
    def structure(self) -> str:
        """Structure label (``general``, ``cf1``, ``coxian``, ``hypererlang``, ...)."""
        return self._structure

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
