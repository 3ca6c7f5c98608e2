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
    assert main(["fit", str(bad), "--paired", "--order", "auto"]) == 2
    assert "--paired: --order auto is not supported" in capsys.readouterr().err
