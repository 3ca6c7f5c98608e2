"""Phase classification: which PH phase a request is in (paper 004, §2: the state counts
requests per (stage, phase) coordinate).

Three modes (stages file ``classifier.mode``):

* ``explicit`` — a request header (default ``X-Overtake-Phase: <1..M>``) or the matching route's
  ``phase`` gives the start phase; the phase is kept while in service (exact for
  hyperexponential stages, whose phases do not move).
* ``learned`` — per route (method + path) a window of observed service demands t_1..t_n; the
  start phase is argmax_j  log α_j + Σ_k log f_j(t_k), with f_j(t) = e_j exp(T t) t⁰ the PH
  density started in phase j. Demands come from Apache's ``X-Stage-CPU-us`` answer header when
  present (the stage handler's thread CPU), else the sojourn in Apache.
* ``hidden`` — waiting requests take the prior's most likely phase argmax α; in-service requests
  are re-estimated from their attained service a (∫ share dt, share = 1/K under PS) as the most
  likely *current* phase, argmax_j (α exp(T a))_j.

Phase-blind policies (baselines) have one phase per stage: everything is phase 0.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

import numpy as np
from scipy.linalg import expm

from overtake.controller.errors import ControllerError
from overtake.controller.policies import SpawnPolicy
from overtake.controller.stages import ClassifierSettings

__all__ = ["BadPhaseHeader", "Classifier"]

_GRID = 512  # attained-service grid points for hidden-mode lookups
_ROUTES_MAX = 4096  # learned-mode routes remembered (LRU)


class BadPhaseHeader(ControllerError):
    """The phase header is present but not an integer in 1..M (answered 400)."""


class _Route:
    __slots__ = ("samples", "loglik")

    def __init__(self, m: int) -> None:
        self.samples: deque[np.ndarray] = deque()
        self.loglik = np.zeros(m)


class Classifier:
    """Assigns start phases and re-estimates in-service phases for the current policy."""

    def __init__(self, settings: ClassifierSettings, policy: SpawnPolicy) -> None:
        self.settings = settings
        self.mode = settings.mode
        self.header = settings.header.lower().encode()
        self.bind(policy)

    def bind(self, policy: SpawnPolicy) -> None:
        """Adopt a (new) policy's phases and PH parameters; learned history is kept per phase count."""
        self.phases = policy.phases
        self.alpha = policy.alpha
        self.T = policy.T
        self.prior_phase = tuple(
            0 if self.alpha is None else int(np.argmax(self.alpha[i])) for i in range(len(self.phases))
        )
        self._routes: OrderedDict[str, _Route] = OrderedDict()
        self._grid: list[tuple[float, np.ndarray]] = []
        self.aware = any(m > 1 for m in self.phases) and self.alpha is not None
        if self.aware and self.mode == "hidden":
            self._grid = [self._current_phase_grid(i) for i in range(len(self.phases))]

    # ---- start phase ---------------------------------------------------------------------
    def start_phase(self, stage: int, route_key: str, header: bytes | None, route_phase: int | None) -> int:
        """Phase (0-based) a request joins its stage's queue with."""
        if not self.aware:
            return 0
        m = self.phases[stage]
        if self.mode == "explicit":
            if header is not None:
                try:
                    j = int(header)
                except ValueError:
                    j = 0
                if not 1 <= j <= m:
                    raise BadPhaseHeader(
                        f"{self.settings.header}: must be an integer phase in 1..{m} for stage "
                        f"{stage + 1}, got {header[:32]!r}"
                    )
                return j - 1
            if route_phase is not None and route_phase < m:
                return route_phase
            return self.prior_phase[stage]
        if self.mode == "learned":
            r = self._routes.get(route_key)
            if r is None or not r.samples:
                return self.prior_phase[stage]
            a = self.alpha[stage]  # type: ignore[index]
            with np.errstate(divide="ignore"):
                score = np.log(a) + r.loglik
            return int(np.argmax(score))
        return self.prior_phase[stage]

    # ---- learned ---------------------------------------------------------------------------
    def observe(self, stage: int, route_key: str, demand_seconds: float) -> None:
        """Record one completed request's service demand (learned mode only)."""
        if self.mode != "learned" or not self.aware:
            return
        t = demand_seconds / self.settings.time_unit
        T = self.T[stage]  # type: ignore[index]
        t0 = -T.sum(axis=1)
        with np.errstate(divide="ignore"):
            ll = np.log(np.maximum(expm(T * t) @ t0, 1e-300))
        r = self._routes.get(route_key)
        if r is None:
            r = self._routes[route_key] = _Route(T.shape[0])
            if len(self._routes) > _ROUTES_MAX:
                self._routes.popitem(last=False)
        else:
            self._routes.move_to_end(route_key)
        r.samples.append(ll)
        r.loglik += ll
        if len(r.samples) > self.settings.history:
            r.loglik -= r.samples.popleft()

    # ---- hidden ----------------------------------------------------------------------------
    def _current_phase_grid(self, stage: int) -> tuple[float, np.ndarray]:
        a = self.alpha[stage]  # type: ignore[index]
        T = self.T[stage]  # type: ignore[index]
        mean = float(a @ np.linalg.solve(-T, np.ones(T.shape[0])))
        step = 20.0 * mean / (_GRID - 1)
        P = expm(T * step)
        v = a.copy()
        out = np.empty(_GRID, dtype=np.int64)
        for g in range(_GRID):
            out[g] = int(np.argmax(v))
            v = v @ P
            s = v.sum()
            if s <= 0 or not math.isfinite(s):
                out[g:] = out[g - 1] if g else 0
                break
            v = v / s
        return step, out

    def current_phase(self, stage: int, start: int, attained_seconds: float) -> int:
        """Re-estimated phase of an in-service request (hidden mode), else ``start``."""
        if self.mode != "hidden" or not self.aware:
            return start
        step, table = self._grid[stage]
        g = int(attained_seconds / self.settings.time_unit / step)
        return int(table[min(g, _GRID - 1)])
