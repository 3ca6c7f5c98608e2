"""``auto`` on a scenario that declares a lock: the policy file ``overtake solve`` writes carries the
lock, and both predictions auto weighs (the policy's and Apache's default) are the lock model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from overtake.api.cli import main
from overtake.controller.sidecar.auto import choose
from overtake.controller.sidecar.policies import BaselinePolicy, TablePolicy
from overtake.mdp import Policy
from overtake.mdp.rule_evaluation import evaluate_baseline

SCENARIO = {"arrival_rate": 0.5, "phase_info": "full", "tolerance": 0.005,
            "stages": [{"name": "preview", "service": {"hyperexponential": {"probs": [0.8, 0.2], "means": [0.25, 2.5]}},
                        "lock": 1},
                       {"name": "view", "service": {"exponential": {"mean": 0.6667}}}]}


def test_auto_weighs_a_locked_scenario_by_the_lock_model(tmp_path: Path) -> None:
    scen = tmp_path / "scenario.yaml"
    scen.write_text(yaml.safe_dump(SCENARIO))
    out = tmp_path / "full.npz"
    assert main(["solve", str(scen), "--out", str(out), "--quiet"]) == 0
    pol = Policy.load(out)
    assert pol.model.locks == (1, None)
    table = TablePolicy(pol, "full")
    locked_default = evaluate_baseline(pol.model, "pi(inf)", tol=0.005).metrics.mean_response_time
    plain = pol.model.__class__(pol.model.arrival_rate, pol.model.stages)
    ps_default = evaluate_baseline(plain, "pi(inf)", tol=0.005).metrics.mean_response_time
    assert table.passthrough_wait == pytest.approx(locked_default, rel=0.01)
    assert table.passthrough_wait is not None and table.passthrough_wait > 1.1 * ps_default
    assert table.predicted_wait is not None and table.predicted_wait < table.passthrough_wait
    c = choose([table], {"full"}, BaselinePolicy("passthrough", 2))
    assert c.policy is table
    assert c.predicted_gain == pytest.approx((locked_default - table.predicted_wait) / locked_default, rel=0.02)


def test_auto_weighs_blind_and_age_candidates_of_a_locked_scenario_by_the_lock_model(tmp_path: Path) -> None:
    """``--phase-info none`` and ``--cpu-priority age`` on a scenario with a lock: the blind
    policy's prediction, Apache's default and both age-priority figures (the locked stage exempt)
    are the lock model's, and auto weighs them."""
    scen = tmp_path / "scenario.yaml"
    scen.write_text(yaml.safe_dump({**SCENARIO, "phase_info": "none"}))
    out = tmp_path / "none.npz"
    assert main(["solve", str(scen), "--out", str(out), "--quiet", "--cpu-priority", "age"]) == 0
    pol = Policy.load(out)
    assert pol.model.locks == (1, None) and pol.phase_info == "none"
    table = TablePolicy(pol, "none")
    locked_default = evaluate_baseline(pol.model, "pi(inf)", tol=0.005).metrics.mean_response_time
    assert table.passthrough_wait == pytest.approx(locked_default, rel=0.01)
    assert table.predicted_wait is not None and table.predicted_wait < table.passthrough_wait
    age = table.priority_predictions["age"]
    assert age["exempt_stages"] == ["preview"]
    plain = pol.model.__class__(pol.model.arrival_rate, pol.model.stages)
    ps_default = evaluate_baseline(plain, "pi(inf)", tol=0.005).metrics.mean_response_time
    assert age["passthrough"] > 1.1 * ps_default  # the lock's, not processor sharing's
    c = choose([table], {"none"}, BaselinePolicy("passthrough", 2), cpu_priority="age")
    best = min(age["mean_response_time"], age["passthrough"])
    assert c.predicted_gain == pytest.approx((locked_default - best) / locked_default, rel=1e-9)
    assert (c.policy is table) == (age["mean_response_time"] < age["passthrough"])
