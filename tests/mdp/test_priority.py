"""CPU priority levels: the exact M/G/1 analysis against closed forms, the simulator against both.

Statistical checks follow tests/mdp/test_simulate.py: fixed seeds, pass when the known value
lies within 1.5 batch-means 95% half-widths.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.api.cli import main
from overtake.mdp.errors import ModelError
from overtake.mdp.mlps import (
    JobClass,
    dps_means,
    fb_mean,
    fb_response,
    mlps_classes_mean,
    mlps_mean,
    mlps_response,
    ps_mean,
)
from overtake.mdp.model import TandemModel
from overtake.mdp.priority import (
    DEFAULT_LOW_WEIGHT,
    NICE19_WEIGHT,
    CpuPriority,
    age_priority,
    class_priority,
    level_weights,
    short_first_levels,
)
from overtake.mdp.simulation import simulate
from overtake.mdp.thresholds import choose_tandem_thresholds, choose_thresholds, tandem_model_mean

Z = 1.5
STRICT = 1e-9  # a weight ratio that is strict priority for every purpose here


def inside(res, value: float) -> bool:  # type: ignore[no-untyped-def]
    return abs(res.mean_response_time - value) <= Z * res.ci95


@pytest.fixture(scope="module")
def h2():  # type: ignore[no-untyped-def]
    """Table 1's H2 (91 % mean 0.55, 9 % mean 5.45) alone on the CPU at ρ = 0.6."""
    return tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45))


# ---- the exact analysis -----------------------------------------------------------------------


def test_issue_table_single_mg1_h2(h2) -> None:  # type: ignore[no-untyped-def]
    """The known table (M/G/1, H2, ρ = 0.6): PS 2.48, LAS 2.08, two-level ≈ 2.13, short-first 2.00.
    PS and short-first are closed forms; the two-level optimum is 2.116 (threshold 1.77)."""
    s, lam = h2.stages[0], h2.arrival_rate
    assert ps_mean(s, lam) == pytest.approx(0.991 / 0.4, rel=1e-12)
    assert fb_mean(s, lam) == pytest.approx(2.0833, abs=1e-4)
    best = choose_thresholds(s, lam)
    assert best.mean_response_time == pytest.approx(2.1157, abs=2e-4)
    assert best.thresholds[0] == pytest.approx(1.77, abs=0.03)
    lam0, lam1 = lam * 0.91, lam * 0.09
    sf = mlps_classes_mean([JobClass(lam0, np.ones(1), np.array([[-1 / 0.55]]), 0, (math.inf,)),
                            JobClass(lam1, np.ones(1), np.array([[-1 / 5.45]]), 1, (math.inf,))])
    assert 0.91 * sf[0] + 0.09 * sf[1] == pytest.approx(1.998, abs=1e-3)


def test_exponential_service_every_blind_policy_is_mm1() -> None:
    """With Exp(1) service every size-blind work-conserving order has E[T] = 1/(μ − λ): the MLPS
    analysis (batch term included) must return 2.5 at λ = 0.6 for any thresholds, and FB too."""
    s = exp_stage("e", 1.0)
    for th in ([0.5], [2.0], [0.3, 1.0], [0.2, 0.7, 2.0]):
        assert mlps_mean(s, 0.6, th) == pytest.approx(2.5, rel=1e-6)
    assert fb_mean(s, 0.6) == pytest.approx(2.5, rel=1e-8)
    two = [JobClass(0.3, np.ones(1), -np.ones((1, 1)), lvl, (math.inf,)) for lvl in (0, 1)]
    assert np.mean(mlps_classes_mean(two)) == pytest.approx(2.5, rel=1e-6)


def test_class_priority_is_the_preemptive_priority_formula(h2) -> None:  # type: ignore[no-untyped-def]
    """Two exponential classes, strict priority: E[T_hi] = m_0/(1 − ρ_0), E[T_lo] =
    m_1/(1 − ρ_0) + R/((1 − ρ_0)(1 − ρ)) with R = Σλ_k E[S_k²]/2; DPS with g_1 → 0 agrees."""
    lam = h2.arrival_rate
    l0, l1, m0, m1 = lam * 0.91, lam * 0.09, 0.55, 5.45
    r0, r = l0 * m0, l0 * m0 + l1 * m1
    R = l0 * m0**2 + l1 * m1**2
    want = [m0 / (1 - r0), m1 / (1 - r0) + R / ((1 - r0) * (1 - r))]
    got = mlps_classes_mean([JobClass(l0, np.ones(1), np.array([[-1 / m0]]), 0, (math.inf,)),
                             JobClass(l1, np.ones(1), np.array([[-1 / m1]]), 1, (math.inf,))])
    np.testing.assert_allclose(got, want, rtol=1e-8)
    np.testing.assert_allclose(dps_means([l0, l1], [1 / m0, 1 / m1], [1.0, 1e-12]), want, rtol=1e-9)
    np.testing.assert_allclose(dps_means([l0, l1], [1 / m0, 1 / m1], [1.0, 1.0]), [m0 / 0.4, m1 / 0.4])


def test_one_level_is_ps_and_thin_levels_tend_to_fb(h2) -> None:  # type: ignore[no-untyped-def]
    s, lam = h2.stages[0], h2.arrival_rate
    assert mlps_mean(s, lam, []) == pytest.approx(ps_mean(s, lam), rel=1e-12)
    fb = fb_mean(s, lam)
    errs = [mlps_mean(s, lam, list(np.arange(w, 25.0, w))) - fb for w in (1.0, 0.5, 0.25)]
    assert 0 < errs[2] < errs[1] < errs[0] and errs[2] < 1e-4  # decreasing to FB from above


def test_fb_response_closed_form() -> None:
    """FB for Exp(1): ρ_x = λ(1 − e^{−x}), m₂(x) = 2(1 − e^{−x} − x e^{−x})."""
    s, lam = exp_stage("e", 1.0), 0.6
    x = np.array([0.1, 1.0, 4.0])
    rx = lam * (1 - np.exp(-x))
    m2 = 2 * (1 - np.exp(-x) - x * np.exp(-x))
    np.testing.assert_allclose(fb_response(s, lam, x), (x * (1 - rx) + lam * m2 / 2) / (1 - rx) ** 2, rtol=1e-10)


def test_mlps_response_first_level_and_mean(h2) -> None:  # type: ignore[no-untyped-def]
    """x ≤ a: x/(1 − ρ_a) (M/G/1-PS on truncated work); the jump at a is T_FB(a) − a/(1 − ρ_a);
    and ∫ T(x) dF(x) is mlps_mean."""
    s, lam, a = h2.stages[0], h2.arrival_rate, 1.5
    ra = lam * (0.91 * 0.55 * (1 - math.exp(-a / 0.55)) + 0.09 * 5.45 * (1 - math.exp(-a / 5.45)))
    np.testing.assert_allclose(mlps_response(s, lam, [a], [0.5, a]), [0.5 / (1 - ra), a / (1 - ra)], rtol=1e-12)
    above = mlps_response(s, lam, [a], [a + 1e-9])[0]
    assert above == pytest.approx(fb_response(s, lam, [a])[0], rel=1e-6)
    x = np.linspace(0, 120, 240_001)
    dens = 0.91 / 0.55 * np.exp(-x / 0.55) + 0.09 / 5.45 * np.exp(-x / 5.45)
    T = mlps_response(s, lam, [a], x)
    assert np.trapezoid(T * dens, x) == pytest.approx(mlps_mean(s, lam, [a]), rel=2e-4)


def test_choose_thresholds_is_a_minimum(h2) -> None:  # type: ignore[no-untyped-def]
    s, lam = h2.stages[0], h2.arrival_rate
    ch = choose_thresholds(s, lam)
    a = ch.thresholds[0]
    assert ch.mean_response_time == pytest.approx(mlps_mean(s, lam, [a]), rel=1e-6)
    for f in (0.8, 1.25):
        assert mlps_mean(s, lam, [a * f]) > ch.mean_response_time
    assert ch.fb < ch.mean_response_time < ch.ps and min(v for _, v in ch.curve) >= ch.mean_response_time - 1e-9
    three = choose_thresholds(s, lam, levels=3)
    assert ch.fb < three.mean_response_time < ch.mean_response_time


def test_common_tandem_threshold_is_the_pooled_mg1_choice() -> None:
    """Two identical H2 stages: the visit model is one M/G/1 fed at 2λ, so the best common
    threshold is that M/G/1's and E[W] is twice its E[T]. With an exponential stage beside the
    H2, one common threshold (a server-wide OvertakePrioLevels) can only lose to one per stage."""
    s = h2_stage("a", 0.91, 0.55, 5.45)
    m = tandem(0.6, s, h2_stage("b", 0.91, 0.55, 5.45))
    one = choose_thresholds(s, 2 * m.arrival_rate)
    ch = choose_tandem_thresholds(m, common=True)
    assert ch.priority.thresholds[0] == ch.priority.thresholds[1]
    assert ch.priority.thresholds[0][0] == pytest.approx(one.thresholds[0], rel=0.03)
    assert ch.mean_response_time == pytest.approx(2 * one.mean_response_time, rel=1e-4)
    mixed = tandem(0.6, exp_stage("e", 1.0), s)
    c, per = choose_tandem_thresholds(mixed, common=True), choose_tandem_thresholds(mixed)
    assert c.priority.thresholds[0] == c.priority.thresholds[1]
    assert per.mean_response_time <= c.mean_response_time + 1e-9 < c.ps


# ---- the simulator against the analysis -------------------------------------------------------


@pytest.mark.parametrize("th", [[0.5], [1.8], [0.5, 2.0]])
def test_simulator_strict_levels_match_mlps(h2, th) -> None:  # type: ignore[no-untyped-def]
    pr = age_priority(h2, th, weights=[STRICT**k for k in range(len(th) + 1)])
    res = simulate(h2, "pi(inf)", requests=1_000_000, seed=31 + len(th), cpu_priority=pr)
    assert inside(res, mlps_mean(h2.stages[0], h2.arrival_rate, th))
    assert sum(res.extra["mean_threads_per_level"]) == pytest.approx(res.mean_threads, rel=1e-9)


def test_simulator_thin_levels_approach_fb(h2) -> None:  # type: ignore[no-untyped-def]
    """40 levels of width 0.25 (the analysis puts them 1e-4 above FB)."""
    th = list(np.arange(0.25, 10.01, 0.25))
    pr = age_priority(h2, th, weights=[1e-6**k for k in range(len(th) + 1)])
    res = simulate(h2, "pi(inf)", requests=1_000_000, seed=41, cpu_priority=pr)
    exact = mlps_mean(h2.stages[0], h2.arrival_rate, th)
    assert inside(res, exact)
    assert abs(exact - fb_mean(h2.stages[0], h2.arrival_rate)) < 2e-3


def test_simulator_one_level_is_bit_for_bit_plain_ps(h2) -> None:  # type: ignore[no-untyped-def]
    """One level (or a threshold nobody reaches) is the plain PS loop: identical output."""
    plain = simulate(h2, "pi(inf)", requests=50_000, seed=7).to_dict()
    one = simulate(h2, "pi(inf)", requests=50_000, seed=7, cpu_priority=CpuPriority((1.0,), ((),))).to_dict()
    for d in (plain, one):
        d.pop("seconds")
        d.pop("extra")
    assert one == plain
    never = age_priority(h2, [math.inf], weights=[1.0, 0.5])
    res = simulate(h2, "pi(inf)", requests=50_000, seed=7, cpu_priority=never)
    assert res.mean_response_time == pytest.approx(plain["mean_response_time"], rel=1e-9)
    assert res.extra["mean_threads_per_level"][1] == 0.0


@pytest.mark.parametrize("w", [NICE19_WEIGHT, 0.3])
def test_simulator_finite_weights_match_dps(h2, w: float) -> None:  # type: ignore[no-untyped-def]
    """Class priority on the H2's start phase at weight ratio w is M/M/1 DPS with two classes."""
    pr = class_priority(h2, weights=[1.0, w])
    assert pr.start_levels == ((0, 1),)
    res = simulate(h2, "pi(inf)", requests=1_000_000, seed=51, cpu_priority=pr)
    lam = h2.arrival_rate
    t = dps_means([lam * 0.91, lam * 0.09], [1 / 0.55, 1 / 5.45], [1.0, w])
    assert inside(res, 0.91 * t[0] + 0.09 * t[1])


def test_simulator_two_cores_water_filling_keeps_mm2() -> None:
    """Exp(1) work on m = 2 cores: levels only reorder, every core stays busy while K ≥ 2, so
    E[T] is M/M/2's 1 + C/(2μ − λ) (Erlang C) whatever the thresholds and weights."""
    m2 = TandemModel(1.2, (exp_stage("a", 1.0),), cores=2)
    pr = age_priority(m2, [0.3, 1.0], weights=[1.0, 0.05, 0.001])
    res = simulate(m2, "pi(inf)", requests=400_000, seed=18, cpu_priority=pr)
    assert inside(res, 1.0 + 0.45 / 0.8)


def test_one_thread_at_a_time_is_untouched_by_levels() -> None:
    """π(1) runs one thread: levels and weights cannot change its sample path (the demotion
    events draw no random numbers), so E[W] equals the plain run's to rounding."""
    m = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), exp_stage("b", 1.0))
    plain = simulate(m, "pi(1)", requests=50_000, seed=9)
    lv = simulate(m, "pi(1)", requests=50_000, seed=9, cpu_priority=age_priority(m, [0.5, 2.0]))
    assert lv.mean_response_time == pytest.approx(plain.mean_response_time, rel=1e-9)


def _route_ctmc(lam: float, mu1: float, mu2: float, w: float, cap: int = 80) -> float:
    """E[W] of the two-stage exponential tandem under π(∞) with stage-1 threads at weight 1 and
    stage-2 threads at weight w: a CTMC on (n1, n2), solved on n1 + n2 <= cap. At load 0.6 the
    mass beyond 60 requests already moves E[W] by under 1e-10 relative, far below the simulation's
    ci95 (about 1 %), so a larger cap only makes the build slower."""
    import scipy.sparse as sp
    import scipy.sparse.linalg as spla

    idx = {(a, b): k for k, (a, b) in enumerate((a, b) for a in range(cap + 1) for b in range(cap + 1 - a))}
    rows, cols, vals = [], [], []
    for (a, b), k in idx.items():
        out = []
        if a + b < cap:
            out.append(((a + 1, b), lam))
        tot = a + w * b
        if a:
            out.append(((a - 1, b + 1), mu1 * a / tot))
        if b:
            out.append(((a, b - 1), mu2 * w * b / tot))
        for dst, r in out:
            rows.append(k)
            cols.append(idx[dst])
            vals.append(r)
            rows.append(k)
            cols.append(k)
            vals.append(-r)
    n = len(idx)
    Q = sp.csr_matrix((vals, (rows, cols)), shape=(n, n)).T.tolil()
    Q[0, :] = 1.0
    rhs = np.zeros(n)
    rhs[0] = 1.0
    pi = spla.spsolve(Q.tocsc(), rhs)
    tot_n = np.array([a + b for (a, b) in idx])
    return float(pi @ tot_n / lam)


@pytest.mark.parametrize("w", [STRICT, 0.2])
def test_tandem_route_priority_matches_its_ctmc(w: float) -> None:
    """Exponential stages, stage-1 threads ahead of stage-2 threads (route class by start level,
    and the same levels written as an immediate demotion at stage 2): the count process is a
    CTMC on (n1, n2) with CPU shares n1/(n1 + w n2) and w n2/(n1 + w n2)."""
    m = tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 5.0))
    want = _route_ctmc(m.arrival_rate, 1.0, 0.2, w)
    route = CpuPriority((1.0, w), ((math.inf,), (math.inf,)), ((0,), (1,)), "route")
    res = simulate(m, "pi(inf)", requests=600_000, seed=62, cpu_priority=route)
    assert inside(res, want)
    demote = age_priority(m, [[math.inf], [1e-12]], weights=[1.0, w])
    res2 = simulate(m, "pi(inf)", requests=600_000, seed=62, cpu_priority=demote)
    assert res2.mean_response_time == pytest.approx(res.mean_response_time, rel=1e-3)
    assert res.mean_response_time > tandem_model_mean(m)  # the visit model's direction is wrong here


# ---- the levels' input -----------------------------------------------------------------------


def test_level_weights_parse_kernel_tables() -> None:
    assert level_weights("nice0,nice19") == (1.0, 15 / 1024)
    assert level_weights("nice0, idle") == (1.0, 3 / 1024) == (1.0, DEFAULT_LOW_WEIGHT)
    assert level_weights("2,1") == (1.0, 0.5)
    for bad, msg in [("1,x", "not a number"), ("1,2", "decreasing"), ("nice30", "-20..19"), ("0,0", "positive")]:
        with pytest.raises(ModelError, match=msg):
            level_weights(bad)


def test_cpu_priority_validation(h2) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match="start at 1"):
        CpuPriority((1.0, 2.0), ((1.0,),))
    with pytest.raises(ModelError, match="need 1 thresholds"):
        CpuPriority((1.0, 0.1), ((1.0, 2.0),))
    with pytest.raises(ModelError, match="increasing"):
        CpuPriority((1.0, 0.1, 0.01), ((2.0, 1.0),))
    with pytest.raises(ModelError, match="0..1"):
        CpuPriority((1.0, 0.1), ((1.0,),), ((0, 2),))
    two = tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 1.0))
    with pytest.raises(ModelError, match="the model has 2"):
        simulate(two, "pi(inf)", requests=1000, cpu_priority=CpuPriority((1.0, 0.1), ((1.0,),)))
    with pytest.raises(ModelError, match="2 phases"):
        simulate(h2, "pi(inf)", requests=1000, cpu_priority=CpuPriority((1.0, 0.1), ((1.0,),), ((0,),)))
    assert short_first_levels(h2.stages[0]) == (0, 1)
    assert short_first_levels(exp_stage("e", 1.0)) == (0,)


def test_cli_simulate_cpu_priority(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    sc = tmp_path / "s.yaml"
    sc.write_text("load: 0.6\nstages:\n  - name: a\n    service: {hyperexponential: {probs: [0.91, 0.09], "
                  "means: [0.55, 5.45]}}\n")
    assert main(["simulate", str(sc), "--policy", "pi(inf)", "--cpu-priority", "age", "--thresholds", "auto",
                 "--level-weights", "1,1e-9", "--requests", "300000", "--seed", "2", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cp = doc["extra"]["cpu_priority"]
    assert 1.5 < cp["thresholds"][0][0] < 2.2 and cp["weights"] == [1.0, 1e-9]
    assert doc["extra"]["model_mean_response_time"] == pytest.approx(2.1157, abs=2e-4)
    assert abs(doc["mean_response_time"] - 2.1157) <= Z * doc["ci95"]
    assert main(["simulate", str(sc), "--policy", "pi(inf)", "--cpu-priority", "class", "--requests", "3000",
                 "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["extra"]["cpu_priority"]["start_levels"] == [[0, 1]]
    assert doc["extra"]["cpu_priority"]["weights"] == [1.0, DEFAULT_LOW_WEIGHT]
    assert main(["simulate", str(sc), "--policy", "pi(inf)", "--cpu-priority", "age", "--thresholds", "2,1",
                 "--requests", "3000"]) == 2
    assert "increasing" in capsys.readouterr().err
    assert main(["simulate", str(sc), "--policy", "pi(inf)", "--thresholds", "1", "--requests", "3000"]) == 2
    assert "--cpu-priority" in capsys.readouterr().err


def test_simulator_levels_with_given_work(h2) -> None:  # type: ignore[no-untyped-def]
    """Non-PH service (work drawn outside the model from the same H2 law): demotions shift the
    request's stretched phase path to the new level's clock; E[W] is still the MLPS one."""
    class H2:
        name = "H2 sampler"

        def rvs(self, size: int, random_state: np.random.Generator) -> np.ndarray:
            long = random_state.random(size) >= 0.91
            return random_state.exponential(np.where(long, 5.45, 0.55))

    pr = age_priority(h2, [1.8], weights=[1.0, STRICT])
    res = simulate(h2, "pi(inf)", requests=1_000_000, seed=71, service=[H2()], cpu_priority=pr)
    assert inside(res, mlps_mean(h2.stages[0], h2.arrival_rate, [1.8]))


def test_the_level_solvers_fast_paths_equal_the_plain_products():
    """The level solver's PH rows start·e^{Thk} by doubling equal the row-by-row product, for a PH
    whose phases move (Coxian) and a count that is no power of two; e^{Tx} of a diagonal T
    (hyperexponential: elementwise) equals scipy's expm."""
    from scipy.linalg import expm

    from overtake.mdp.mlps import _expm, _row_powers

    T = np.array([[-2.0, 1.5, 0.0], [0.0, -1.0, 0.7], [0.0, 0.0, -0.3]])
    E = expm(T * 0.1)
    start = np.array([0.6, 0.3, 0.1])
    rows = _row_powers(start, E, 1000)
    seq = [start]
    for _ in range(999):
        seq.append(seq[-1] @ E)
    np.testing.assert_allclose(rows, np.array(seq), rtol=1e-12, atol=1e-300)
    np.testing.assert_array_equal(_expm(T, 0.1), E)  # moving phases: scipy's own
    D = np.diag([-1 / 0.55, -1 / 5.45])
    np.testing.assert_allclose(_expm(D, 3.7), expm(D * 3.7), rtol=1e-13)
