"""Phase classification: which PH phase a request is in (van der Weij et al., "Dynamic thread assignment", §2: the state counts
requests per (stage, phase) coordinate), or which route class for a ``route`` policy.

A policy's *labels* are what its queues are keyed by: the phases of a ``full``/``start`` policy,
the route classes of a ``route`` policy (each with its own prior over start phases),
one label per stage for ``none`` policies and baselines (nothing to classify). Three modes
(stages file ``classifier.mode``):

* ``explicit`` — a request header (default ``X-Overtake-Phase: <1..M>``, or the phase's name,
  ``short``/``long`` for two phases: :mod:`overtake.phases`) or the matching route's ``phase``
  gives the start label; the phase is kept while in service (exact for hyperexponential stages,
  whose phases do not move). In every mode a header that names no phase of the stage's model is
  answered 400 (under a baseline: the phases of the last solved policy, else any of the
  :data:`~overtake.phases.MAX_PHASES` a model could have).
* ``learned`` — per route (method + path) a window of observed service demands t_1..t_n; the
  start label is argmax_l  log w_l + Σ_k log f_l(t_k), with f_l(t) = a_l exp(T t) t⁰ the PH
  density started from label l's prior a_l over phases (e_j for phase j; the route class's α_r for
  a ``route`` policy, whose classes are so learned from history rather than one phase per route)
  and w_l the label's weight (α_j, or the class's share p_r). Demands come from Apache's
  ``X-Stage-CPU-us`` answer header when present (the stage handler's thread CPU), else the
  sojourn in Apache.
* ``hidden`` — waiting requests take the most likely label argmax w; for a phase policy,
  in-service requests are re-estimated from their attained service a (∫ share dt, share = 1/K
  under PS) as the most likely *current* phase, argmax_j (α exp(T a))_j. A ``none`` policy needs
  neither: it was solved for exactly this information (mdp.observation).

``auto`` (:mod:`overtake.controller.sidecar.auto`) picks the policy and one of these modes from what the
traffic shows.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import numpy as np
from scipy.linalg import expm

from overtake.controller.errors import ControllerError
from overtake.controller.sidecar.policies import SpawnPolicy
from overtake.controller.sidecar.stages import ClassifierSettings
from overtake.phases import MAX_PHASES, TWO_PHASE_NAMES, accepted_values, parse_phase

if TYPE_CHECKING:
    from overtake.controller.sidecar.auto import Evidence

__all__ = ["BadPhaseHeader", "Classifier"]

_GRID = 512  # attained-service grid points for hidden-mode lookups
_ROUTES_MAX = 4096  # learned-mode routes remembered (LRU)


class BadPhaseHeader(ControllerError):
    """The phase header is present but names no phase of the stage (answered 400)."""


class _Route:
    """A route's recent demands (model time units) and, for the bound policy, their log-likelihood
    under each label (recomputed after a swap: the history outlives the policy)."""

    __slots__ = ("samples", "ll", "loglik", "version")

    def __init__(self) -> None:
        self.samples: deque[float] = deque()
        self.ll: deque[np.ndarray] = deque()
        self.loglik = np.zeros(0)
        self.version = -1


class Classifier:
    """Assigns start phases and re-estimates in-service phases for the current policy."""

    def __init__(self, settings: ClassifierSettings, policy: SpawnPolicy) -> None:
        self.settings = settings
        self.mode: str = settings.mode
        #: seconds per model time unit (controller.sidecar.units; the sidecar sets the one in force)
        self.time_unit: float = settings.time_unit if settings.time_unit is not None else 1.0
        self.header = settings.header.lower().encode()
        self._routes: OrderedDict[str, _Route] = OrderedDict()
        self._version = 0
        #: set by ``auto`` (controller.sidecar.auto.Evidence): told of every phase header and demand
        self.evidence: Evidence | None = None
        self.bind(policy)

    @property
    def collects(self) -> bool:
        """Demands are recorded (learned mode, or auto, which may switch to it)."""
        return self.mode == "learned" or self.evidence is not None

    def bind(self, policy: SpawnPolicy) -> None:
        """Adopt a (new) policy's labels and PH parameters; learned history is kept per label count."""
        named = getattr(policy, "model_phases", None)
        if named is not None:
            self.header_names: tuple[tuple[str, ...] | None, ...] = named
        elif len(getattr(self, "header_names", ())) != len(policy.phases):
            # a baseline has no model: the phases of the last solved policy stand (a fallback to
            # pi(k) keeps its clients' headers valid); before any, any phase a model could have
            # (clients may send them ahead of the first solved policy, e.g. for the online loop)
            self.header_names = (None,) * len(policy.phases)
        self.phases = policy.phases
        self.alpha = policy.alpha
        self.T = policy.T
        self.labels = policy.labels
        self.prior_phase = tuple(
            0 if self.labels is None else int(np.argmax(self.labels[i][1])) for i in range(len(self.phases))
        )
        self._version += 1  # every route's likelihoods are recomputed under the new labels
        self._grid: list[tuple[float, np.ndarray]] = []
        self.aware = any(m > 1 for m in self.phases) and self.labels is not None and self.T is not None
        #: in-service requests move between phases (hidden mode, a policy that counts threads per phase)
        self.reestimates = self.aware and self.mode == "hidden" and not policy.threads_per_stage
        if self.reestimates:
            self._grid = [self._current_phase_grid(i) for i in range(len(self.phases))]

    # ---- start phase ---------------------------------------------------------------------
    def header_phase(self, stage: int, header: bytes) -> int:
        """The 0-based phase a phase header names (:func:`overtake.phases.parse_phase`: ``1..M``
        or a name such as ``short``), checked against the stage's model phases in every mode.

        Raises
        ------
        BadPhaseHeader
            The value names no phase (answered 400, naming the header and the accepted values).
        """
        known = self.header_names[stage] if stage < len(self.header_names) else None
        m, names = (len(known), known) if known is not None else (MAX_PHASES, TWO_PHASE_NAMES)
        j = parse_phase(header, m, names)
        if j is None or (self.aware and self.mode == "explicit" and j >= self.phases[stage]):
            raise BadPhaseHeader(
                f"{self.settings.header}: must name a phase of stage {stage + 1}: "
                f"{accepted_values(m, names)}; got {header[:32].decode('latin-1')!r}"
            )
        return j

    def start_phase(self, stage: int, route_key: str, header: bytes | None, route_phase: int | None, *,
                    observe: bool = True) -> int:
        """Phase (0-based) a request joins its stage's queue with. ``observe`` False: a peek at
        the follow-up request (``X-Overtake-Next-Phase``), not a request: auto's evidence is the
        requests' own phase headers."""
        j = None if header is None else self.header_phase(stage, header)
        if self.evidence is not None and observe:
            self.evidence.request(j is not None)
        if not self.aware:
            return 0
        m = self.phases[stage]
        if self.mode == "explicit":
            if j is not None:
                return j
            if route_phase is not None and route_phase < m:
                return route_phase
            return self.prior_phase[stage]
        if self.mode == "learned":
            r = self._routes.get(route_key)
            if r is None or not r.samples:
                return self.prior_phase[stage]
            if r.version != self._version:
                self._relabel(stage, r)
            w = self.labels[stage][1]  # type: ignore[index]
            with np.errstate(divide="ignore"):
                score = np.log(w) + r.loglik
            return int(np.argmax(score))
        return self.prior_phase[stage]

    # ---- learned ---------------------------------------------------------------------------
    def observe(self, stage: int, route_key: str, demand_seconds: float) -> None:
        """Record one completed request's service demand (learned mode, auto)."""
        if not self.collects:
            return
        if self.evidence is not None:
            self.evidence.demand(route_key)
        t = demand_seconds / self.time_unit
        r = self._routes.get(route_key)
        if r is None:
            r = self._routes[route_key] = _Route()
            if len(self._routes) > _ROUTES_MAX:
                self._routes.popitem(last=False)
        else:
            self._routes.move_to_end(route_key)
        r.samples.append(t)
        if len(r.samples) > self.settings.history:
            r.samples.popleft()
        if self.aware and r.version == self._version:
            ll = self._loglik(stage, t)
            r.ll.append(ll)
            r.loglik = r.loglik + ll
            if len(r.ll) > len(r.samples):
                r.loglik = r.loglik - r.ll.popleft()
        else:
            r.version = -1  # recomputed from the samples when a learned lookup needs it

    def set_time_unit(self, seconds: float) -> None:
        """Run at a new time unit: the learned demands are rescaled (they are kept in model units)
        and their likelihoods recomputed."""
        if seconds == self.time_unit:
            return
        f = self.time_unit / seconds
        for r in self._routes.values():
            r.samples = deque(t * f for t in r.samples)
            r.ll.clear()
            r.version = -1
        self.time_unit = seconds

    def _loglik(self, stage: int, t: float) -> np.ndarray:
        """log f_l(t) per label l: the PH density of demand t started from label l's prior."""
        T = self.T[stage]  # type: ignore[index]
        prior = self.labels[stage][0]  # type: ignore[index]
        f = np.maximum(prior @ (expm(T * t) @ -T.sum(axis=1)), 1e-300)
        out: np.ndarray = np.log(f)
        return out

    def _relabel(self, stage: int, r: _Route) -> None:
        r.ll = deque(self._loglik(stage, t) for t in r.samples)
        r.loglik = np.sum(list(r.ll), axis=0) if r.ll else np.zeros(len(self.labels[stage][1]))  # type: ignore[index]
        r.version = self._version

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
        """Re-estimated phase of an in-service request (hidden mode, phase policies), else ``start``."""
        if not self.reestimates:
            return start
        step, table = self._grid[stage]
        g = int(attained_seconds / self.time_unit / step)
        return int(table[min(g, _GRID - 1)])
