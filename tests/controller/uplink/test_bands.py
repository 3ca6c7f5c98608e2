"""overtake.controller.uplink.bands: band selection and the cutoff rule of Harchol-Balter et al.,
"Size-based scheduling to improve web performance" §2.2.2, with known answers."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from overtake.controller.uplink import bands
from overtake.controller.uplink.errors import UplinkInputError


def test_paper_001_table_bands() -> None:
    # Harchol-Balter et al. §2.2.4: <=1K, 1K-2K, 2K-5K, 5K-20K, 20K-50K, >50K
    c = bands.PAPER_001
    assert c.n_bands == 6
    cases = {0: 0, 500: 0, 1024: 0, 1025: 1, 2048: 1, 3000: 2, 5120: 2, 5121: 3,
             20480: 3, 30000: 4, 51200: 4, 51201: 5, 2e6: 5}  # fmt: skip
    assert {v: c.band(v) for v in cases} == cases
    assert str(c) == "1K,2K,5K,20K,50K"


@given(st.floats(allow_nan=True, allow_infinity=True), st.integers(1, 7))
def test_band_never_outside_configured_bands(value: float, n_cut: int) -> None:
    c = bands.log_spaced(100.0, 1e6, n_cut)
    b = c.band(value)
    assert 0 <= b < c.n_bands == n_cut + 1
    # monotone: a larger value never gets a higher-priority band
    if math.isfinite(value):
        assert c.band(value * 2 + 1) >= b


def test_log_spacing_is_geometric() -> None:
    c = bands.log_spaced(1000.0, 64000.0, 7)
    ratios = np.diff(np.log(c.edges))
    assert np.allclose(ratios, math.log(2.0))
    assert c.edges[0] == pytest.approx(1000.0) and c.edges[-1] == pytest.approx(64000.0)


def test_cutoffs_from_lognormal_match_closed_form_quantiles() -> None:
    # median of LN(mu, s) is e^mu; its 99th percentile is e^(mu + s z_0.99)
    mu, s = math.log(1000.0), 1.74
    x = stats.lognorm.rvs(s, scale=math.exp(mu), size=400_000, random_state=3)
    c = bands.cutoffs_from_samples(x, 7, top_fraction=0.01)
    assert c.n_bands == 7
    assert c.edges[0] == pytest.approx(1000.0, rel=0.02)
    assert c.edges[-1] == pytest.approx(math.exp(mu + s * stats.norm.ppf(0.99)), rel=0.03)
    assert c.fraction_above(x) == pytest.approx(0.01, abs=0.001)
    assert np.mean(x <= c.edges[0]) == pytest.approx(0.5, abs=0.005)
    # the default rule: the low end of Harchol-Balter et al.'s 0.5-1 % above the highest cutoff
    d = bands.cutoffs_from_samples(x, 7)
    assert bands.TOP_FRACTION == 0.005
    assert d.edges[-1] == pytest.approx(math.exp(mu + s * stats.norm.ppf(0.995)), rel=0.03)
    assert d.fraction_above(x) == pytest.approx(0.005, abs=0.0007)


def test_two_bands_cut_at_the_median() -> None:
    # Harchol-Balter et al. §3.4: two classes, smallest 50% high priority
    x = np.arange(1, 10_001, dtype=float)
    c = bands.cutoffs_from_samples(x, 2)
    assert c.edges == (pytest.approx(5000.5),)


def test_top_fraction_is_adjustable() -> None:
    x = np.arange(1, 100_001, dtype=float)
    c = bands.cutoffs_from_samples(x, 5, top_fraction=0.005)
    assert c.fraction_above(x) == pytest.approx(0.005, abs=1e-4)


def test_parse_cutoffs_units() -> None:
    assert bands.parse_cutoffs("1K, 2K,5k,0.5M").edges == (1024.0, 2048.0, 5120.0, 524288.0)
    assert bands.parse_cutoffs("5ms,0.1s,2", unit="seconds").edges == (0.005, 0.1, 2.0)


@pytest.mark.parametrize(
    ("text", "field"),
    [("1K,x", "cutoffs[1]"), ("2K,1K", "cutoffs[1]"), ("1K,1K", "cutoffs[1]"), ("-1", "cutoffs[0]")],
)
def test_bad_cutoffs_name_the_field(text: str, field: str) -> None:
    with pytest.raises(UplinkInputError, match=re.escape(field)):
        bands.parse_cutoffs(text)


def test_bad_rule_arguments() -> None:
    with pytest.raises(UplinkInputError, match="bands"):
        bands.cutoffs_from_samples([1.0, 2.0], 1)
    with pytest.raises(UplinkInputError, match="top_fraction"):
        bands.cutoffs_from_samples([1.0, 2.0], 3, top_fraction=0.6)
    with pytest.raises(UplinkInputError, match="samples"):
        bands.cutoffs_from_samples([0.0, -1.0, float("nan")], 3)


def test_adaptive_cutoffs_follow_the_observed_distribution() -> None:
    a = bands.AdaptiveCutoffs(bands.PAPER_001, window=2000, every=500, min_samples=1000)
    rng = np.random.default_rng(7)
    x = rng.lognormal(math.log(20000.0), 1.0, size=3000)  # median 20 KB, not Harchol-Balter et al.'s 1 KB
    for v in x:
        a.observe(float(v))
    c = a.current
    assert a.updates >= 1 and c.n_bands == bands.PAPER_001.n_bands
    assert c.edges[0] == pytest.approx(20000.0, rel=0.15)
    assert c.edges[-1] == pytest.approx(20000.0 * math.exp(stats.norm.ppf(1 - bands.TOP_FRACTION)), rel=0.25)

