"""Coupled PH fits of paired (stage 1, stage 2) durations: known models recovered, independence found."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.fitting.coupled import CoupledPH, exit_law, fit_coupled, fit_routing
from overtake.fitting.errors import DataError
from overtake.fitting.phase_type import PhaseType

A = np.array([0.8, 0.2])
FIRST = PhaseType(A, np.diag([-2.0, -1.0 / 3.0]))
SECOND_T = np.diag([-1.0 / 0.6, -1.0 / 3.5])
ROUTING = np.array([[0.9, 0.1], [0.4, 0.6]])  # keeps π₁R = (0.8, 0.2): a big preview is likely a big view
TRUE = CoupledPH.build(FIRST, SECOND_T, ROUTING)


def test_the_correlation_and_means_match_a_large_sample() -> None:
    """The closed forms against 200,000 transactions drawn path by path."""
    x, y = TRUE.rvs(200_000, random_state=1)
    assert TRUE.second.alpha == pytest.approx([0.8, 0.2])
    assert TRUE.correlation() == pytest.approx(np.corrcoef(x, y)[0, 1], abs=0.01)
    for s, m, ph in ((x, TRUE.means()[0], TRUE.first), (y, TRUE.means()[1], TRUE.second)):
        assert abs(s.mean() - m) < 4 * ph.std() / np.sqrt(s.size)
    identity = CoupledPH.build(FIRST, SECOND_T, np.eye(2))
    independent = CoupledPH.build(FIRST, SECOND_T, np.tile(A, (2, 1)))
    assert independent.correlation() == pytest.approx(0.0, abs=1e-12)
    assert identity.correlation() > TRUE.correlation() > 0.1


def test_a_coupled_sample_gives_back_its_correlation_and_means() -> None:
    x, y = TRUE.rvs(5_000, random_state=2)
    fit = fit_coupled(x, y, random_state=0)
    assert fit.converged and fit.loglik > fit.loglik_independent + 20  # the routing explains real dependence
    assert fit.model.correlation() == pytest.approx(TRUE.correlation(), abs=0.05)
    assert fit.model.correlation() == pytest.approx(fit.sample_correlation, abs=0.03)
    for got, want, ph in zip(fit.model.means(), TRUE.means(), (TRUE.first, TRUE.second)):
        assert abs(got - want) < 4 * ph.std() / np.sqrt(x.size)
    # stage 2's start law is the one the routing implies
    assert fit.model.second.alpha == pytest.approx(exit_law(fit.model.first) @ fit.model.routing)


def test_the_routing_em_recovers_the_routing_given_the_stages() -> None:
    x, y = TRUE.rvs(20_000, random_state=3)
    fit = fit_routing(TRUE.first, TRUE.second, x, y)
    assert fit.model.routing == pytest.approx(ROUTING, abs=0.06)


def test_independent_samples_give_an_independent_routing() -> None:
    rng = np.random.default_rng(4)
    x = FIRST.rvs(5_000, random_state=rng)
    y = PhaseType(A, SECOND_T).rvs(5_000, random_state=rng)
    fit = fit_coupled(x, y, random_state=0)
    assert np.abs(fit.model.routing - fit.model.second.alpha[None, :]).max() < 0.12
    assert abs(fit.model.correlation()) < 0.04
    # a likelihood-ratio of a 2-parameter extension on independent data: small
    assert 0 <= fit.loglik - fit.loglik_independent < 10


def test_bad_pairs_are_refused() -> None:
    with pytest.raises(DataError, match="one pair per transaction"):
        fit_coupled(np.ones(20), np.ones(19))
    with pytest.raises(DataError, match="stage 2 durations must be finite and > 0"):
        fit_coupled(np.ones(20), np.r_[np.ones(19), -1.0])
    with pytest.raises(DataError, match="routing: must be 2x2"):
        CoupledPH.build(FIRST, SECOND_T, np.eye(3))
