"""Scenario validation and the CLI's one-line errors (exit code 2)."""

from __future__ import annotations

import json

import pytest

from overtake.api.cli import main
from overtake.mdp.errors import ModelError
from overtake.mdp.scenario import parse_scenario

GOOD = {"load": 0.6, "stages": [{"name": "a", "service": {"exponential": {"mean": 1.0}}},
                                {"name": "b", "service": {"hyperexponential": {"probs": [0.91, 0.09], "means": [0.55, 5.45]}}}]}


def test_load_uses_exact_means():
    m = parse_scenario(GOOD).build_model()
    assert m.arrival_rate == pytest.approx(0.6 / (1.0 + 0.991))


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"load": 1.2}, "load must be < 1"),
        ({"colour": 1}, "colour: unknown key"),
        ({"stages": [{"name": "a", "service": {"ph": {"alpha": [0.5, 0.4], "T": [[-1, 0], [0, -1]]}}}]}, "alpha must sum to 1"),
        ({"stages": [{"name": "a", "service": {"ph": {"alpha": [1.0], "T": [[0.0]]}}}]}, r"T\[0,0\] must be < 0"),
        ({"stages": [{"name": "a", "service": {"ph": {"alpha": [1, 0], "T": [[-1, 2], [0, -1]]}}}]}, "row sum must be <= 0"),
        ({"stages": [{"name": "a", "service": {"exponential": {"mean": -1}}}]}, "stages.0.service.exponential.mean"),
        ({"stages": [{"name": "a", "service": {}}]}, "exactly one of"),
    ],
)
def test_invalid_scenarios_name_the_field(patch, field):
    data = {**GOOD, **patch}
    with pytest.raises(ModelError, match=field):
        parse_scenario(data).build_model()


def test_cli_reports_one_line_and_exit_2(tmp_path, capsys):
    p = tmp_path / "s.yaml"
    p.write_text("load: 1.5\nstages:\n  - name: a\n    service: {exponential: {mean: 1}}\n")
    assert main(["compare", str(p), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "load must be < 1" in err[0]


def test_cli_compare_json_contract(tmp_path, capsys):
    p = tmp_path / "s.yaml"
    p.write_text(
        "load: 0.5\ntolerance: 0.001\nstages:\n"
        "  - name: a\n    service: {exponential: {mean: 1}}\n"
        "  - name: b\n    service: {exponential: {mean: 1}}\n"
    )
    assert main(["compare", str(p), "--json", "--quiet", "--policy", "pi(2)"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["policies"]) == {"pi*", "pi(1)", "pi(4)", "pi(inf)", "pi(1,1)", "pi(2)"}
    for v in doc["policies"].values():
        assert {"mean_response_time", "mean_in_system", "mean_threads", "blocking_probability"} <= set(v)
    assert doc["arrival_rate"] == pytest.approx(0.25)
    # exponential stages: π* = π(1) (gain 0 up to the truncation tolerance), π(∞) = PS
    assert abs(doc["gains"]["pi(1)"]) < 2e-3
    assert doc["policies"]["pi(inf)"]["mean_response_time"] == pytest.approx(2.0 / 0.5, rel=2e-3)


def test_cli_solve_writes_a_loadable_policy(tmp_path, capsys):
    from overtake.mdp.policy import Policy

    p = tmp_path / "s.yaml"
    p.write_text(
        "load: 0.5\ntruncation: {max_requests: 6, max_threads: 3}\nstages:\n"
        "  - name: a\n    service: {hyperexponential: {probs: [0.9, 0.1], means: [0.5, 5.0]}}\n"
        "  - name: b\n    service: {exponential: {mean: 1}}\n"
    )
    out = tmp_path / "pol.npz"
    assert main(["solve", str(p), "--out", str(out), "--quiet"]) == 0
    pol = Policy.load(out)
    assert pol.max_requests == 6 and pol.max_threads == 3
    assert 0.5 < pol.meta["rules"]["agreement"] <= 1.0
