"""Family constructors and CF1 conversions preserve the law."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.fitting import PhaseType, cf1, coxian, hyper_erlang, to_cf1
from overtake.fitting.families import sort_cf1

X = np.array([0.01, 0.3, 1.0, 4.0, 20.0])


def test_hyper_erlang_density_is_mixture_of_gammas() -> None:
    from scipy import stats

    ph = hyper_erlang([0.3, 0.7], [2, 3], [1.0, 6.0])
    ref = 0.3 * stats.gamma(2, scale=1.0).pdf(X) + 0.7 * stats.gamma(3, scale=1 / 6).pdf(X)
    assert np.allclose(ph.pdf(X), ref, rtol=1e-10)
    assert ph.mean() == pytest.approx(0.3 * 2 + 0.7 * 0.5)


def test_coxian_mean_closed_form() -> None:
    ph = coxian([2.0, 1.0], [0.25])
    assert ph.mean() == pytest.approx(0.5 + 0.25 * 1.0)


def test_sort_cf1_preserves_distribution() -> None:
    a = np.array([0.2, 0.5, 0.3])
    lam = np.array([5.0, 1.0, 2.0])
    T = np.diag(-lam) + np.diag(lam[:-1], 1)
    before = PhaseType(a, T)
    a2, lam2 = sort_cf1(a, lam)
    assert np.all(np.diff(lam2) >= 0) and np.all(a2 >= 0)
    after = cf1(a2, lam2)
    assert np.allclose(before.pdf(X), after.pdf(X), rtol=1e-10)


@pytest.mark.parametrize(
    "ph",
    [
        hyper_erlang([0.3, 0.7], [2, 2], [1.0, 6.0]),
        coxian([3.0, 1.0, 0.3], [0.5, 0.4]),
        hyper_erlang([0.2, 0.5, 0.3], [1, 2, 1], [0.5, 3.0, 9.0]),
    ],
)
def test_to_cf1_preserves_distribution(ph: PhaseType) -> None:
    c = to_cf1(ph)
    assert c.order == ph.order and c.structure == "cf1"
    assert np.allclose(c.pdf(X), ph.pdf(X), rtol=1e-8)


def test_to_cf1_rejects_cyclic() -> None:
    with pytest.raises(ValueError, match="acyclic"):
        to_cf1(PhaseType([1.0, 0.0], [[-2.0, 1.0], [1.0, -2.0]]))
