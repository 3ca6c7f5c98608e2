"""bench/uplink/ideal.py: the fluid link the uplink benchmark sets beside its measurements.

Known answers: a two-job example worked by hand, the M/M/1-PS mean sojourn 1/(mu - lambda),
work conservation (every discipline empties the link at the same instant), SRPT's optimality of
the mean, and bands that degenerate to PS (one band) or to SRPT (a band per job)."""

from __future__ import annotations

import numpy as np
import pytest
from support.bench import bench_module

fluid = bench_module("uplink.ideal").fluid_response_times


def test_two_jobs_by_hand() -> None:
    arr, size = np.array([0.0, 1.0]), np.array([2.0, 0.5])
    # PS: at t=1 job 0 has 1 left, job 1 0.5; sharing, job 1 ends at 2, job 0 at 2.5
    assert fluid(arr, size, 1.0, "ps") == pytest.approx([2.5, 1.0])
    # SRPT: job 1 preempts, ends at 1.5; job 0 resumes and ends at 2.5
    assert fluid(arr, size, 1.0, "srpt") == pytest.approx([2.5, 0.5])
    # bands with a cutoff at 1: job 1 (0.5) is above job 0 (1 left, in band 0 too at t=1) -> PS
    assert fluid(arr, size, 1.0, "bands", (1.0,)) == pytest.approx([2.5, 1.0])
    assert fluid(arr, size, 1.0, "bands", (0.75,)) == pytest.approx([2.5, 0.5])
    # rate scales time
    assert fluid(arr * 2, size, 0.5, "ps") == pytest.approx([5.0, 2.0])


def test_mm1_ps_mean_and_disciplines() -> None:
    rng = np.random.default_rng(3)
    n, lam = 30_000, 0.6
    arr = np.cumsum(rng.exponential(1 / lam, n))
    size = rng.exponential(1.0, n)
    # M/M/1-PS: E[T] = 1 / (1 - rho) = 2.5; the trace's own standard error is ~2 %
    assert fluid(arr, size, 1.0, "ps").mean() == pytest.approx(1 / (1 - lam), rel=0.08)
    # the identities and orderings below hold on any trace, not in the mean: they run on its first
    # m jobs (with 50 bands every job crosses up to 49, each crossing an event of the fluid model)
    m = 3_000
    arr, size = arr[:m], size[:m]
    ps = fluid(arr, size, 1.0, "ps")
    srpt = fluid(arr, size, 1.0, "srpt")
    one_band = fluid(arr, size, 1.0, "bands", (1e9,))
    fine = fluid(arr, size, 1.0, "bands", tuple(np.quantile(size, np.linspace(0.02, 0.98, 49))))
    assert one_band == pytest.approx(ps)
    # work conservation: every discipline empties the link at the same instant
    assert (arr + ps).max() == pytest.approx((arr + srpt).max()) == pytest.approx((arr + fine).max())
    # SRPT minimises the mean; 50 bands get most of the way there
    assert srpt.mean() < fine.mean() < ps.mean()
    assert fine.mean() - srpt.mean() < 0.2 * (ps.mean() - srpt.mean())


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="discipline"):
        fluid(np.zeros(1), np.ones(1), 1.0, "fifo")
    with pytest.raises(ValueError, match="rate"):
        fluid(np.zeros(1), np.ones(1), 0.0, "ps")
