"""Hostile input gives one clear error naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.fitting import DataError, FittingInputError, binned, fit, fit_binned, samples


@pytest.mark.parametrize(
    ("x", "match"),
    [
        ([], r"at least 2 samples, got 0"),
        ([1.0], r"at least 2 uncensored samples, got 1"),
        ([2.0, 2.0, 2.0], r"all uncensored samples are equal \(x=2.0\)"),
        ([1.0, np.nan, 2.0], r"x\[1\] must be finite, got nan"),
        ([1.0, np.inf], r"x\[1\] must be finite"),
        ([1.0, -0.5, 2.0], r"x\[1\] must be > 0 seconds, got -0.5"),
        ([1.0, 0.0, 2.0], r"x\[1\] must be > 0"),
        ([[1.0, 2.0]], r"x must be 1-D"),
        (["a", "b"], r"x must be numeric"),
    ],
)
def test_hostile_samples(x: object, match: str) -> None:
    with pytest.raises(DataError, match=match):
        fit(x, order=2)  # type: ignore[arg-type]


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        fit([1.0, float("nan")])


def test_bad_weights_and_censoring() -> None:
    with pytest.raises(DataError, match=r"weights\[1\] must be finite and >= 0, got -1.0"):
        samples([1.0, 2.0], weights=[1.0, -1.0])
    with pytest.raises(DataError, match="weights must have the length of x"):
        samples([1.0, 2.0], weights=[1.0])
    with pytest.raises(DataError, match="uncensored"):
        samples([1.0, 2.0], censored=[True, True])
    with pytest.raises(DataError, match="censored must be booleans"):
        samples([1.0, 2.0], censored=[0, 2])


@pytest.mark.parametrize(
    ("edges", "counts", "match"),
    [
        ([0, 1], [5], "at least 2 non-empty bins"),
        ([0, 1, 1, 2], [1, 2, 3], r"strictly increasing, edges\[2\]=1"),
        ([-1, 1, 2], [1, 2], r"edges\[0\] must be >= 0"),
        ([0, 1, 2], [1, 2, 3], "counts must have len"),
        ([0, 1, 2], [1, -2], r"counts\[1\] must be finite and >= 0"),
        ([0, np.inf, 2], [1, 2], "only the last may be"),
    ],
)
def test_hostile_bins(edges: list[float], counts: list[float], match: str) -> None:
    with pytest.raises(DataError, match=match):
        binned(edges, counts)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"structure": "magic"}, "structure must be one of"),
        ({"order": 0}, "order must be an integer >= 1"),
        ({"order": "many"}, "order must be an integer in 1..12 or 'auto'"),
        ({"max_iter": 0}, "max_iter must be an integer >= 1"),
        ({"rtol": 2.0}, r"rtol must be in \(0, 1\)"),
        ({"init": "magic"}, "init must be"),
        ({"structure": "hypererlang", "order": 3, "shapes": (1, 1)}, "shapes must be positive and sum to order=3"),
    ],
)
def test_hostile_options(kw: dict[str, object], match: str) -> None:
    with pytest.raises(FittingInputError, match=match):
        fit([1.0, 2.0, 3.0], **kw)  # type: ignore[arg-type]


def test_preserve_mean_rejected_for_binned() -> None:
    with pytest.raises(FittingInputError, match="preserve_mean needs exact samples"):
        fit_binned([0, 1, 2, np.inf], [3, 2, 1], order=1, preserve_mean=True)


def test_ties_collapse_into_weights() -> None:
    obs = samples([1.0, 1.0, 2.0, 3.0, 3.0, 3.0])
    assert obs.grid.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert obs.point_w.tolist() == [2.0, 1.0, 3.0] and obs.n == 6
