"""PhaseType: closed-form moments, densities against scipy, sampling, JSON, validation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats
from scipy.linalg import expm

from overtake.fitting import (
    InvalidParameterError,
    PhaseType,
    cf1,
    coxian,
    erlang,
    exponential,
    hyper_erlang,
    hyperexponential,
)

ALPHA = np.array([0.3, 0.7, 0.0])
T = np.array([[-2.0, 1.0, 0.5], [0.0, -3.0, 1.0], [0.2, 0.0, -0.5]])

FAMILIES = {
    "exponential": exponential(2.0),
    "erlang": erlang(3, 4.0),
    "hyperexponential": hyperexponential([0.2, 0.8], [0.5, 5.0]),
    "hyper_erlang": hyper_erlang([0.5, 0.5], [2, 3], [1.0, 10.0]),
    "coxian": coxian([3.0, 1.0, 0.3], [0.5, 0.4]),
    "cf1": cf1([0.1, 0.2, 0.7], [0.5, 2.0, 8.0]),
    "general": PhaseType(ALPHA, T),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_battery_cdf_plus_sf_is_one_and_pdf_matches_expm(name: str) -> None:
    ph = FAMILIES[name]
    x = np.array([0.0, 1e-6, 0.05, 0.7, 3.0, 12.0])
    assert np.allclose(ph.cdf(x) + ph.sf(x), 1.0, atol=1e-12)
    t = ph.exit_rates
    one = np.ones(ph.order)
    ref_pdf = np.array([ph.alpha @ expm(ph.T * v) @ t for v in x])
    ref_sf = np.array([ph.alpha @ expm(ph.T * v) @ one for v in x])
    assert np.allclose(ph.pdf(x), ref_pdf, rtol=1e-10, atol=1e-300)
    assert np.allclose(ph.sf(x), ref_sf, rtol=1e-10)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_battery_json_round_trip_is_exact(name: str) -> None:
    ph = FAMILIES[name]
    text = ph.to_json(loglik=-1.5, n=10)
    d = json.loads(text)
    assert d["alpha"] == list(ph.alpha) and d["T"] == [list(r) for r in ph.T]
    assert d["order"] == ph.order and d["structure"] == ph.structure and d["loglik"] == -1.5
    back = PhaseType.from_json(text)
    assert back == ph and back.structure == ph.structure


@pytest.mark.parametrize("name", list(FAMILIES))
def test_battery_ppf_inverts_cdf(name: str) -> None:
    ph = FAMILIES[name]
    u = np.array([1e-6, 0.01, 0.5, 0.9, 0.999])
    assert np.allclose(ph.cdf(ph.ppf(u)), u, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["erlang", "hyperexponential", "general", "cf1"])
def test_battery_rvs_mean_and_scv_within_sampling_error(name: str) -> None:
    ph = FAMILIES[name]
    x = ph.rvs(200_000, random_state=7)
    se = math.sqrt(ph.var() / x.size)
    assert abs(x.mean() - ph.mean()) < 5 * se
    # second moment: loose bound (heavy-ish tails)
    assert abs((x**2).mean() / ph.moment(2) - 1) < 0.05


def test_exponential_matches_scipy_expon() -> None:
    ph = exponential(2.5)
    d = stats.expon(scale=1 / 2.5)
    x = np.linspace(0, 5, 11)
    assert np.allclose(ph.pdf(x), d.pdf(x)) and np.allclose(ph.sf(x), d.sf(x))
    assert ph.mean() == pytest.approx(0.4) and ph.scv() == pytest.approx(1.0)


def test_erlang_matches_scipy_gamma_and_closed_form_moments() -> None:
    ph = erlang(4, 2.0)
    d = stats.gamma(a=4, scale=0.5)
    x = np.linspace(0.01, 10, 25)
    assert np.allclose(ph.pdf(x), d.pdf(x), rtol=1e-10)
    assert np.allclose(ph.cdf(x), d.cdf(x), rtol=1e-10)
    assert ph.mean() == pytest.approx(2.0) and ph.var() == pytest.approx(1.0) and ph.scv() == pytest.approx(0.25)
    assert ph.moment(3) == pytest.approx(4 * 5 * 6 / 8)


def test_sf_far_tail_is_computed_directly_not_as_one_minus_cdf() -> None:
    ph = exponential(1.0)
    assert ph.sf(50.0) == pytest.approx(math.exp(-50), rel=1e-9)
    assert ph.logsf(800.0) == pytest.approx(-800.0, rel=1e-12)  # exp(-800) underflows; log does not
    assert ph.logpdf(800.0) == pytest.approx(-800.0, rel=1e-12)


def test_cdf_is_relatively_accurate_near_zero() -> None:
    ph = exponential(3.0)
    assert ph.cdf(1e-12) == pytest.approx(3e-12, rel=1e-6)


def test_outside_support_and_nan() -> None:
    ph = exponential(1.0)
    assert ph.pdf(-1.0) == 0.0 and ph.cdf(-1.0) == 0.0 and ph.sf(-1.0) == 1.0
    assert np.isnan(ph.pdf(np.nan)) and ph.cdf(np.inf) == 1.0 and ph.sf(np.inf) == 0.0
    assert ph.ppf(0.0) == 0.0 and ph.ppf(1.0) == np.inf and np.isnan(ph.ppf(1.5))


def test_loglik_is_sum_of_logpdf_and_weights_multiply() -> None:
    ph = FAMILIES["general"]
    x = np.array([0.1, 0.5, 2.0])
    assert ph.loglik(x) == pytest.approx(float(np.log(ph.pdf(x)).sum()))
    assert ph.loglik(x, [2, 0, 1]) == pytest.approx(2 * math.log(ph.pdf(0.1)) + math.log(ph.pdf(2.0)))


def test_rvs_is_reproducible_and_does_not_touch_global_state() -> None:
    ph = FAMILIES["coxian"]
    np.random.seed(0)
    before = np.random.random()
    np.random.seed(0)
    a = ph.rvs(5, random_state=3)
    assert np.random.random() == before
    assert np.array_equal(a, ph.rvs(5, random_state=np.random.default_rng(3)))
    assert np.shape(ph.rvs(random_state=1)) == () and ph.rvs((2, 3), random_state=1).shape == (2, 3)


def test_atom_at_zero_from_subprobability_alpha() -> None:
    ph = PhaseType([0.6], [[-1.0]])
    assert ph.atom == pytest.approx(0.4)
    assert ph.cdf(0.0) == pytest.approx(0.4) and ph.mean() == pytest.approx(0.6)


def test_immutable() -> None:
    ph = exponential(1.0)
    with pytest.raises(AttributeError):
        ph.foo = 1  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        ph.T[0, 0] = -2.0


@pytest.mark.parametrize(
    ("alpha", "T", "match"),
    [
        ([0.5, 0.5], [[-1.0, 0.0], [0.0, 0.0]], r"T\[1,1\] must be < 0, got 0.0"),
        ([0.5, 0.5], [[-1.0, -0.1], [0.0, -1.0]], r"T\[0,1\] must be >= 0"),
        ([0.5, 0.6], [[-1.0, 0.0], [0.0, -1.0]], r"sum\(alpha\) must be <= 1"),
        ([-0.1, 1.0], [[-1.0, 0.0], [0.0, -1.0]], r"alpha\[0\] must be >= 0"),
        ([1.0], [[-1.0, 0.0]], r"T must have shape \(1, 1\)"),
        ([1.0, 0.0], [[-1.0, 2.0], [0.0, -1.0]], r"row 0 of T must sum to <= 0"),
        ([1.0, 0.0], [[-1.0, 1.0], [1.0, -1.0]], r"cannot reach absorption"),
        ([np.nan], [[-1.0]], r"alpha\[0\] must be finite"),
        ([], [], r"non-empty"),
    ],
)
def test_invalid_parameters_name_the_entry(alpha, T, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidParameterError, match=match):
        PhaseType(alpha, T)


def test_invalid_parameter_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        exponential(-1.0)
    with pytest.raises(InvalidParameterError, match=r"rates must be ascending"):
        cf1([0.5, 0.5], [2.0, 1.0])


def test_from_json_rejects_missing_keys() -> None:
    with pytest.raises(InvalidParameterError, match="'alpha' and 'T'"):
        PhaseType.from_json('{"alpha": [1.0]}')
    with pytest.raises(InvalidParameterError, match="not valid JSON"):
        PhaseType.from_json("{")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_by_mean_relabels_phases_without_changing_the_distribution(name: str) -> None:
    ph = FAMILIES[name]
    ordered = ph.by_mean()
    means = ordered.phase_means()
    assert np.all(np.diff(means) >= 0)  # phase 1 the shortest expected time to absorption
    assert sorted(means.tolist()) == pytest.approx(sorted(ph.phase_means().tolist()), rel=1e-12)
    x = np.linspace(0.0, 4.0 * ph.mean(), 41)
    assert ordered.pdf(x) == pytest.approx(ph.pdf(x), rel=1e-9, abs=1e-300)
    assert ordered.cdf(x) == pytest.approx(ph.cdf(x), rel=1e-9, abs=1e-15)
    for k in (1, 2, 3):
        assert ordered.moment(k) == pytest.approx(ph.moment(k), rel=1e-10)
    assert ordered.structure == ph.structure and ordered.atom == pytest.approx(ph.atom)
    with pytest.raises(ValueError):
        ordered.alpha[0] = 0.5  # still frozen


def test_by_mean_reverses_a_cf1_chain() -> None:
    # CF1 runs from its slowest phase to its fastest, all exits at the last: phase 1 is the longest
    ph = cf1([0.6, 0.3, 0.1], [1.0, 4.0, 10.0])
    assert np.argmax(ph.phase_means()) == 0
    ordered = ph.by_mean()
    assert ordered.alpha.tolist() == pytest.approx([0.1, 0.3, 0.6])
    assert ordered.phase_means() == pytest.approx([0.1, 0.1 + 0.25, 0.1 + 0.25 + 1.0])
    assert ordered.by_mean() is ordered  # already in order: nothing to do
