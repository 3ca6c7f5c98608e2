"""Paired fits with floors and with orders by BIC: known floors, orders and routings recovered."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.fitting.coupled import CoupledPH, exit_law, fit_coupled
from overtake.fitting.coupled_shifted import fit_coupled_shifted, floor_last
from overtake.fitting.errors import FittingInputError
from overtake.fitting.phase_type import PhaseType
from overtake.fitting.shifted import shifted_ph

ROUTING = np.array([[0.9, 0.1], [0.4, 0.6]])
BODIES = CoupledPH.build(PhaseType([0.8, 0.2], np.diag([-1 / 0.01, -1 / 0.08])), np.diag([-1 / 0.015, -1 / 0.12]),
                         ROUTING)
FLOORS = (0.02, 0.03)


def test_the_floor_after_the_body_is_the_same_law() -> None:
    body = BODIES.second
    front, back = shifted_ph(0.03, 3, body), floor_last(0.03, 3, body)
    t = np.linspace(0.001, 0.5, 50)
    assert back.cdf(t) == pytest.approx(front.cdf(t), abs=1e-10)
    assert back.mean() == pytest.approx(0.03 + body.mean(), rel=1e-12)
    assert back.alpha[: body.order] == pytest.approx(body.alpha)  # the routing chooses the body's start


def test_floors_orders_and_the_routing_are_recovered() -> None:
    x, y = BODIES.rvs(4000, random_state=1)
    fit = fit_coupled_shifted(x + FLOORS[0], y + FLOORS[1], max_phases=3, order="auto", max_order=2,
                              structure="hyperexp", random_state=0)
    assert [f.shift for f in fit.floors] == pytest.approx(FLOORS, abs=0.001)
    assert [f.body.ph.order for f in fit.floors] == [2, 2]  # hyperexp bodies of two sizes
    assert [f.erlang_phases for f in fit.floors] == [1, 1]  # what the 3 phases leave
    assert fit.bodies.model.routing == pytest.approx(ROUTING, abs=0.06)
    assert fit.bodies.model.correlation() == pytest.approx(BODIES.correlation(), abs=0.05)
    model = fit.model
    assert model.second.alpha == pytest.approx(exit_law(model.first) @ model.routing)
    # the floors are constants in the data and Erlangs in the model: the covariance is the bodies'
    cov = lambda m: m.correlation() * m.first.std() * m.second.std()  # noqa: E731
    assert cov(model) == pytest.approx(cov(fit.bodies.model), rel=1e-9)
    for got, floor, ph in zip(model.means(), FLOORS, (BODIES.first, BODIES.second)):
        assert abs(got - floor - ph.mean()) < 4 * ph.std() / np.sqrt(x.size)


def test_order_auto_picks_each_stage_by_bic_within_the_budget() -> None:
    first = PhaseType([0.6, 0.3, 0.1], np.diag([-1 / 0.01, -1 / 0.1, -1.0]))
    true = CoupledPH.build(first, np.diag([-1 / 0.02, -1 / 0.5]), np.array([[0.9, 0.1], [0.5, 0.5], [0.1, 0.9]]))
    x, y = true.rvs(5000, random_state=2)
    fit = fit_coupled(x, y, structure="hyperexp", order="auto", max_order=3, random_state=0)
    assert (fit.model.first.order, fit.model.second.order) == (3, 2)
    assert fit.model.correlation() == pytest.approx(true.correlation(), abs=0.05)
    capped = fit_coupled(x, y, structure="hyperexp", order="auto", max_order=2, random_state=0)
    assert capped.model.first.order == 2  # the budget binds: BIC alone would take 3
    assert capped.marginals is not None
    assert min(capped.marginals[0].selection, key=lambda r: r.bic).order == 3


def test_a_shift_at_or_above_the_smallest_duration_is_refused() -> None:
    x, y = BODIES.rvs(200, random_state=3)
    with pytest.raises(FittingInputError, match="shift: .* is not below the smallest duration"):
        fit_coupled_shifted(x, y, shift=float(x.max()), max_phases=3, order=1)
