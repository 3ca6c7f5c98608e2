"""mdp.lever: the CPU-priority lever's predictions stored by ``overtake solve --cpu-priority``.

Known answers: on one M/G/1 stage the age lever's π(∞) prediction is the exact multilevel-PS
mean (Kleinrock–Muntz–Rodemich) at the threshold the visit model chose; class priority needs
the phases, and says so.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from mdp_helpers import h2_stage, tandem

from overtake.api.cli import main
from overtake.mdp import Truncation
from overtake.mdp.errors import ModelError
from overtake.mdp.lever import predict_lever
from overtake.mdp.observed import solve_observed
from overtake.mdp.priority import mlps_mean
from overtake.mdp.truncation import solve_optimal


@pytest.fixture(scope="module")
def h2():  # type: ignore[no-untyped-def]
    return tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45))


def test_age_prediction_of_passthrough_is_the_mlps_mean(h2) -> None:  # type: ignore[no-untyped-def]
    opt = solve_optimal(h2, truncation=Truncation(12, 4))
    pr = predict_lever(h2, opt.policy, "age", requests=200_000, seeds=2, seed=3)
    a = pr.priority.thresholds[0][0]
    exact = mlps_mean(h2.stages[0], h2.arrival_rate, [a])  # strict priority; SCHED_IDLE's 3/1024 is ~strict
    assert pr.passthrough is not None and pr.passthrough_ci95 is not None
    assert abs(pr.passthrough - exact) <= 1.5 * pr.passthrough_ci95 + 0.005 * exact
    assert pr.passthrough < h2.stages[0].mean() / (1 - h2.load)  # beats PS, E[S]/(1-ρ)
    meta = pr.to_meta()
    assert meta["kind"] == "age" and meta["thresholds"] == [[a]] and json.loads(json.dumps(meta)) == meta


def test_class_prediction_needs_the_phases(h2) -> None:  # type: ignore[no-untyped-def]
    obs = solve_observed(h2, phase_info="none", truncation=Truncation(8, 3))
    with pytest.raises(ModelError, match="phase_info 'none'.*use age"):
        predict_lever(h2, obs.policy, "class")
    full = solve_optimal(h2, truncation=Truncation(8, 3)).policy
    pr = predict_lever(h2, full, "class", requests=20_000, seeds=1)
    assert pr.priority.start_levels == ((0, 1),) and pr.passthrough is None
    assert pr.to_meta()["thresholds"] == [[None]]  # never demoted by age: JSON null, not Infinity
    with pytest.raises(ModelError, match="expected one of age, class"):
        predict_lever(h2, full, "nice")


def test_cli_solve_stores_the_predictions(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from overtake.mdp import Policy

    scen = tmp_path / "s.yaml"
    scen.write_text("load: 0.5\nstages:\n  - name: a\n    service: {hyperexponential: {probs: [0.9, 0.1], "
                    "means: [0.5, 5.5]}}\n")
    out = tmp_path / "p.npz"
    assert main(["solve", str(scen), "--out", str(out), "--quiet", "--cpu-priority", "age,class"]) == 0
    doc = json.loads(capsys.readouterr().out)
    meta = Policy.load(out).meta["cpu_priority"]
    assert set(doc["cpu_priority"]) == set(meta) == {"age", "class"}
    assert np.isfinite(meta["age"]["passthrough"]) and meta["class"]["start_levels"] == [[0, 1]]
    assert main(["solve", str(scen), "--out", str(out), "--phase-info", "none", "--cpu-priority", "class"]) != 0
    assert "--cpu-priority class" in capsys.readouterr().err
