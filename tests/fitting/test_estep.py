"""The numba uniformization E-step equals the pure-numpy Van Loan reference."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.fitting import PhaseType, binned, samples
from overtake.fitting._estep import Sparse, estep, estep_reference, squaring_from
from overtake.fitting.phase_type import _sparse

ALPHA = np.array([0.3, 0.7, 0.0])
T = np.array([[-2.0, 1.0, 0.5], [0.0, -3.0, 1.0], [0.2, 0.0, -0.5]])
PH = PhaseType(ALPHA, T)
X = PH.rvs(25, random_state=2)
CENS = np.arange(25) % 4 == 0

CASES = {
    "exact": samples(X),
    "weighted+censored": samples(X, weights=np.arange(25) % 3 + 0.5, censored=CENS),
    "binned, open last bin": binned([0, 0.2, 0.5, 1, 2, 5, np.inf], [3, 5, 7, 6, 4, 2]),
    "binned, from 0.1": binned([0.1, 0.2, 0.5, 1, 2, 5], [3, 5, 7, 6, 4]),
    "long gaps (grid refinement)": samples(np.array([0.5, 300.0, 900.0])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_estep_matches_reference(name: str) -> None:
    obs = CASES[name]
    d, src, dst, rate = _sparse(T)
    st = estep(Sparse(ALPHA, d, src, dst, rate, PH.exit_rates), obs)
    ll, B, Z, N, E = estep_reference(ALPHA, T, obs)
    assert st.loglik == pytest.approx(ll, rel=1e-9)
    assert np.allclose(st.B, B, rtol=1e-8, atol=1e-10)
    assert np.allclose(st.Z, Z, rtol=1e-8, atol=1e-10)
    assert np.allclose(st.N, N[src, dst], rtol=1e-8, atol=1e-10)
    assert np.allclose(st.E, E, rtol=1e-8, atol=1e-10)
    # each observation starts somewhere: sum(B) is the number of observations
    assert st.B.sum() == pytest.approx(obs.n)


def test_loglik_matches_phase_type_loglik() -> None:
    d, src, dst, rate = _sparse(T)
    st = estep(Sparse(ALPHA, d, src, dst, rate, PH.exit_rates), samples(X))
    assert st.loglik == pytest.approx(PH.loglik(X), rel=1e-9)


# ---------------------------------------------------------------- a stiff chain: long gaps squared
def _cf1(alpha: np.ndarray, lam: np.ndarray) -> tuple[PhaseType, Sparse]:
    ph = PhaseType(alpha, np.diag(-lam) + np.diag(lam[:-1], 1), structure="cf1")
    d, src, dst, rate = _sparse(ph.T)
    return ph, Sparse(alpha, d, src, dst, rate, ph.exit_rates)


STIFF_ALPHA = np.array([0.05, 0.15, 0.3, 0.5])
STIFF_LAM = np.array([0.02, 0.3, 5.0, 200.0])  # q * (largest sample) ~ 10^5: most gaps are squared
STIFF_X = np.random.default_rng(4).lognormal(0.0, 1.8, 200)
STIFF_CASES = {
    "exact": samples(STIFF_X),
    "weighted+censored": samples(STIFF_X, weights=np.arange(200) % 3 + 0.5, censored=np.arange(200) % 5 == 0),
    "binned, open last bin": binned([0, 0.01, 0.1, 1, 10, 100, 1000, np.inf], [5, 20, 40, 30, 10, 3, 1]),
}


def _same(st: object, ref: tuple, src: np.ndarray, dst: np.ndarray, rtol: float) -> None:
    ll, B, Z, N, E = ref
    assert st.loglik == pytest.approx(ll, rel=1e-10)  # type: ignore[attr-defined]
    for got, want in ((st.B, B), (st.Z, Z), (st.N, N[src, dst]), (st.E, E)):  # type: ignore[attr-defined]
        assert np.allclose(got, want, rtol=rtol, atol=0.0)


@pytest.mark.parametrize("name", list(STIFF_CASES))
def test_a_stiff_chain_squared_matches_the_reference_and_the_series(name: str) -> None:
    obs = STIFF_CASES[name]
    ph, s = _cf1(STIFF_ALPHA, STIFF_LAM)
    lam_dt = 200.0 * 1.01 * np.diff(obs.grid)
    assert (lam_dt > squaring_from(4)).sum() >= 3  # the squaring path is what is tested
    ref = estep_reference(STIFF_ALPHA, ph.T, obs)
    _same(estep(s, obs), ref, s.src, s.dst, 1e-8)
    series = estep(s, obs, squaring=False)
    # the previous method: every gap by its Poisson series, long gaps refined
    _same(estep(s, obs), (series.loglik, series.B, series.Z, _dense_n(series.N, 4), series.E), s.src, s.dst, 1e-8)


def _dense_n(n_edge: np.ndarray, p: int) -> np.ndarray:
    N = np.zeros((p, p))
    N[np.arange(p - 1), np.arange(1, p)] = n_edge
    return N


def test_a_gap_too_long_for_plain_exponentials_is_squared_without_underflow() -> None:
    """The slowest rate times the longest gap is 1,000: e^{T dt} underflows in double precision, so
    the squarings run on T shifted by the slowest rate and the scale goes into the log-likelihood."""
    ph, s = _cf1(np.array([0.5, 0.5]), np.array([1.0, 50.0]))
    obs = samples(np.array([0.1, 0.4, 2.0, 1000.0]))
    st, series = estep(s, obs), estep(s, obs, squaring=False)  # the series refines the grid
    assert np.isfinite(st.loglik) and st.loglik == pytest.approx(series.loglik, rel=1e-10)
    assert st.loglik == pytest.approx(ph.loglik(obs.grid[1:]), rel=1e-10)
    for a, b in ((st.B, series.B), (st.Z, series.Z), (st.N, series.N), (st.E, series.E)):
        assert np.allclose(a, b, rtol=1e-8)


def test_one_phase_squared_gives_the_exponential_closed_form() -> None:
    """One phase of rate mu: time in the phase is the sum of the samples, every sample starts and
    exits there once, and the log-likelihood is n log mu - mu sum(x)."""
    mu = 400.0  # not the sample's rate: the closed form holds for any mu, and gaps reach q dt > 16
    x = np.random.default_rng(5).exponential(1.0, 50)
    ph, s = _cf1(np.array([1.0]), np.array([mu]))
    obs = samples(x)
    st = estep(s, obs)
    assert (mu * np.diff(obs.grid) > squaring_from(1)).any()
    assert st.loglik == pytest.approx(x.size * np.log(mu) - mu * x.sum(), rel=1e-12)
    assert st.Z[0] == pytest.approx(x.sum(), rel=1e-10)
    assert st.B[0] == pytest.approx(x.size, rel=1e-12) and st.E[0] == pytest.approx(x.size, rel=1e-10)
