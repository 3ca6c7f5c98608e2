"""EM recovers known distributions (Asmussen–Nerman–Olsson 1996; G-FIT 2006)."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.fitting import PhaseType, cf1, fit, fit_binned, hyper_erlang, hyperexponential

H2 = hyperexponential([0.35, 0.65], [0.4, 4.0])
CF1_4 = cf1([0.15, 0.25, 0.3, 0.3], [0.3, 1.5, 6.0, 25.0])


@pytest.fixture(scope="module")
def h2_sample() -> np.ndarray:
    return H2.rvs(20_000, random_state=11)


@pytest.fixture(scope="module")
def cf1_sample() -> np.ndarray:
    return CF1_4.rvs(20_000, random_state=12)


def _h2_params(ph: PhaseType) -> tuple[np.ndarray, np.ndarray]:
    rates = -np.diag(ph.T)
    order = np.argsort(rates)
    return ph.alpha[order], rates[order]


def test_h2_recovered_within_sampling_error(h2_sample: np.ndarray) -> None:
    res = fit(h2_sample, structure="hyperexp", order=2)
    a, lam = _h2_params(res.ph)
    # 20k samples: SE of the weights ~0.006, of the rates ~2-3 %; allow ~4 SE
    assert a == pytest.approx([0.35, 0.65], abs=0.025)
    assert lam == pytest.approx([0.4, 4.0], rel=0.1)
    assert res.converged
    assert res.loglik >= H2.loglik(h2_sample) - 1e-6  # the MLE beats the truth on its own sample
    assert res.loglik == pytest.approx(res.ph.loglik(h2_sample), rel=1e-9)


def test_h2_by_general_cf1_em_same_likelihood(h2_sample: np.ndarray) -> None:
    """An H2 is a CF1(2); the uniformization EM reaches the closed-form EM's optimum."""
    closed = fit(h2_sample, structure="hyperexp", order=2)
    res = fit(h2_sample, structure="cf1", order=2)
    assert res.loglik == pytest.approx(closed.loglik, abs=0.05)
    assert res.ph.mean() == pytest.approx(H2.mean(), rel=0.03)


def test_cf1_4_recovered(cf1_sample: np.ndarray) -> None:
    res = fit(cf1_sample, structure="cf1", order=4, random_state=0)
    true_ll = CF1_4.loglik(cf1_sample)
    assert res.loglik >= true_ll - 0.5
    lam = -np.diag(res.ph.T)
    assert lam == pytest.approx([0.3, 1.5, 6.0, 25.0], rel=0.2)
    assert res.ph.alpha == pytest.approx(CF1_4.alpha, abs=0.05)
    grid = np.linspace(0.01, 15, 200)
    assert np.max(np.abs(res.ph.cdf(grid) - CF1_4.cdf(grid))) < 0.01
    assert res.structure == "cf1" and np.all(np.diff(lam) >= 0)


def test_loglik_trace_never_decreases(cf1_sample: np.ndarray) -> None:
    res = fit(cf1_sample[:3000], structure="cf1", order=3, max_iter=200)
    tr = np.array(res.loglik_trace)
    assert np.all(np.diff(tr) >= -1e-7 * np.abs(tr[1:]))
    assert np.isfinite(tr).all()


def test_censored_fit_recovers_h2(h2_sample: np.ndarray) -> None:
    c = 2.0  # about 20 % of the requests hit the timeout
    cens = h2_sample >= c
    assert 0.15 < cens.mean() < 0.3
    x = np.where(cens, c, h2_sample)
    res = fit(x, censored=cens, structure="hyperexp", order=2)
    a, lam = _h2_params(res.ph)
    assert a == pytest.approx([0.35, 0.65], abs=0.04)
    assert lam == pytest.approx([0.4, 4.0], rel=0.12)
    # ignoring the censoring would badly underestimate the mean
    naive = fit(x, structure="hyperexp", order=2)
    assert abs(res.ph.mean() - H2.mean()) < 0.3 * abs(naive.ph.mean() - H2.mean())


def test_censored_cf1_fit(h2_sample: np.ndarray) -> None:
    c = 2.0
    cens = h2_sample >= c
    res = fit(np.where(cens, c, h2_sample), censored=cens, structure="cf1", order=2)
    assert res.ph.mean() == pytest.approx(H2.mean(), rel=0.08)


def test_binned_fit_recovers_h2(h2_sample: np.ndarray) -> None:
    edges = np.concatenate(([0.0], np.geomspace(0.01, 10, 40), [np.inf]))
    counts = np.histogram(h2_sample, bins=edges)[0]
    res = fit_binned(edges, counts, structure="hyperexp", order=2)
    a, lam = _h2_params(res.ph)
    assert a == pytest.approx([0.35, 0.65], abs=0.03)
    assert lam == pytest.approx([0.4, 4.0], rel=0.1)
    res_cf1 = fit_binned(edges, counts, structure="cf1", order=2)
    assert res_cf1.ph.mean() == pytest.approx(H2.mean(), rel=0.05)
    assert res_cf1.n == h2_sample.size


def test_weights_equal_repeated_samples() -> None:
    x = np.array([0.2, 0.5, 0.9, 1.4, 2.5, 4.0])
    w = np.array([3, 1, 4, 1, 5, 2])
    a = fit(x, weights=w, structure="cf1", order=2, random_state=0)
    b = fit(np.repeat(x, w), structure="cf1", order=2, random_state=0)
    assert a.loglik == pytest.approx(b.loglik, rel=1e-6)


def test_hyper_erlang_recovers_shapes() -> None:
    true = hyper_erlang([0.4, 0.6], [3, 1], [6.0, 0.5])
    x = true.rvs(20_000, random_state=5)
    res = fit(x, structure="hypererlang", order=4)
    assert sorted(res.shapes or ()) == [1, 3]
    assert res.loglik >= true.loglik(x) - 1e-6
    assert res.ph.mean() == pytest.approx(true.mean(), rel=0.03)


def test_general_structure_does_not_lose_to_cf1(cf1_sample: np.ndarray) -> None:
    x = cf1_sample[:4000]
    c = fit(x, structure="cf1", order=3)
    g = fit(x, structure="general", order=3, max_iter=400)
    assert g.loglik >= c.loglik - 0.5
    assert g.ph.structure == "general"


def test_coxian_equals_cf1_law(cf1_sample: np.ndarray) -> None:
    x = cf1_sample[:4000]
    c = fit(x, structure="cf1", order=3)
    k = fit(x, structure="coxian", order=3)
    assert k.loglik == pytest.approx(c.loglik, abs=0.5)
    assert k.ph.alpha[0] == 1.0


def test_preserve_mean_is_exact(cf1_sample: np.ndarray) -> None:
    x = cf1_sample[:5000]
    res = fit(x, order=3, preserve_mean=True)
    assert res.mean_preserved
    assert res.ph.mean() == pytest.approx(x.mean(), rel=1e-12)
    free = fit(x, order=3)
    assert res.loglik <= free.loglik + 1e-6
    assert res.loglik >= free.loglik - 5.0


def test_order_auto_picks_by_bic_and_reports_every_order(h2_sample: np.ndarray) -> None:
    res = fit(h2_sample[:5000], order="auto", structure="hyperexp")
    rows = res.selection
    assert [r.order for r in rows][:3] == [1, 2, 3]
    assert res.bic == min(r.bic for r in rows)
    assert res.ph.order >= 2  # an H2 is not exponential
    for r in rows:
        assert r.aic == pytest.approx(2 * r.n_params - 2 * r.loglik)


def test_json_of_fit_result_has_solver_keys(h2_sample: np.ndarray) -> None:
    import json

    res = fit(h2_sample[:2000], order=2)
    d = json.loads(res.to_json())
    for key in ("alpha", "T", "structure", "order", "loglik", "n", "converged", "iterations"):
        assert key in d
    back = PhaseType.from_json(res.to_json())
    assert back == res.ph.by_mean()  # the JSON lists the phases from the shortest mean up
    assert back.moment(2) == pytest.approx(res.ph.moment(2), rel=1e-12) and d["time_unit"] == 1.0


def test_stiff_and_tiny_values_give_no_nan() -> None:
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.exponential(1e-3, 500), rng.exponential(10.0, 500)])
    res = fit(x, order=3)
    assert np.isfinite(res.loglik) and np.all(np.isfinite(res.ph.T))
    assert res.ph.mean() == pytest.approx(x.mean(), rel=0.2)


def test_convex_init_if_cvxpy_available(h2_sample: np.ndarray) -> None:
    pytest.importorskip("cvxpy")
    res = fit(h2_sample[:3000], order=2, init="convex")
    closed = fit(h2_sample[:3000], structure="hyperexp", order=2)
    assert res.loglik >= closed.loglik - 0.05


def test_heavy_tailed_fit_squared_agrees_with_the_series_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stiff CF1 fit (heavy tail: slow and fast phases together) whose long gaps are squared reaches
    the log-likelihood of the previous method (every gap by its Poisson series), never going down."""
    from overtake.fitting import _estep

    x = np.random.default_rng(11).lognormal(0.0, 1.8, 1500)
    res = fit(x, structure="cf1", order=4, random_state=0)
    tr = np.array(res.loglik_trace)
    assert np.all(np.diff(tr) >= -1e-7 * np.abs(tr[1:])) and res.converged
    assert res.loglik == pytest.approx(res.ph.loglik(x), rel=1e-10)
    monkeypatch.setattr(_estep, "squaring_from", lambda p: float("inf"))
    series = fit(x, structure="cf1", order=4, random_state=0)
    assert res.loglik == pytest.approx(series.loglik, abs=1e-3)
