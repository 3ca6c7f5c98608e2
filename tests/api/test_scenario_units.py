"""The time unit from the fit through the scenario into the policy file.

``overtake fit`` writes seconds (``time_unit: 1``); a scenario built on fits takes their unit, a
hand-written one says its own (``time_unit: SECONDS`` or ``model``, the default: an abstract
unit); ``overtake solve --out`` stores it in the policy's metadata and prints it, with each
stage's phases named by mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from overtake.api.cli import main
from overtake.api.scenario import ServiceResolver, file_resolver, load_scenario, resolve_scenario
from overtake.mdp import Policy
from overtake.mdp.errors import ModelError

REPO = Path(__file__).resolve().parents[2]
H2 = "{hyperexponential: {probs: [0.9, 0.1], means: [0.01, 0.2]}}"


def _fit(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str = "search") -> Path:
    rng = np.random.default_rng(3)
    x = np.where(rng.random(2000) < 0.9, rng.exponential(0.01, 2000), rng.exponential(0.2, 2000))
    np.savetxt(tmp_path / f"{name}.txt", x)
    assert main(["fit", str(tmp_path / f"{name}.txt"), "--order", "2", "--out", str(tmp_path / "fits")]) == 0
    capsys.readouterr()
    return tmp_path / "fits" / f"{name}.json"


def _scenario(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "scenario.yaml"
    p.write_text(text)
    return p


def test_a_scenario_on_fits_is_in_seconds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fit(tmp_path, capsys)
    sc, _ = load_scenario(_scenario(tmp_path, "load: 0.5\nstages:\n  - {name: search, service: {file: fits/search.json}}\n"
                                              f"  - {{name: db, service: {H2}}}\n"))
    assert sc.time_unit == 1.0  # hand-written services beside fits are read in the fits' unit


def test_hand_written_scenarios_say_their_unit(tmp_path: Path) -> None:
    base = f"load: 0.5\nstages:\n  - {{name: a, service: {H2}}}\n"
    assert load_scenario(_scenario(tmp_path, base))[0].time_unit == "model"  # not given: abstract
    assert load_scenario(_scenario(tmp_path, base + "time_unit: 0.001\n"))[0].time_unit == 0.001
    for case in sorted((REPO / "examples" / "table1").glob("case*.yaml")):
        assert load_scenario(case)[0].time_unit == "model", case.name  # the paper's unit, declared
    with pytest.raises(ModelError, match=r"^time_unit: "):
        load_scenario(_scenario(tmp_path, base + "time_unit: -1\n"))


def test_units_that_disagree_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fit = json.loads(_fit(tmp_path, capsys).read_text())
    text = "load: 0.5\nstages:\n  - {name: search, service: {file: fits/search.json}}\n"
    with pytest.raises(ModelError, match=r"^time_unit: the fitted stages \(stages.0.service.file\) are in units of 1 s "
                                         r"but the scenario says 0.01; remove time_unit"):
        load_scenario(_scenario(tmp_path, text + "time_unit: 0.01\n"))
    assert load_scenario(_scenario(tmp_path, text + "time_unit: 1\n"))[0].time_unit == 1.0
    (tmp_path / "fits" / "ms.json").write_text(json.dumps({**fit, "time_unit": 0.001}))
    with pytest.raises(ModelError, match=r"^stages.1.service.file: fitted in units of 0.001 s but "
                                         r"stages.0.service.file in units of 1 s"):
        load_scenario(_scenario(tmp_path, text + "  - {name: ms, service: {file: fits/ms.json}}\n"))
    # a fit written before fits recorded their unit was in seconds (overtake fit always wrote seconds)
    old = {k: v for k, v in fit.items() if k != "time_unit"}
    sc, _ = resolve_scenario({"load": 0.5, "stages": [{"name": "a", "service": {"file": "old.json"}}]},
                             {"file": _file(tmp_path, old)})
    assert sc.time_unit == 1.0


def _file(tmp_path: Path, doc: dict[str, object]) -> ServiceResolver:
    (tmp_path / "old.json").write_text(json.dumps(doc))
    return file_resolver(tmp_path)


def test_solve_stores_the_unit_and_names_the_phases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fit(tmp_path, capsys)
    scen = _scenario(tmp_path, "load: 0.5\nstages:\n  - {name: search, service: {file: fits/search.json}}\n")
    out = tmp_path / "p.npz"
    assert main(["solve", str(scen), "--out", str(out)]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    pol = Policy.load(out)
    assert pol.meta["time_unit"] == 1.0 and doc["time_unit"] == 1.0
    assert doc["mean_response_time_seconds"] == pytest.approx(doc["mean_response_time"])
    ph = doc["phases"]["search"]
    assert [p["name"] for p in ph] == ["short", "long"] and ph[0]["mean"] < ph[1]["mean"]
    assert "search: phase 1 short (starts" in cap.err and "phase 2 long" in cap.err
    # the paper's cases stay in their unit: the policy says so, and no seconds are made up
    out2 = tmp_path / "case04.npz"
    assert main(["solve", str(REPO / "examples" / "table1" / "case04.yaml"), "--out", str(out2), "--quiet"]) == 0
    doc2 = json.loads(capsys.readouterr().out)
    assert Policy.load(out2).meta["time_unit"] == "model" and doc2["mean_response_time_seconds"] is None


def test_the_api_stores_the_fits_unit_in_its_policy(tmp_path: Path) -> None:
    """POST /v1/fits, then a model on that fit: its policy.npz carries the fit's unit (seconds),
    which a sidecar following policy_url takes; a hand-written model says model units."""
    from fastapi.testclient import TestClient
    from support.api_helpers import exp2, wait

    from overtake.api.app import Settings, create_app

    x = np.random.default_rng(8).exponential(0.02, 300)
    with TestClient(create_app(Settings(db=str(tmp_path / "jobs.db"), max_states=50_000))) as client:
        fit = wait(client, client.post("/v1/fits", json={"samples": {"a": x.tolist()}, "order": 1}).json()["url"])
        assert fit["stages"]["a"]["time_unit"] == 1.0 and fit["stages"]["a"]["phases"][0]["name"] == "1"
        sc = {"load": 0.3, "truncation": {"max_requests": 6},
              "stages": [{"name": "a", "service": {"fit": {"id": fit["id"], "stage": "a"}}}]}
        units = {}
        for name, body in (("fit", sc), ("hand", exp2(0.3))):
            doc = wait(client, client.post("/v1/models", json=body).json()["url"])
            assert doc["status"] == "done", doc
            blob = client.get(f"/v1/models/{doc['id']}/policy.npz").content
            (tmp_path / f"{name}.npz").write_bytes(blob)
            units[name] = Policy.load(tmp_path / f"{name}.npz").meta["time_unit"]
    assert units == {"fit": 1.0, "hand": "model"}
