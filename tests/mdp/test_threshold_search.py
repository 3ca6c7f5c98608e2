"""The threshold search: its cheaper discretisation against the reference one and known answers,
its choice against a full search on the reference discretisation, and both choices simulated.

Statistical checks follow tests/mdp/test_simulate.py: fixed seeds, pass within 1.5 batch-means
95 % half-widths (here of a difference of two independent runs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp.mlps import EXACT, SEARCH, JobClass, mlps_classes_mean
from overtake.mdp.priority import DEFAULT_LOW_WEIGHT, CpuPriority, age_priority, weights_for_levels
from overtake.mdp.simulation import simulate
from overtake.mdp.thresholds import _optimise, choose_tandem_thresholds, tandem_model_mean

Z = 1.5


@pytest.fixture(scope="module")
def case8():  # type: ignore[no-untyped-def]
    """Table 1's case 8: H2 stages of means 1 and 5 (91 % short), ρ = 0.6."""
    return tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 2.75, 27.25))


@pytest.mark.parametrize("threshold", [0.4, 2.0, 8.0, 30.0])
def test_search_accuracy_agrees_with_the_reference(case8, threshold) -> None:  # type: ignore[no-untyped-def]
    pr = age_priority(case8, [threshold])
    ref = tandem_model_mean(case8, pr, accuracy=EXACT)
    assert tandem_model_mean(case8, pr, accuracy=SEARCH) == pytest.approx(ref, rel=5e-4)


@pytest.mark.parametrize("threshold", [0.05, 1.0, 6.0])
def test_search_accuracy_memoryless_known_answer(threshold) -> None:  # type: ignore[no-untyped-def]
    """Exponential visits: every attained-service discipline gives M/M/1's mean, 1/(μ − λ)
    per visit, whatever the threshold (two stages of mean 1 at ρ = 0.6: E[W] = 2 · 2.5)."""
    m = tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 1.0))
    assert tandem_model_mean(m, age_priority(m, [threshold]), accuracy=SEARCH) == pytest.approx(5.0, rel=1e-5)
    one = mlps_classes_mean([JobClass(0.5, np.ones(1), np.array([[-1.0]]), 0, (threshold,))], accuracy=SEARCH)
    assert one[0] == pytest.approx(2.0, rel=1e-5)


def _full_search(model):  # type: ignore[no-untyped-def]
    """The reference search: Nelder–Mead over the log-threshold on the reference discretisation,
    from the best of a 9-point scan."""
    w = weights_for_levels(None, 2)
    N = model.n_stages

    def ev(a: float) -> float:
        return tandem_model_mean(model, CpuPriority(w, ((a,),) * N), accuracy=EXACT)

    scale = float(np.mean([s.mean() for s in model.stages]))
    scan = np.geomspace(0.05 * scale, 20.0 * scale, 9)
    x0 = math.log(scan[int(np.argmin([ev(float(x)) for x in scan]))])
    xs, val, _ = _optimise(lambda lx: ev(math.exp(float(lx[0]))), np.array([x0]), math.log(1e-3 * scale),
                           math.log(1e3 * scale))
    return math.exp(float(xs[0])), val


def test_choice_matches_the_full_search(case8) -> None:  # type: ignore[no-untyped-def]
    """The cheap search lands where the full one does: its threshold's reference E[W] is within
    1e-4 of the full search's minimum, and simulated at the real weights (π(∞), what the visit
    model predicts) both thresholds give the same E[W] within the runs' confidence intervals."""
    ch = choose_tandem_thresholds(case8, common=True)
    a = ch.priority.thresholds[0][0]
    a_full, v_full = _full_search(case8)
    mine = tandem_model_mean(case8, ch.priority, accuracy=EXACT)
    assert mine <= v_full * (1 + 1e-4)
    assert ch.mean_response_time == pytest.approx(mine, rel=5e-4)
    weights = [1.0, DEFAULT_LOW_WEIGHT]
    new = simulate(case8, "pi(inf)", requests=200_000, seed=5, cpu_priority=age_priority(case8, [a], weights=weights))
    old = simulate(case8, "pi(inf)", requests=200_000, seed=6,
                   cpu_priority=age_priority(case8, [a_full], weights=weights))
    assert abs(new.mean_response_time - old.mean_response_time) <= Z * math.hypot(new.ci95, old.ci95)


def test_table1_choice_matches_the_full_search_for_the_policy() -> None:
    """Table 1's case 7 (an H2 stage, then an exponential one): the search's threshold is
    the full search's to 1e-4 of the reference E[W], and the solved policy π* simulated with
    either threshold (what ``overtake solve --cpu-priority age`` predicts) gives the same E[W]
    within the runs' confidence intervals."""
    from pathlib import Path

    from overtake.api.scenario import load_scenario
    from overtake.mdp import solve

    sc, model = load_scenario(Path(__file__).resolve().parents[2] / "examples" / "table1" / "case07.yaml")
    ch = choose_tandem_thresholds(model, common=True)
    a = ch.priority.thresholds[0][0]
    a_full, v_full = _full_search(model)
    assert tandem_model_mean(model, ch.priority, accuracy=EXACT) <= v_full * (1 + 1e-4)
    pol = solve(model, truncation=sc.fixed_truncation(), tol=sc.tolerance).policy
    weights = [1.0, DEFAULT_LOW_WEIGHT]
    new = simulate(model, pol, requests=200_000, seed=5, cpu_priority=age_priority(model, [a], weights=weights))
    old = simulate(model, pol, requests=200_000, seed=6, cpu_priority=age_priority(model, [a_full], weights=weights))
    assert abs(new.mean_response_time - old.mean_response_time) <= Z * math.hypot(new.ci95, old.ci95)
