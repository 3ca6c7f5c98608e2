"""Moment matching hits its moments exactly (Tijms 1994; Johnson & Taaffe 1989)."""

from __future__ import annotations

import pytest

from overtake.fitting import MomentError, match_three_moments, match_two_moments


@pytest.mark.parametrize("scv", [0.05, 0.2, 0.25, 0.3, 0.5, 0.9, 1.0, 1.5, 4.0, 25.0])
@pytest.mark.parametrize("mean", [0.003, 1.0, 40.0])
def test_two_moments_exact(mean: float, scv: float) -> None:
    ph = match_two_moments(mean, scv)
    assert ph.mean() == pytest.approx(mean, rel=1e-12)
    assert ph.scv() == pytest.approx(scv, rel=1e-10)


def test_two_moments_families() -> None:
    assert match_two_moments(1.0, 4.0).structure == "hyperexponential"
    assert match_two_moments(1.0, 1.0).structure == "exponential"
    assert match_two_moments(1.0, 0.25).structure == "erlang"
    h2 = match_two_moments(2.0, 4.0)
    # balanced means: p1/mu1 == p2/mu2
    a, rates = h2.alpha, -h2.T.diagonal()
    assert a[0] / rates[0] == pytest.approx(a[1] / rates[1])


@pytest.mark.parametrize(
    ("m1", "m2", "m3"),
    [
        (1.0, 10.0, 300.0),  # scv 9, H2
        (1.0, 3.0, 20.0),  # scv 2
        (2.0, 6.0, 25.0),  # scv 0.5
        (1.0, 1.2, 1.8),  # scv 0.2
        (1.639, 1.639**2 * 4.22, 90.0),  # the lognormal benchmark's sample moments, roughly
    ],
)
def test_three_moments_exact(m1: float, m2: float, m3: float) -> None:
    ph = match_three_moments(m1, m2, m3)
    for k, m in enumerate((m1, m2, m3), start=1):
        assert ph.moment(k) == pytest.approx(m, rel=1e-9)


def test_three_moments_of_erlang_gives_erlang() -> None:
    # Erlang(3, 1): moments 3, 12, 60
    ph = match_three_moments(3.0, 12.0, 60.0)
    assert ph.moment(3) == pytest.approx(60.0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1.0, 0.5, 1.0), "m2 must exceed m1"),
        ((1.0, 2.0, 3.0), "m3 must exceed"),
        ((-1.0, 2.0, 3.0), "m1 must be finite and > 0"),
    ],
)
def test_three_moments_infeasible(args: tuple[float, float, float], match: str) -> None:
    with pytest.raises(MomentError, match=match):
        match_three_moments(*args)


@pytest.mark.parametrize(("mean", "scv", "match"), [(0.0, 1.0, "mean"), (1.0, 0.0, "scv"), (1.0, float("nan"), "scv")])
def test_two_moments_invalid(mean: float, scv: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        match_two_moments(mean, scv)
