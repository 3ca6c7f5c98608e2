"""State counts of the truncation path known before solving (mdp/optimum.py, mdp/rule_evaluation.py).

``ps_chain_states`` walks the π(∞) baseline's caps on the processor-sharing queue's closed form;
it must land on the cap and the chain size the baseline's own numerical evaluation reaches.
"""

from __future__ import annotations

import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp.baselines import Baseline
from overtake.mdp.caps import next_solve_cap
from overtake.mdp.optimum import auto_start, estimate_states
from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule, ps_chain_states, ps_metrics
from overtake.mdp.statespace import Layout, StateSpace, Truncation

MODELS = {
    "exp rho 0.6": tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 1.0)),
    "exp rho 0.85": tandem(0.85, exp_stage("a", 1.0), exp_stage("b", 5.0)),
    "exp 2 cores": tandem(0.8, exp_stage("a", 1.0), exp_stage("b", 1.0), cores=2),
    "exp overhead": tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 1.0), overhead=0.005),
    "h2 + exp rho 0.6": tandem(0.6, exp_stage("a", 1.0), h2_stage("b", 0.91, 0.55, 5.45)),
    "h2 + h2 2 cores overhead": tandem(0.7, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25),
                                       cores=2, overhead=0.01),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_ps_closed_form_equals_the_chain_of_pi_inf(name: str) -> None:
    """π(∞)'s O(C) metrics (symmetric queue, insensitivity) against its phase-level chain built and
    solved like every other policy's: every field, on two caps."""
    model = MODELS[name]
    lay = Layout.build(model, "start")
    rule = Baseline.parse("pi(inf)", model.n_stages).rule(lay.queue_stage, model.coord_stage())
    for C in (7, 12):
        chain = evaluate_rule(model, lay, rule, max_requests=C, max_threads=None).to_dict()
        closed = ps_metrics(model, C).to_dict()
        assert closed.keys() == chain.keys()
        for key, v in chain.items():
            # the chain's law is exact to a residual of 1e-12 of its largest probability
            assert closed[key] == (pytest.approx(v, rel=1e-9, abs=1e-10) if not isinstance(v, int) else v), key


@pytest.mark.parametrize("name", list(MODELS))
def test_ps_chain_matches_the_baselines_own_evaluation(name: str) -> None:
    model = MODELS[name]
    ev = evaluate_baseline(model, "pi(inf)")
    # insensitivity: the closed form and the phase-level chain agree on every cap of the walk
    assert ps_chain_states(model) == ev.metrics.states
    assert [t["max_requests"] for t in ev.trace][-1] == ev.metrics.max_requests


def test_fixed_truncation_is_counted_exactly() -> None:
    model = MODELS["h2 + exp rho 0.6"]
    tr = Truncation(7, 3)
    assert estimate_states(model, tr) == StateSpace(model, tr).size
    assert estimate_states(model, tr, "start") == StateSpace(model, tr, "start").size


@pytest.mark.parametrize("cores", [1, 2, 8, 12])
def test_auto_estimate_is_one_thread_above_the_solve_every_run_makes(cores: int) -> None:
    # every auto run re-solves once on cap C1 with at least its start's threads K0: the estimate
    # counts that space with K0 + 1 threads
    model = tandem(0.6, exp_stage("a", 1.0), h2_stage("b", 0.91, 0.55, 5.45), cores=cores)
    start = auto_start(model)
    c1 = next_solve_cap(start.max_requests)
    assert (start.max_requests, c1) == (10, 13)
    assert start.k_max == min(cores + 2, 10)
    assert estimate_states(model) == StateSpace(model, Truncation(c1, start.k_max + 1)).size


def test_thread_cap_probes_are_loose_checks_and_keep_the_answer() -> None:
    """Each probe of one more thread is a check (solved to tol/10 on the gain, as the solve-cap
    check): only the first solve is tight, and the answer is still no worse than any baseline."""
    from overtake.mdp import solve

    model = MODELS["h2 + exp rho 0.6"]
    opt = solve(model, tol=1e-3)
    solves = [t for t in opt.trace if "check" not in t]
    first = solves[0]
    assert first["loose"] is False
    probes = [t for t in solves if t["max_requests"] == first["max_requests"] and t["max_threads"] > first["max_threads"]]
    assert probes and all(t["loose"] for t in probes)
    ew = opt.metrics.mean_response_time
    for name in ("pi(1)", "pi(inf)"):
        assert ew <= evaluate_baseline(model, name, tol=1e-3).metrics.mean_response_time * (1 + 1e-3), name
