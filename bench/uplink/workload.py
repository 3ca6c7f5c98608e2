"""Request-size distributions and open-loop Poisson schedules for the uplink testbed.

``wc98``  World Cup 1998 statistics of Harchol-Balter et al., "Size-based scheduling to improve web performance" §3.1.3 / Schroeder and Harchol-Balter, "Web servers under overload" §2.1: mean ~5 KB, 50% < 1 KB,
          90% < 9.3 KB, min 41 B, max 2.02 MB, Pareto tail alpha ~1.2. Modelled as a lognormal
          body (mu = ln 1000, sigma = 1.740) below 65 989 B (99.2% of requests) and a bounded
          Pareto(alpha = 1.2) tail up to 2.02 MB; the three parameters solve median = 1000,
          P(X < 9300) = 0.9 and mean = 5000 exactly (scipy fsolve, see ``_WC98``).
``p000``  Crovella et al., "Connection scheduling in web servers" Table 1: lognormal body (mu = 7.630, sigma = 1.001) below 9020 B (93.0%),
          bounded Pareto tail (alpha = 1.0) above. The paper's upper bound p = 1e10 B (10 GB)
          cannot be served on a 10 Mbit/s testbed in minutes; the tail is capped at 2.02 MB
          like wc98 (mean 5.5 KB instead of the paper's 11.1 KB).

Loads: ``rate = load * goodput / E[size + header]`` requests per second. ``w1`` is Schroeder and Harchol-Balter
Table 1 W1 (alternating ``phase`` s at load 0.2 and ``phase`` s at 1.2; mean 0.7). ``TRANSIENT``
holds all ten transient-overload workloads of that table as cycles of (seconds, load) phases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

HEADER_BYTES = 64  # "HTTP/1.1 200 OK" + Content-Length + Connection: close, see server.py


@dataclass(frozen=True)
class SizeModel:
    name: str
    mu: float
    sigma: float
    split: float  # body below, tail above
    alpha: float
    xmax: float
    xmin: float = 41.0

    @property
    def body_mass(self) -> float:
        return float(stats.lognorm.cdf(self.split, self.sigma, scale=math.exp(self.mu)))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        w = self.body_mass
        u = rng.random(n)
        body = u < w
        out = np.empty(n)
        out[body] = stats.lognorm.ppf(u[body], self.sigma, scale=math.exp(self.mu))
        v = (u[~body] - w) / (1.0 - w)
        a, lo, hi = self.alpha, self.split, self.xmax
        out[~body] = lo / (1.0 - v * (1.0 - (lo / hi) ** a)) ** (1.0 / a)
        return np.clip(np.round(out), self.xmin, self.xmax).astype(np.int64)

    def mean(self) -> float:
        """Exact mean of the unclipped model (body + bounded Pareto tail)."""
        mu, s, lo, hi, a = self.mu, self.sigma, self.split, self.xmax, self.alpha
        body = math.exp(mu + s * s / 2) * stats.norm.cdf((math.log(lo) - mu - s * s) / s)
        tw = 1.0 - self.body_mass
        norm = 1.0 - (lo / hi) ** a
        if a == 1.0:
            tail = tw * lo * math.log(hi / lo) / norm
        else:
            tail = tw * a * lo**a * (lo ** (1 - a) - hi ** (1 - a)) / ((a - 1) * norm)
        return float(body + tail)


MODELS = {
    "wc98": SizeModel("wc98", math.log(1000.0), 1.740089, 65989.0, 1.2, 2.02e6),
    "p000": SizeModel("p000", 7.630, 1.001, 9020.0, 1.0, 2.02e6),
}


# Schroeder and Harchol-Balter Table 1: (low-load seconds, overload seconds, low load, overload); mean load in the
# last column of the paper (0.7 for W1, W2; 0.8 for W7, W8; 0.9 for the others)
TRANSIENT: dict[str, tuple[float, float, float, float]] = {
    "w1": (25, 25, 0.2, 1.2), "w2": (10, 10, 0.2, 1.2), "w3": (50, 50, 0.2, 1.6),
    "w4": (25, 25, 0.4, 1.4), "w5": (10, 10, 0.4, 1.4), "w6": (40, 40, 0.1, 1.7),
    "w7": (63, 6, 0.4, 5.0), "w8": (63, 10, 0.45, 3.0), "w9": (20, 3, 0.735, 2.0),
    "w10": (13.3, 2, 0.735, 2.0),
}


def transient_phases(name: str, scale: float = 1.0) -> list[tuple[float, float]]:
    """One cycle of Schroeder and Harchol-Balter's workload ``name`` as [(seconds, load), ...]; ``scale`` shortens
    both phases alike (same shape and mean load, shorter run)."""
    if name not in TRANSIENT:
        raise ValueError(f"workload: one of {', '.join(TRANSIENT)}, got {name!r}")
    if not scale > 0:
        raise ValueError(f"phase scale: must be > 0, got {scale}")
    lo_s, hi_s, lo, hi = TRANSIENT[name]
    return [(lo_s * scale, lo), (hi_s * scale, hi)]


def schedule(
    model: SizeModel,
    *,
    load: float | None,
    duration: float,
    goodput_bps: float,
    seed: int,
    w1_phase: float | None = None,
    w1_loads: tuple[float, float] = (0.2, 1.2),
    phases: list[tuple[float, float]] | None = None,
) -> list[tuple[float, int]]:
    """(arrival time s, size B) pairs: Poisson at ``load``, W1 alternating ``w1_phase`` s at
    ``w1_loads``, or any cycle of ``phases`` [(seconds, load), ...] (a piecewise-constant rate)."""
    if w1_phase is not None:
        phases = [(w1_phase, w1_loads[0]), (w1_phase, w1_loads[1])]
    rng = np.random.default_rng(seed)
    per_req = (model.mean() + HEADER_BYTES) * 8.0
    out: list[tuple[float, int]] = []
    if phases is None:
        assert load is not None
        phases = [(duration, load)]
    cycle = sum(d for d, _ in phases)
    t = 0.0
    while t < duration:
        # the phase containing t and its end; arrivals are Poisson within it and, being
        # memoryless, restart at the boundary
        k, start = 0, t - (t % cycle)
        while start + phases[k][0] <= t:
            start += phases[k][0]
            k = (k + 1) % len(phases)
        end = min(start + phases[k][0], duration)
        lam = phases[k][1] * goodput_bps / per_req
        nxt = t + rng.exponential(1.0 / lam) if lam > 0 else end
        if nxt >= end:
            t = end
            continue
        t = nxt
        out.append((t, 0))
    sizes = model.sample(len(out), rng)
    return [(a, int(s)) for (a, _), s in zip(out, sizes)]
