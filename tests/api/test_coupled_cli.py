"""``overtake fit --paired`` → a scenario with ``routing: {file: routing.json}`` → ``solve``/``compare``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from overtake.api.cli import main
from overtake.fitting.coupled import CoupledPH
from overtake.fitting.phase_type import PhaseType
from overtake.mdp.policy import Policy

TRUE = CoupledPH.build(PhaseType([0.8, 0.2], np.diag([-2.0, -1.0 / 3.0])), np.diag([-1.0 / 0.6, -1.0 / 3.5]),
                       np.array([[0.9, 0.1], [0.4, 0.6]]))


@pytest.fixture()
def fitted(tmp_path: Path) -> Path:
    x, y = TRUE.rvs(3000, random_state=5)
    src = tmp_path / "pairs.csv"
    src.write_text("preview,view\n" + "".join(f"{a:.6f},{b:.6f}\n" for a, b in zip(x, y)))
    assert main(["fit", str(src), "--paired", "--name", "preview,view", "--structure", "hyperexp", "--order", "2",
                 "--out", str(tmp_path / "fits")]) == 0
    (tmp_path / "sc.yaml").write_text(
        "load: 0.6\nstages:\n  - {name: preview, service: {file: fits/preview.json}}\n"
        "  - {name: view, service: {file: fits/view.json}}\nrouting: {file: fits/routing.json}\n"
        "truncation: {max_requests: 8, max_threads: 3}\n")
    return tmp_path


def test_paired_fit_writes_stages_and_routing(fitted: Path) -> None:
    doc = json.loads((fitted / "fits" / "routing.json").read_text())
    R = np.asarray(doc["routing"][0])
    assert R.shape == (2, 2) and np.allclose(R.sum(axis=1), 1)
    assert doc["loglik"] > doc["loglik_independent"] + 20
    assert doc["correlation"] == pytest.approx(TRUE.correlation(), abs=0.06)
    # phases by mean: the short phase first in both stages, and the routing keeps short with short
    first = json.loads((fitted / "fits" / "preview.json").read_text())
    assert np.diag(first["T"])[0] < np.diag(first["T"])[1] and R[0, 0] > 0.8


def test_solve_and_compare_take_the_routing(fitted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = fitted / "sc.yaml"
    assert main(["solve", str(sc), "--out", str(fitted / "pol.npz"), "--quiet"]) == 0
    pol = Policy.load(fitted / "pol.npz")
    routing = json.loads((fitted / "fits" / "routing.json").read_text())["routing"]
    assert pol.model.coupled and np.allclose(pol.model.routing, routing)
    capsys.readouterr()
    assert main(["compare", str(sc), "--json", "--quiet"]) == 0
    assert "pi*" in json.loads(capsys.readouterr().out)["policies"]
    assert main(["compare", str(sc), "--phase-info", "none", "--quiet"]) == 2
    assert "routing: coupled stages are compared with phase_info full or start" in capsys.readouterr().err
    assert main(["solve", str(sc), "--phase-info", "start", "--out", str(fitted / "s.npz"), "--quiet"]) == 2
    assert "policy for phase_info full only" in capsys.readouterr().err


def test_bad_routing_files_and_pairs(fitted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = fitted / "sc.yaml"
    sc.write_text(sc.read_text().replace("fits/routing.json", "fits/nope.json"))
    assert main(["compare", str(sc), "--quiet"]) == 2
    assert "routing.file:" in capsys.readouterr().err
    bad = fitted / "bad.csv"
    bad.write_text("1.0,2.0\n1.0,2.0,3.0\n")
    assert main(["fit", str(bad), "--paired", "--order", "2"]) == 2
    assert "bad.csv:2: a transaction is two durations" in capsys.readouterr().err
    assert main(["fit", str(bad), "--paired", "--order", "2", "--censor-at", "1"]) == 2
    assert "--paired: --censor-at is not supported with paired samples" in capsys.readouterr().err


def test_paired_fit_with_floors_and_orders_by_bic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Known floors 20 and 30 ms under the coupled bodies: recovered, the orders by BIC within
    --max-states, the routing between the bodies, and the scenario solves."""
    bodies = CoupledPH.build(PhaseType([0.8, 0.2], np.diag([-1 / 0.01, -1 / 0.08])),
                             np.diag([-1 / 0.015, -1 / 0.12]), np.array([[0.9, 0.1], [0.4, 0.6]]))
    x, y = bodies.rvs(3000, random_state=1)
    src = tmp_path / "pairs.csv"
    src.write_text("".join(f"{a + 0.02:.6f},{b + 0.03:.6f}\n" for a, b in zip(x, y)))
    assert main(["fit", str(src), "--paired", "--name", "preview,view", "--structure", "hyperexp", "--order", "auto",
                 "--shift", "auto", "--out", str(tmp_path / "fits")]) == 0
    out = capsys.readouterr().out
    assert "floor 0.02" in out and "(before the body)" in out and "(after the body)" in out
    doc = json.loads((tmp_path / "fits" / "routing.json").read_text())
    assert doc["shifts"] == pytest.approx([0.02, 0.03], abs=0.001)
    assert np.asarray(doc["routing_bodies"]) == pytest.approx(np.array([[0.9, 0.1], [0.4, 0.6]]), abs=0.07)
    for name, floor in (("preview", 0.02), ("view", 0.03)):
        st = json.loads((tmp_path / "fits" / f"{name}.json").read_text())
        assert st["structure"] == "shifted" and st["order"] == 3  # body 2 (BIC) + floor 1: the default budget
        assert st["shift"]["shift"] == pytest.approx(floor, abs=0.001) and st["shift"]["body_order"] == 2
    (tmp_path / "sc.yaml").write_text(
        "load: 0.6\nstages:\n  - {name: preview, service: {file: fits/preview.json}}\n"
        "  - {name: view, service: {file: fits/view.json}}\nrouting: {file: fits/routing.json}\n"
        "truncation: {max_requests: 6, max_threads: 3}\n")
    assert main(["solve", str(tmp_path / "sc.yaml"), "--out", str(tmp_path / "pol.npz"), "--quiet"]) == 0
    assert Policy.load(tmp_path / "pol.npz").model.coupled
    assert main(["fit", str(src), "--paired", "--order", "auto", "--max-states", "3", "--shift", "auto"]) == 2
    assert "not even order 1 fits" in capsys.readouterr().err
