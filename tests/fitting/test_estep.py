"""The numba uniformization E-step equals the pure-numpy Van Loan reference."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.fitting import PhaseType, binned, samples
from overtake.fitting._estep import Sparse, estep, estep_reference
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
