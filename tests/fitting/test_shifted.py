"""Shifted fits (fitting/shifted.py): a floor as a constant, handed on as an Erlang before the PH."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.fitting import FittingInputError, erlang, exponential, fit_observations, samples
from overtake.fitting.shifted import estimate_shift, fit_shifted, shifted_ph


def _floor_sample(n: int = 3000, seed: int = 7) -> np.ndarray:
    return 0.02 + np.random.default_rng(seed).exponential(0.03, n)


def test_known_floor_is_recovered_with_one_body_phase() -> None:
    obs = samples(_floor_sample())
    sf = fit_shifted(obs, shift="auto", erlang_phases=2, structure="cf1", order="auto", max_order=3)
    assert sf.shift == pytest.approx(0.02, abs=0.001)
    assert sf.body.ph.order == 1  # the rest is exponential: BIC wants nothing more
    assert sf.ph.mean() == pytest.approx(0.05, rel=0.05)
    assert sf.ph.order == 3
    # the PhaseType's mean is the floor plus the body's, to rounding
    assert sf.ph.mean() == pytest.approx(sf.shift + sf.body.ph.mean(), rel=1e-12)


def test_the_erlang_floor_approaches_the_constant_as_phases_grow() -> None:
    obs = samples(_floor_sample())
    fits = [fit_shifted(obs, shift=0.02, erlang_phases=k, structure="cf1", order=1) for k in (1, 2, 4, 8)]
    model = [f.loglik_model for f in fits]
    assert model == sorted(model) and model[-1] < fits[-1].loglik
    # with the constant, the floor beats a plain fit with as many phases as the body and the floor's
    # Erlang together; as modelled, a plain CF1 of that order contains Erlang + exponential
    plain = fit_observations(obs, structure="cf1", order=fits[1].ph.order)
    assert fits[1].loglik > plain.loglik >= fits[1].loglik_model - 1e-6 * abs(plain.loglik)


def test_series_composition_is_exact() -> None:
    body = erlang(2, 10.0)
    ph = shifted_ph(0.03, 3, body)
    assert ph.order == 5 and ph.alpha[0] == 1.0
    assert ph.mean() == pytest.approx(0.03 + body.mean(), rel=1e-13)
    # the floor's Erlang adds its variance c²/k to the body's
    assert ph.var() == pytest.approx(0.03**2 / 3 + body.var(), rel=1e-12)
    assert shifted_ph(0.03, 1, exponential(1.0)).mean() == pytest.approx(1.03, rel=1e-13)


def test_floor_estimate_sits_just_below_the_minimum() -> None:
    x = _floor_sample()
    s = estimate_shift(samples(x))
    assert 0.0199 < s < x.min()


def test_bad_input_names_the_field() -> None:
    obs = samples(_floor_sample(200))
    with pytest.raises(FittingInputError, match="not below the smallest duration"):
        fit_shifted(obs, shift=1.0, order=1)
    with pytest.raises(FittingInputError, match="shift must be 'auto'"):
        fit_shifted(obs, shift="floor", order=1)
    with pytest.raises(FittingInputError, match="shift must be > 0"):
        shifted_ph(0.0, 2, exponential(1.0))
