"""Priority bands: cutoffs on remaining size (SRPT) or remaining time (SRRT).

Harchol-Balter et al., "Size-based scheduling to improve web performance" §2.2.2 (rules of thumb
for heavy-tailed web workloads), with cutoffs
``x_1 < x_2 < ... < x_n`` splitting requests into ``n + 1`` classes:

* the lowest cutoff ``x_1`` sits near the median request size (about 50% of requests are
  smaller; they are so little load that separating them further buys nothing);
* the highest cutoff ``x_n`` is low enough that the largest ~0.5-1% of requests are above it
  (so the largest requests are not starved by a crowded top class);
* the middle cutoffs matter far less; logarithmic spacing works well.

Harchol-Balter et al. §2.2.4 used six classes with cutoffs 1K, 2K, 5K, 20K, 50K (:data:`PAPER_001`), and
§3.4 two classes cut at the median. Band 0 here is the *highest-priority data band*; the
control band (SYN-ACKs, headers before the size is known, Harchol-Balter et al. §2.2.3) sits above all
data bands and is handled by :mod:`overtake.controller.uplink.qdisc`, not here.

:class:`AdaptiveCutoffs` re-derives the cutoffs from a sliding window of observed values
(response sizes for SRPT, remaining-time estimates for SRRT), so the rule follows the served
distribution; fixed cutoffs can always be given instead.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from overtake.controller.uplink.errors import UplinkInputError

__all__ = [
    "PAPER_001",
    "TOP_FRACTION",
    "AdaptiveCutoffs",
    "Cutoffs",
    "check_rule",
    "cutoffs_from_samples",
    "log_spaced",
    "parse_cutoffs",
]


@dataclass(frozen=True)
class Cutoffs:
    """Increasing cutoffs ``edges``; :meth:`band` maps a value to ``0 .. len(edges)``.

    A value ``v`` is in band ``b`` = number of edges strictly below ``v``: ``v <= edges[0]``
    is band 0 (highest priority), ``v > edges[-1]`` the last band.
    """

    edges: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.edges:
            raise UplinkInputError("cutoffs: need at least one cutoff; give e.g. '1K,2K,5K'")
        prev = 0.0
        for i, e in enumerate(self.edges):
            if not (math.isfinite(e) and e > prev):
                raise UplinkInputError(
                    f"cutoffs[{i}]: {e!r} must be finite, positive and above the previous "
                    f"cutoff ({prev!r}); give strictly increasing positive cutoffs"
                )
            prev = e

    @property
    def n_bands(self) -> int:
        """Number of bands, ``len(edges) + 1``."""
        return len(self.edges) + 1

    def band(self, value: float) -> int:
        """Band of ``value`` (0 = highest priority); NaN/negative count as 0 remaining."""
        if not value > self.edges[0]:  # also catches NaN
            return 0
        return bisect.bisect_left(self.edges, value)  # number of edges strictly below value

    def fraction_above(self, samples: Sequence[float]) -> float:
        """Share of ``samples`` strictly above the highest cutoff (the rule wants ~0.5-1%)."""
        a = np.asarray(samples, dtype=float)
        return float(np.mean(a > self.edges[-1])) if a.size else 0.0

    def __str__(self) -> str:
        return ",".join(_fmt(e) for e in self.edges)


def _fmt(x: float) -> str:
    for unit, scale in (("M", 1024.0**2), ("K", 1024.0)):
        if x >= scale and abs(x / scale - round(x / scale, 1)) < 1e-9:
            return f"{x / scale:g}{unit}"
    return f"{x:g}"


PAPER_001 = Cutoffs((1024.0, 2048.0, 5120.0, 20480.0, 51200.0))
"""Harchol-Balter et al. §2.2.4 table: classes <=1K, 1-2K, 2-5K, 5-20K, 20-50K, >50K (bytes)."""


def log_spaced(low: float, high: float, n_cutoffs: int) -> Cutoffs:
    """``n_cutoffs`` cutoffs from ``low`` to ``high``, geometrically spaced (Harchol-Balter et al. §2.2.2)."""
    if n_cutoffs < 1:
        raise UplinkInputError(f"n_cutoffs: {n_cutoffs} must be >= 1")
    if not (0 < low and math.isfinite(high)):
        raise UplinkInputError(f"cutoffs: low {low!r} must be > 0 and high {high!r} finite")
    if n_cutoffs == 1:
        return Cutoffs((float(low),))
    if not high > low:
        # degenerate distribution (e.g. one file size): spread a decade above low
        high = low * 10.0
    return Cutoffs(tuple(float(x) for x in np.geomspace(low, high, n_cutoffs)))


#: Share of the samples above the highest cutoff: the low end of Harchol-Balter et al.'s 0.5-1 %,
#: which keeps the largest requests near their FAIR time at the same mean (BENCHMARKS.md
#: ``uplink-sweep-60s``).
TOP_FRACTION = 0.005


def cutoffs_from_samples(
    samples: Iterable[float],
    n_bands: int,
    *,
    low_quantile: float = 0.5,
    top_fraction: float = TOP_FRACTION,
) -> Cutoffs:
    """Harchol-Balter et al. §2.2.2 rule applied to observed values (sizes in bytes or times in seconds).

    ``n_bands - 1`` cutoffs: the lowest at the ``low_quantile`` (median), the highest at the
    ``1 - top_fraction`` quantile (so ``top_fraction`` of the samples are above it),
    log-spaced in between. With two bands the single cutoff is the median (Harchol-Balter et al. §3.4).
    """
    if n_bands < 2:
        raise UplinkInputError(f"bands: {n_bands} data bands cannot separate sizes; need >= 2")
    check_rule(low_quantile, top_fraction)
    a = np.asarray([float(s) for s in samples], dtype=float)
    a = a[np.isfinite(a) & (a > 0)]
    if a.size == 0:
        raise UplinkInputError("samples: no positive finite value to derive cutoffs from")
    low = float(np.quantile(a, low_quantile))
    high = float(np.quantile(a, 1.0 - top_fraction))
    return log_spaced(low, high, n_bands - 1)


def check_rule(low_quantile: float, top_fraction: float) -> None:
    """Reject a rule :func:`cutoffs_from_samples` cannot apply (at start-up, not mid-request)."""
    if not 0.0 < low_quantile < 1.0:
        raise UplinkInputError(f"low_quantile: {low_quantile!r} must be in (0, 1), e.g. 0.5")
    if not 0.0 < top_fraction < 1.0 - low_quantile:
        raise UplinkInputError(
            f"top_fraction: {top_fraction!r} must be in (0, {1 - low_quantile:g}); "
            "Harchol-Balter et al. uses 0.005-0.01"
        )


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "bytes": {"": 1.0, "b": 1.0, "k": 1024.0, "kb": 1024.0, "m": 1024.0**2, "mb": 1024.0**2},
    "seconds": {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6},
}


def parse_cutoffs(text: str, *, unit: str = "bytes") -> Cutoffs:
    """Parse ``"1K,2K,5K,20K,50K"`` (bytes; K/M binary) or ``"5ms,50ms,0.5s"`` (seconds)."""
    table = _UNITS.get(unit)
    if table is None:
        raise UplinkInputError(f"unit: {unit!r} must be 'bytes' or 'seconds'")
    values = []
    for i, part in enumerate(text.split(",")):
        m = _SIZE.match(part)
        scale = table.get(m.group(2).lower()) if m else None
        if m is None or scale is None:
            hint = "1K,2K,5K,20K,50K" if unit == "bytes" else "5ms,50ms,0.5s"
            raise UplinkInputError(
                f"cutoffs[{i}]: cannot read {part.strip()!r} as {unit}; write e.g. {hint!r}"
            )
        values.append(float(m.group(1)) * scale)
    return Cutoffs(tuple(values))


class AdaptiveCutoffs:
    """Cutoffs re-derived every ``every`` observations from the last ``window`` ones.

    Starts from ``initial`` (or derives from the first ``min_samples`` observations). The
    number of bands never changes, so a band index stays within the configured bands.
    """

    def __init__(
        self,
        initial: Cutoffs,
        *,
        window: int = 4096,
        every: int = 256,
        min_samples: int = 256,
        low_quantile: float = 0.5,
        top_fraction: float = TOP_FRACTION,
    ) -> None:
        if window < min_samples or every < 1 or min_samples < 2:
            raise UplinkInputError(
                f"adaptive cutoffs: need window ({window}) >= min_samples ({min_samples}) >= 2 "
                f"and every ({every}) >= 1"
            )
        check_rule(low_quantile, top_fraction)  # else the first refit would raise mid-request
        self._current = initial
        self._window: deque[float] = deque(maxlen=window)
        self._every = every
        self._min = min_samples
        self._lq = low_quantile
        self._tf = top_fraction
        self._since = 0
        self.updates = 0

    @property
    def current(self) -> Cutoffs:
        """The cutoffs in force."""
        return self._current

    def observe(self, value: float) -> None:
        """Record one observed value; recompute the cutoffs when due."""
        if not (value > 0 and math.isfinite(value)):
            return
        self._window.append(float(value))
        self._since += 1
        if self._since >= self._every and len(self._window) >= self._min:
            self._since = 0
            self._current = cutoffs_from_samples(
                self._window,
                self._current.n_bands,
                low_quantile=self._lq,
                top_fraction=self._tf,
            )
            self.updates += 1
