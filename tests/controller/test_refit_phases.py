"""The online loop's refits number phases as ``overtake fit`` does: by mean, phase 1 the shortest.

Known answer: Erlang-like demands (scv < 1) are fitted as CF1, whose chain runs from its slowest
phase to its fastest; written as fitted, phase 1 would be the longest, and the running policy's
phase indices (solved from an ordered fit) would mean the opposite under the refitted model.
"""

from __future__ import annotations

import numpy as np
import pytest

from overtake.controller.online.refit import _fit_stage
from overtake.phases import phase_means


@pytest.mark.parametrize(("scv_low", "seed"), [(True, 1), (False, 2)])
def test_refit_phases_are_ordered_by_mean(scv_low: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.gamma(3.0, 1.0, 3000) if scv_low else np.where(rng.random(3000) < 0.9, rng.exponential(0.5, 3000),
                                                             rng.exponential(5.0, 3000))
    f = _fit_stage(x, 2, 2, 0)
    assert f["structure"] == ("cf1" if scv_low else "hyperexp")
    means = phase_means(f["T"])
    assert means[0] <= means[1]
    assert float(f["alpha"] @ means) == pytest.approx(f["mean"], rel=1e-9)
