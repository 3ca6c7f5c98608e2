"""Auto-truncation's shortcuts keep its answer (mdp/optimum.py).

A thread-cap probe that the last two improvements predict to bring less than tol/2 is not solved:
solving it anyway must confirm the prediction (below tol, so it would have been discarded) and the
answer must be the one of the full search.
"""

from __future__ import annotations

import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import optimum, solve
from overtake.mdp.optimum import predicted_thread_gain


def test_prediction_needs_two_falling_improvements() -> None:
    assert predicted_thread_gain([]) is None
    assert predicted_thread_gain([7e-3]) is None
    assert predicted_thread_gain([7e-3, 5e-3]) is None  # not falling by half: probe
    assert predicted_thread_gain([-1e-3, 2e-3]) is None
    assert predicted_thread_gain([7e-3, -1e-3]) is None
    assert predicted_thread_gain([7.09e-3, 1.29e-3]) == pytest.approx(1.29e-3**2 / 7.09e-3)
    assert predicted_thread_gain([1.0, 7.09e-3, 1.29e-3]) == pytest.approx(2.347e-4, rel=1e-3)


# Table 1 case 11 (a long-phase H2 stage, then an exponential one): K goes 3 -> 4 -> 5, and the
# probe of 6 threads moves E[W] by 2.3e-4 < tol
CASE11 = tandem(0.6, h2_stage("s1", 0.91, 2.75, 27.25), exp_stage("s2", 1.0))


def test_skipped_thread_probe_is_confirmed_by_solving_it(monkeypatch: pytest.MonkeyPatch) -> None:
    tol = 1e-3
    fast = solve(CASE11, tol=tol)
    skipped = [t for t in fast.trace if t.get("check") == "thread cap"]
    assert len(skipped) == 1 and skipped[0]["solved"] is False
    assert skipped[0]["max_threads"] == fast.truncation.k_max + 1
    predicted = skipped[0]["predicted_change"]
    assert predicted < optimum.PREDICT_MARGIN * tol

    monkeypatch.setattr(optimum, "PREDICT_MARGIN", 0.0)  # probe every thread cap, as before
    full = solve(CASE11, tol=tol)
    assert not [t for t in full.trace if t.get("check") == "thread cap"]
    assert (full.truncation.max_requests, full.truncation.k_max) == (fast.truncation.max_requests,
                                                                     fast.truncation.k_max)
    # the probe the fast run skipped, solved: below tol (it would have been discarded) and close
    # to the prediction
    solves = [t for t in full.trace if "check" not in t]
    base = next(t for t in solves if t["max_threads"] == fast.truncation.k_max and t["max_requests"] == 10)
    probe = next(t for t in solves if t["max_threads"] == fast.truncation.k_max + 1)
    measured = (base["mean_response_time"] - probe["mean_response_time"]) / base["mean_response_time"]
    assert abs(measured) < tol
    assert 0.5 * predicted < measured < 2.0 * predicted
    # the same answer: the skipped probe fed nothing but a warm start of the stationary solves
    assert fast.metrics.mean_response_time == pytest.approx(full.metrics.mean_response_time, rel=1e-7)
    assert fast.sweeps < full.sweeps


def test_solve_cap_check_is_evaluated_on_the_ladder_only() -> None:
    """The re-solve on the next solve cap (13, off the ladder 10, 15, 23) is judged by its policy's
    E[W] on ladder caps: its own-cap metrics are not computed, and the reported E[W] is the exact
    evaluation of the returned policy on the recorded evaluation cap."""
    from overtake.mdp.rule_evaluation import evaluate_rule
    from overtake.mdp.statespace import Layout

    opt = solve(CASE11, tol=1e-3)
    solves = [t for t in opt.trace if "check" not in t]
    assert all("mean_response_time" in t for t in solves if t["max_requests"] == 10)
    resolve = [t for t in solves if t["max_requests"] == 13]
    assert resolve and all("mean_response_time" not in t for t in resolve)
    ev = [t for t in opt.trace if t.get("check") == "evaluation cap" and t["solve_cap"] == 13]
    assert [t["max_requests"] for t in ev] == [10, 15, 23]
    cap = opt.policy.meta["metrics_truncation"]["max_requests"]
    again = evaluate_rule(CASE11, Layout.build(CASE11, "full"), opt.policy.actions, max_requests=cap,
                          max_threads=opt.truncation.k_max)
    # (the stationary solves meet a 1e-12 residual test from different starts: E[W] to ~1e-8)
    assert again.mean_response_time == pytest.approx(opt.metrics.mean_response_time, rel=1e-7)
