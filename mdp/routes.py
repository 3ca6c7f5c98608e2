"""Route classes: a stage's requests split into observable classes with their own start-phase priors.

A real sidecar sees each request's route (method and path) but not its phase. History per route
gives a prior over the phase a request of that route starts in. A stage ``i`` with PH(α_i, T_i)
service then has route classes r = 1..R_i, each entered with probability ``weight`` p_ir and
starting in phase j with probability α_ir[j], so that

    Σ_r p_ir α_ir = α_i                                           (the stage's own prior)

and T_i is shared (the route changes where service starts, not how it proceeds). Routes are drawn
independently at each stage entry (the class of a request at stage i + 1 does not depend on its
class at stage i).

The exact chain for policies that see routes but not phases (:meth:`RouteSplit.layout`) has one
waiting queue per (stage, route): a waiting request receives no service, so drawing its phase from
α_ir when its thread starts is equal in law to drawing it on arrival. Active threads are kept per
(stage, phase) coordinate, as in every layout: once started, a thread's route no longer changes
its dynamics, and the observation (:mod:`overtake.mdp.observation`) counts active threads per
stage. Seeing active threads per route as well would need the chain to keep active threads per
(stage, route, phase), R_i times the coordinates: too large for Table 1 with three
routes per stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import ModelError
from .model import TandemModel
from .statespace import Layout

__all__ = ["Route", "RouteSplit"]

FloatArray = npt.NDArray[np.float64]

_TOL = 1e-6


@dataclass(frozen=True, eq=False)
class Route:
    """One route class of a stage: its entry probability and its prior over start phases."""

    name: str
    weight: float
    alpha: FloatArray

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Route) and self.name == other.name and self.weight == other.weight
                and np.array_equal(self.alpha, other.alpha))

    def __hash__(self) -> int:
        return hash((self.name, self.weight, np.asarray(self.alpha).tobytes()))


@dataclass(frozen=True)
class RouteSplit:
    """Route classes per stage (``stages[i]`` lists stage i's routes, at least one each)."""

    stages: tuple[tuple[Route, ...], ...]

    # ---- construction ----------------------------------------------------------------------
    @staticmethod
    def single(model: TandemModel) -> RouteSplit:
        """One route per stage with the stage's own α: the ``none`` observation."""
        return RouteSplit(tuple((Route(st.name, 1.0, np.array(st.alpha, dtype=float)),) for st in model.stages))

    @staticmethod
    def build(model: TandemModel, routes: Sequence[Sequence[tuple[str, float, npt.ArrayLike]] | None]) -> RouteSplit:
        """Validate (name, weight, alpha) triples per stage (``None``: the stage's single route).

        Raises :class:`ModelError` naming ``stages.<i>.routes`` when weights are not a
        distribution, an α is not a distribution over the stage's phases, or the routes' mixture
        Σ_r p_r α_r differs from the stage's α by more than 1e-6.
        """
        if len(routes) != model.n_stages:
            raise ModelError(f"routes: give one entry per stage ({model.n_stages}), got {len(routes)}")
        out: list[tuple[Route, ...]] = []
        for i, (st, rs) in enumerate(zip(model.stages, routes)):
            where = f"stages.{i}.routes"
            if rs is None:
                out.append((Route(st.name, 1.0, np.array(st.alpha, dtype=float)),))
                continue
            if len(rs) == 0:
                raise ModelError(f"{where}: list at least one route, or leave routes out")
            names = [str(n) for n, _, _ in rs]
            if len(set(names)) != len(names):
                raise ModelError(f"{where}: route names must be unique, got {names}")
            w = np.array([float(x) for _, x, _ in rs])
            if np.any(~np.isfinite(w)) or np.any(w <= 0) or abs(w.sum() - 1.0) > _TOL:
                raise ModelError(f"{where}: weights must be > 0 and sum to 1, got {w.tolist()}")
            alphas = []
            for r, (_, _, a) in enumerate(rs):
                av = np.asarray(a, dtype=float)
                if av.shape != (st.phases,) or np.any(~np.isfinite(av)) or np.any(av < 0) or abs(av.sum() - 1) > _TOL:
                    raise ModelError(f"{where}.{r}.alpha: must be {st.phases} probabilities summing to 1 "
                                     f"(the stage's phases), got {list(np.atleast_1d(av))}")
                alphas.append(av)
            mix = sum(wr * ar for wr, ar in zip(w, alphas))
            if np.max(np.abs(mix - st.alpha)) > _TOL:
                raise ModelError(
                    f"{where}: the routes' mixture sum(weight * alpha) = {np.round(mix, 6).tolist()} must equal the "
                    f"stage's alpha {np.round(st.alpha, 6).tolist()} (within 1e-6); fix the weights or the alphas")
            out.append(tuple(Route(n, float(x), a) for (n, x, _), a in zip(rs, alphas)))
        return RouteSplit(tuple(out))

    # ---- queries ---------------------------------------------------------------------------
    @property
    def n_queues(self) -> int:
        return sum(len(rs) for rs in self.stages)

    @property
    def trivial(self) -> bool:
        """True when every stage has one route (the split adds no information)."""
        return all(len(rs) == 1 for rs in self.stages)

    def queue_labels(self, model: TandemModel) -> list[str]:
        """One label per waiting queue: the stage's name, then ``/route`` when the stage has several."""
        return [st.name if len(rs) == 1 else f"{st.name}/{r.name}"
                for st, rs in zip(model.stages, self.stages) for r in rs]

    def layout(self, model: TandemModel, phase_info: str = "route") -> Layout:
        """The exact chain's layout: one queue per (stage, route), phase drawn from α_ir at spawn."""
        self.check(model)
        qs: list[int] = []
        entry: list[tuple[tuple[int, float], ...]] = []
        spawn: list[tuple[tuple[int, float], ...]] = []
        for i, rs in enumerate(self.stages):
            first = len(qs)
            entry.append(tuple((first + r, route.weight) for r, route in enumerate(rs)))
            for route in rs:
                qs.append(i)
                spawn.append(tuple((model.coord(i, j), float(p)) for j, p in enumerate(route.alpha) if p > 0))
        return Layout(phase_info, np.asarray(qs, dtype=np.int64), tuple(entry), tuple(spawn))  # type: ignore[arg-type]

    def check(self, model: TandemModel) -> None:
        """Raise :class:`ModelError` when the split does not fit ``model`` (re-runs :meth:`build`)."""
        RouteSplit.build(model, [[(r.name, r.weight, r.alpha) for r in rs] for rs in self.stages])

    # ---- files -----------------------------------------------------------------------------
    def to_dict(self) -> list[list[dict[str, Any]]]:
        return [[{"name": r.name, "weight": r.weight, "alpha": np.asarray(r.alpha).tolist()} for r in rs]
                for rs in self.stages]

    @staticmethod
    def from_dict(model: TandemModel, data: Sequence[Sequence[dict[str, Any]]]) -> RouteSplit:
        return RouteSplit.build(model, [[(d["name"], d["weight"], d["alpha"]) for d in rs] for rs in data])
