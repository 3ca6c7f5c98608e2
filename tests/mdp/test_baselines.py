"""Baselines against closed forms: π(1) is M/G/1-FCFS, π(∞) is M/G/1-PS (van der Weij et al., "Dynamic thread assignment", §3)."""

from __future__ import annotations

import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp.baselines import Baseline
from overtake.mdp.errors import ModelError
from overtake.mdp.rule_evaluation import evaluate_baseline


def pollaczek_khinchine(model):
    s = model.stages
    ES = sum(x.mean() for x in s)
    ES2 = sum(x.second_moment() for x in s) + sum(
        2 * s[i].mean() * s[j].mean() for i in range(len(s)) for j in range(i + 1, len(s))
    )
    lam = model.arrival_rate
    return ES + lam * ES2 / (2 * (1 - lam * ES))


@pytest.mark.parametrize(
    "stages",
    [
        (exp_stage("a", 1.0), exp_stage("b", 5.0)),
        (h2_stage("a", 0.91, 0.55, 5.45), exp_stage("b", 1.0)),
        (h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25)),
    ],
)
def test_pi1_is_mg1_fcfs_with_summed_service(stages):
    model = tandem(0.6, *stages)
    ev = evaluate_baseline(model, "pi(1)", tol=1e-5)
    assert ev.metrics.mean_response_time == pytest.approx(pollaczek_khinchine(model), rel=1e-4)
    assert ev.metrics.mean_threads == pytest.approx(0.6, rel=1e-4)  # utilisation = rho


@pytest.mark.parametrize(
    "stages",
    [(exp_stage("a", 1.0), exp_stage("b", 1.0)), (h2_stage("a", 0.91, 0.55, 5.45), exp_stage("b", 5.0))],
)
def test_pi_inf_is_mg1_processor_sharing(stages):
    model = tandem(0.6, *stages)
    ev = evaluate_baseline(model, "pi(inf)", tol=1e-5)
    ES = model.mean_service()
    assert ev.metrics.mean_response_time == pytest.approx(ES / (1 - 0.6), rel=1e-4)
    # PS: per-stage sojourn is E[S_i]/(1 − ρ) as well (insensitivity)
    for st, w in zip(model.stages, ev.metrics.stage_sojourn):
        assert w == pytest.approx(st.mean() / 0.4, rel=1e-3)


def test_little_and_conservation_hold_for_pi4():
    model = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 0.55, 5.45))
    m = evaluate_baseline(model, "pi(4)").metrics
    assert sum(m.stage_sojourn) == pytest.approx(m.mean_response_time, rel=1e-12)
    assert sum(m.thread_distribution) == pytest.approx(1.0)
    # with one processor the busy probability is the load
    assert 1 - m.thread_distribution[0] == pytest.approx(0.6, rel=1e-3)
    assert len(m.thread_distribution) <= 5


@pytest.mark.parametrize("bad", ["pi(0)", "pi(1,2,3)", "fifo", "pi()"])
def test_bad_baseline_names_are_refused(bad):
    with pytest.raises(ModelError, match="pi"):
        Baseline.parse(bad, 2)
