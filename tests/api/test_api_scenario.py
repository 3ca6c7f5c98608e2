"""The one scenario loader (api/scenario.py): files, ``{file: ...}`` services, one-line errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from overtake.api.cli import main
from overtake.api.scenario import file_resolver, load_scenario, resolve_scenario
from overtake.mdp.errors import ModelError

H2 = {"probs": [0.91, 0.09], "means": [0.55, 5.45]}


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


def test_a_fitted_file_is_the_stage_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(4).exponential(0.5, 500)
    np.savetxt(tmp_path / "db.txt", x)
    assert main(["fit", str(tmp_path / "db.txt"), "--order", "1", "--out", str(tmp_path / "fits")]) == 0
    capsys.readouterr()
    p = _write(tmp_path, "load: 0.5\nstages:\n  - name: web\n    service: {exponential: {mean: 1.0}}\n"
                         "  - name: db\n    service: {file: fits/db.json}\n")
    sc, model = load_scenario(p)
    # an order-1 PH fit is the exponential MLE: rate = 1 / sample mean
    assert model.stages[1].T[0, 0] == pytest.approx(-1 / x.mean(), rel=1e-6)
    assert sc.stages[1].service.ph is not None
    # the same scenario given inline builds the same model
    doc = json.loads((tmp_path / "fits" / "db.json").read_text())
    inline = {"load": 0.5, "stages": [{"name": "web", "service": {"exponential": {"mean": 1.0}}},
                                      {"name": "db", "service": {"ph": {"alpha": doc["alpha"], "T": doc["T"]}}}]}
    assert resolve_scenario(inline)[1].arrival_rate == model.arrival_rate


def test_resolve_leaves_its_input_alone(tmp_path: Path) -> None:
    (tmp_path / "f.json").write_text(json.dumps({"alpha": [1.0], "T": [[-2.0]]}))
    data = {"load": 0.5, "stages": [{"name": "a", "service": {"file": "f.json"}}]}
    before = copy.deepcopy(data)
    _, model = resolve_scenario(data, {"file": file_resolver(tmp_path)})
    assert data == before
    assert model.mean_service() == pytest.approx(0.5)


@pytest.mark.parametrize(("service", "content", "message"), [
    ("{file: nope.json}", None, r"stages\.0\.service\.file: .*nope\.json does not exist \(run `overtake fit` first\)"),
    ("{file: f.json}", "{not json", r"stages\.0\.service\.file: .*f\.json is not JSON"),
    ("{file: f.json}", '{"mean": 1}', r"stages\.0\.service\.file: .*has no 'alpha' and 'T'"),
    ("{file: f.json, exponential: {mean: 1}}", None, r"stages\.0\.service: give file alone, not with exponential"),
    ("{fit: {id: x, stage: a}}", None, r"stages\.0\.service\.fit: unknown key"),  # the API's kind, not a file's
])
def test_bad_services_are_one_line_naming_the_field(tmp_path: Path, service: str, content: str | None,
                                                    message: str) -> None:
    if content is not None:
        (tmp_path / "f.json").write_text(content)
    p = _write(tmp_path, f"load: 0.5\nstages:\n  - name: a\n    service: {service}\n")
    with pytest.raises(ModelError, match=message) as info:
        load_scenario(p)
    assert "\n" not in str(info.value)


def test_bad_yaml_names_the_file(tmp_path: Path) -> None:
    p = _write(tmp_path, "load: [0.5\n")
    with pytest.raises(ModelError, match=r"s\.yaml: not valid YAML"):
        load_scenario(p)


def test_table1_files_load_with_the_papers_load() -> None:
    # van der Weij et al., "Dynamic thread assignment", Table 1, case 4: two H2 stages (mean 0.991 each) at rho = 0.6
    sc, model = load_scenario(Path(__file__).resolve().parents[2] / "examples" / "table1" / "case04.yaml")
    assert model.load == pytest.approx(0.6)
    assert model.arrival_rate == pytest.approx(0.6 / (2 * (0.91 * 0.55 + 0.09 * 5.45)))
    assert sc.stages[0].service.hyperexponential is not None
    assert sc.stages[0].service.hyperexponential.to_dict() == H2
