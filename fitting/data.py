"""Observations for fitting: exact, right-censored, weighted and binned durations (seconds).

Every kind is reduced to one sorted time grid ``0 = g_0 < g_1 < ... < g_G`` and three record
lists that the E-step understands:

* exact points ``x = g_k`` with weight ``w`` (density term ``alpha e^{T x} t``);
* right-censored ``X > g_k`` (a request cut by a timeout; survival term ``alpha e^{T x} 1``);
* intervals ``g_lo < X <= g_hi`` with a count (histogram bins; ``hi = -1`` means infinity).

Duplicates collapse into one grid point, so ties (clock resolution) cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .errors import DataError

__all__ = ["Observations", "binned", "samples"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Observations:
    """Validated observations on a sorted grid (see module docstring).

    Attributes
    ----------
    grid : ndarray
        Sorted distinct times, ``grid[0] == 0``.
    point_idx, point_w : ndarray
        Exact observations (grid index, weight).
    cens_idx, cens_w : ndarray
        Right-censored observations ``X > grid[idx]``.
    lo_idx, hi_idx, int_w : ndarray
        Interval observations ``grid[lo] < X <= grid[hi]`` (``hi == -1``: unbounded).
    kind : str
        ``"exact"``, ``"censored"`` or ``"binned"``.
    """

    grid: FloatArray
    point_idx: IntArray
    point_w: FloatArray
    cens_idx: IntArray
    cens_w: FloatArray
    lo_idx: IntArray
    hi_idx: IntArray
    int_w: FloatArray
    kind: str
    _refined: dict[float, Observations] = field(default_factory=dict, compare=False, repr=False)

    @property
    def n(self) -> float:
        """Total weight (number of observations for unweighted data); used by BIC."""
        return float(self.point_w.sum() + self.cens_w.sum() + self.int_w.sum())

    @property
    def dt(self) -> FloatArray:
        """Grid increments ``g_k - g_{k-1}``, k = 1..G."""
        return np.diff(self.grid)

    def moments(self) -> tuple[float, float, float]:
        """Rough first three raw moments for initialisation.

        Censored records count at their censoring time and bins at their midpoint (or 1.5 times
        the lower edge when unbounded), so the figures are lower bounds, fine for starting
        values only.
        """
        xs = [self.grid[self.point_idx], self.grid[self.cens_idx]]
        ws = [self.point_w, self.cens_w]
        if self.int_w.size:
            lo = self.grid[self.lo_idx]
            hi = np.where(self.hi_idx >= 0, self.grid[self.hi_idx], 1.5 * np.maximum(lo, 1e-300))
            xs.append(0.5 * (lo + hi))
            ws.append(self.int_w)
        x = np.concatenate(xs)
        w = np.concatenate(ws)
        w = w / w.sum()
        return float(w @ x), float(w @ x**2), float(w @ x**3)

    def refined(self, max_dt: float) -> Observations:
        """Same observations on a grid with extra points so no gap exceeds ``max_dt``.

        Uniformization renormalises only at grid points; long gaps in a stiff model would
        otherwise underflow (see :data:`overtake.fitting._uniformization.MAX_STEP`).
        """
        gaps = np.diff(self.grid)
        if gaps.size == 0 or gaps.max() <= max_dt:
            return self
        cached = self._refined.get(max_dt)
        if cached is not None:
            return cached
        pieces = np.maximum(np.ceil(gaps / max_dt).astype(np.int64), 1)
        k = np.repeat(np.arange(gaps.size), pieces)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        frac = (np.arange(k.size) - first + 1) / pieces[k]
        grid = np.concatenate(([self.grid[0]], self.grid[k] + gaps[k] * frac))
        grid[np.cumsum(pieces)] = self.grid[1:]  # exact original points
        pos = np.concatenate(([0], np.cumsum(pieces)))  # old index -> new index

        def m(idx: IntArray) -> IntArray:
            return np.where(idx >= 0, pos[np.maximum(idx, 0)], -1).astype(np.int64)

        out = Observations(grid, m(self.point_idx), self.point_w, m(self.cens_idx), self.cens_w,
                           m(self.lo_idx), m(self.hi_idx), self.int_w, self.kind)
        self._refined[max_dt] = out
        return out

    def coarse(self, bins: int = 400) -> Observations:
        """Exact samples aggregated into log-spaced bins, each a weighted point at its mean
        (G-FIT's trace aggregation). An approximation used only to find starting values fast;
        the fit is always finished on the full data."""
        x, w = self.exact_values()
        if self.kind != "exact" or x.size <= 2 * bins:
            return self
        edges = np.geomspace(x[0], x[-1] * (1 + 1e-12), bins + 1)
        b = np.minimum(np.searchsorted(edges, x, side="right") - 1, bins - 1)
        W = np.bincount(b, weights=w, minlength=bins)
        S = np.bincount(b, weights=w * x, minlength=bins)
        nz = W > 0
        return samples(S[nz] / W[nz], weights=W[nz])

    def exact_values(self) -> tuple[FloatArray, FloatArray]:
        """Distinct exact values and their weights (for closed-form hyper-Erlang EM)."""
        return self.grid[self.point_idx], self.point_w


def _array(name: str, v: npt.ArrayLike) -> FloatArray:
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise DataError(f"{name} must be numeric, got {type(v).__name__}") from None
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise DataError(f"{name} must be 1-D, got shape {a.shape}")
    return a


def _durations(x: npt.ArrayLike) -> FloatArray:
    """The durations as floats, each finite and > 0 (the first bad one named)."""
    xa = _array("x", x)
    if xa.size == 0:
        raise DataError("x must contain at least 2 samples, got 0")
    bad = np.flatnonzero(~np.isfinite(xa))
    if bad.size:
        raise DataError(f"x[{bad[0]}] must be finite, got {xa[bad[0]]} (drop NaN/inf before fitting)")
    bad = np.flatnonzero(xa <= 0)
    if bad.size:
        raise DataError(f"x[{bad[0]}] must be > 0 seconds, got {xa[bad[0]]}")
    return xa


def _weights(weights: npt.ArrayLike, n: int) -> FloatArray:
    """The multiplicities: one per duration, each finite and >= 0."""
    w = _array("weights", weights)
    if w.shape != (n,):
        raise DataError(f"weights must have the length of x ({n}), got {w.size}")
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        raise DataError(f"weights[{bad[0]}] must be finite and >= 0, got {w[bad[0]]}")
    return w


def _censor_flags(censored: npt.ArrayLike, shape: tuple[int, ...]) -> npt.NDArray[np.bool_]:
    """The censoring flags as booleans (0/1 accepted), one per duration."""
    c = np.asarray(censored)
    if c.shape != shape:
        raise DataError(f"censored must have the length of x ({shape[0]}), got shape {c.shape}")
    if c.dtype != bool:
        if not np.isin(c, [0, 1]).all():
            raise DataError("censored must be booleans (True where the request was cut off)")
        c = c.astype(bool)
    return c


def samples(x: npt.ArrayLike, *, weights: npt.ArrayLike | None = None,
            censored: npt.ArrayLike | None = None) -> Observations:
    """Validate exact (optionally weighted, optionally right-censored) durations.

    Parameters
    ----------
    x : array_like
        Durations in seconds, finite and > 0. For censored entries, the censoring time.
    weights : array_like, optional
        Non-negative multiplicities, same length as ``x``.
    censored : array_like of bool, optional
        True where the request was cut off at ``x`` (only ``X > x`` is known).

    Raises
    ------
    DataError
        Empty input, NaN/inf, values <= 0, fewer than two distinct exact values, or bad weights.
    """
    xa = _durations(x)
    w = np.ones(xa.size) if weights is None else _weights(weights, xa.size)
    c = np.zeros(xa.size, dtype=bool) if censored is None else _censor_flags(censored, xa.shape)
    keep = w > 0
    xa, w, c = xa[keep], w[keep], c[keep]
    exact = ~c
    if w[exact].sum() <= 0:
        raise DataError("at least one uncensored sample with weight > 0 is needed")
    ux = np.unique(xa[exact])
    if ux.size < 2:
        if exact.sum() == 1:
            raise DataError("x must contain at least 2 uncensored samples, got 1")
        raise DataError(f"all uncensored samples are equal (x={ux[0]}): zero variance cannot be fitted by a PH")
    grid, inv = np.unique(np.concatenate(([0.0], xa)), return_inverse=True)
    inv = inv[1:]
    pidx, pw = _collapse(inv[exact], w[exact], grid.size)
    cidx, cw = _collapse(inv[c], w[c], grid.size)
    empty_i = np.zeros(0, dtype=np.int64)
    return Observations(grid, pidx, pw, cidx, cw, empty_i, empty_i, np.zeros(0),
                        "censored" if c.any() else "exact")


def _collapse(idx: IntArray, w: FloatArray, size: int) -> tuple[IntArray, FloatArray]:
    tot = np.asarray(np.bincount(idx, weights=w, minlength=size), dtype=np.float64)
    nz = np.flatnonzero(tot > 0)
    return nz.astype(np.int64), tot[nz]


def binned(edges: npt.ArrayLike, counts: npt.ArrayLike) -> Observations:
    """Validate a histogram: ``counts[i]`` observations in ``(edges[i], edges[i+1]]``.

    Parameters
    ----------
    edges : array_like, shape (m+1,)
        Strictly increasing bin edges in seconds, ``edges[0] >= 0``; the last may be ``inf``
        (Prometheus' ``+Inf`` bucket).
    counts : array_like, shape (m,)
        Non-negative counts (not cumulative: difference Prometheus buckets first).
    """
    e = _array("edges", edges)
    k = _array("counts", counts)
    if e.size < 2:
        raise DataError(f"edges must have at least 2 entries, got {e.size}")
    if k.size != e.size - 1:
        raise DataError(f"counts must have len(edges)-1 = {e.size - 1} entries, got {k.size}")
    if np.isnan(e).any() or np.isneginf(e).any() or np.isposinf(e[:-1]).any():
        raise DataError("edges must be finite (only the last may be +inf)")
    if e[0] < 0:
        raise DataError(f"edges[0] must be >= 0 seconds, got {e[0]}")
    bad = np.flatnonzero(np.diff(e) <= 0)
    if bad.size:
        raise DataError(f"edges must be strictly increasing, edges[{bad[0] + 1}]={e[bad[0] + 1]} <= edges[{bad[0]}]={e[bad[0]]}")
    bad = np.flatnonzero(~np.isfinite(k) | (k < 0))
    if bad.size:
        raise DataError(f"counts[{bad[0]}] must be finite and >= 0, got {k[bad[0]]}")
    if np.count_nonzero(k) < 2:
        raise DataError("counts must have at least 2 non-empty bins to fit a distribution")
    finite = e[np.isfinite(e)]
    grid = np.unique(np.concatenate(([0.0], finite)))
    idx = np.searchsorted(grid, finite)
    lo = idx[: k.size]
    hi = np.append(idx[1:], -1) if np.isposinf(e[-1]) else idx[1:]
    hi = hi[: k.size]
    nz = k > 0
    empty_i = np.zeros(0, dtype=np.int64)
    return Observations(grid, empty_i, np.zeros(0), empty_i, np.zeros(0),
                        lo[nz].astype(np.int64), hi[nz].astype(np.int64), k[nz], "binned")
