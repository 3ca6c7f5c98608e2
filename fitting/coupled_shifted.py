"""Coupled fits with service floors: each stage a constant plus a PH body, the routing between the bodies.

A transaction's two stages each have a floor (:mod:`overtake.fitting.shifted`) and correlate
through their bodies (:mod:`overtake.fitting.coupled`): a big article is slow to preview and to view
above the floors both pay. The floors are constants, so they carry no correlation; the routing is
fitted between the bodies on the durations minus the floors.

The solver gets each floor as an Erlang, and the routing must reach stage 2's body: a request
leaves stage 1 from a body phase (stage 1 is floor then body, as :func:`~overtake.fitting.shifted.shifted_ph`
builds it) and must start stage 2 in the body phase the routing picks, so stage 2 is body *then*
floor. A sum of independent parts has the same law in either order, so stage 2's distribution is
the shifted one; only its phase labels differ (and its exit is the floor's last phase, which no
later routing needs: a paired fit has two stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .coupled import CoupledFit, CoupledPH, _check_pairs, exit_law, fit_routing
from .data import samples
from .errors import DataError
from .phase_type import PhaseType
from .shifted import ShiftedFit, fit_shifted, shifted_ph

__all__ = ["CoupledShiftedFit", "fit_coupled_shifted", "floor_last"]


def floor_last(shift: float, erlang_phases: int, body: PhaseType) -> PhaseType:
    """``body`` then Erlang(``erlang_phases``, mean ``shift``): the law of :func:`shifted_ph`, the
    body's phases first (phases ``0..p-1``), so a routing can choose where the body starts."""
    shifted_ph(shift, erlang_phases, body)  # its checks of shift and erlang_phases, its messages
    k, p = int(erlang_phases), body.order
    rate = k / shift
    T = np.zeros((p + k, p + k))
    T[:p, :p] = body.T
    T[:p, p] = body.exit_rates  # the body ends: the floor starts
    for i in range(k):
        T[p + i, p + i] = -rate
        if i + 1 < k:
            T[p + i, p + i + 1] = rate
    alpha = np.zeros(p + k)
    alpha[:p] = body.alpha
    alpha[p] = body.atom  # a body atom at zero: straight to the floor
    return PhaseType(alpha, T, structure="shifted")


@dataclass(frozen=True)
class CoupledShiftedFit:
    """Both stages' floors and bodies, the routing between the bodies, and the solver's model."""

    floors: tuple[ShiftedFit, ShiftedFit]
    bodies: CoupledFit  #: the routing fit between the bodies (on the durations minus the floors)
    model: CoupledPH  #: stage 1 floor then body, stage 2 body then floor, routed body to body

    def to_dict(self) -> dict[str, Any]:
        return self.model.to_dict(shifts=[f.meta() for f in self.floors], loglik_bodies=self.bodies.loglik,
                                  loglik_bodies_independent=self.bodies.loglik_independent,
                                  correlation=self.model.correlation(),
                                  sample_correlation=self.bodies.sample_correlation)


def couple_floors(first: ShiftedFit, second: ShiftedFit, routing: npt.ArrayLike) -> CoupledPH:
    """The coupled PH of the solver: stage 1 ``first.ph``, stage 2 body then floor, ``routing``
    (body-1 exit phase x body-2 start phase) on the bodies' phases."""
    R = np.asarray(routing, dtype=float)
    b1, b2 = first.body.ph, second.body.ph
    if R.shape != (b1.order, b2.order):
        raise DataError(f"routing: must be {b1.order}x{b2.order} (the bodies' phases), got shape {R.shape}")
    k1 = first.erlang_phases
    stage2 = floor_last(second.shift, second.erlang_phases, b2)
    full = np.zeros((first.ph.order, stage2.order))
    full[k1:, : b2.order] = R
    # the floor's phases never end stage 1 (exit probability 0): any law will do, the implied one
    full[:k1, : b2.order] = exit_law(b1) @ R
    return CoupledPH.build(first.ph, stage2.T, full)


def fit_coupled_shifted(x: npt.ArrayLike, y: npt.ArrayLike, *, shift: float | str = "auto",
                        max_phases: int, order: int | str = 2, max_order: int | None = None,
                        **fit_kw: Any) -> CoupledShiftedFit:
    """Each stage's floor and body (:func:`~overtake.fitting.shifted.fit_shifted`, at most
    ``max_phases`` phases a stage, the floor what the body leaves), then the routing between the
    bodies (:func:`~overtake.fitting.coupled.fit_routing`). ``shift``: seconds or ``"auto"`` for
    both stages; ``fit_kw`` go to the bodies' fits."""
    xa, ya = _check_pairs(x, y)
    floors = tuple(fit_shifted(samples(v), shift=shift, erlang_phases=None, max_phases=max_phases, order=order,
                               max_order=max_order, **fit_kw) for v in (xa, ya))
    f1, f2 = floors
    if f1.body.ph.atom > 1e-9 or f2.body.ph.atom > 1e-9:
        raise DataError("coupled fit: a stage's body has an atom at zero; give a lower shift")
    bodies = fit_routing(f1.body.ph, f2.body.ph, xa - f1.shift, ya - f2.shift)
    return CoupledShiftedFit((f1, f2), bodies, couple_floors(f1, f2, bodies.model.routing))
