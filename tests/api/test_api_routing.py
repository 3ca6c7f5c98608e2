"""The REST API takes a scenario's ``routing`` as the command line does: the matrices, or the
document ``overtake fit --paired`` writes; a file reference is refused (the server reads no
files), and a bad form gets the command line's message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient

from overtake.api.app import Settings, create_app
from overtake.api.scenario import load_scenario
from overtake.fitting.coupled import CoupledPH
from overtake.fitting.phase_type import PhaseType
from overtake.mdp.errors import ModelError

COUPLED = CoupledPH.build(PhaseType([0.8, 0.2], np.diag([-2.0, -1.0 / 3.0])), np.diag([-1.0 / 0.6, -1.0 / 3.5]),
                          np.array([[0.9, 0.1], [0.4, 0.6]]))


def _scenario(routing: Any) -> dict[str, Any]:
    doc = COUPLED.to_dict()
    return {"load": 0.5, "truncation": {"max_requests": 6, "max_threads": 3}, "routing": routing,
            "stages": [{"name": n, "service": {"ph": st}} for n, st in zip(("preview", "view"), doc["stages"])]}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("api") / "jobs.db"
    with TestClient(create_app(Settings(db=str(db), max_states=50_000))) as c:
        yield c


def _cli_error(tmp_path: Path, routing: Any) -> str:
    (tmp_path / "sc.yaml").write_text(yaml.safe_dump(_scenario(routing)))
    with pytest.raises(ModelError) as err:
        load_scenario(tmp_path / "sc.yaml")
    return str(err.value)


def test_the_fit_document_is_taken_as_the_matrices(client: TestClient, tmp_path: Path) -> None:
    matrices = [COUPLED.routing.tolist()]
    document = {"routing": matrices, "stages": ["preview", "view"], "correlation": COUPLED.correlation()}
    for routing in (matrices, document):
        r = client.post("/v1/models", json=_scenario(routing))
        assert r.status_code == 202, r.text
    (tmp_path / "routing.json").write_text(json.dumps(document))
    (tmp_path / "sc.yaml").write_text(yaml.safe_dump(_scenario({"file": "routing.json"})))
    _, model = load_scenario(tmp_path / "sc.yaml")
    assert np.allclose(model.routing[0], matrices[0])


@pytest.mark.parametrize("routing", [{"matrix": [[[1.0]]]}, {"file": "r.json", "x": 1}])
def test_a_bad_form_gets_the_command_lines_message(client: TestClient, tmp_path: Path, routing: Any) -> None:
    r = client.post("/v1/models", json=_scenario(routing))
    assert r.status_code == 422
    assert r.json()["detail"] == _cli_error(tmp_path, routing)
    assert "routing: give the matrices" in r.json()["detail"]


def test_a_file_reference_is_refused_naming_the_fix(client: TestClient) -> None:
    r = client.post("/v1/models", json=_scenario({"file": "/etc/passwd"}))
    assert r.status_code == 422
    assert r.json()["detail"].startswith("routing.file: this server reads no files; send the file's content")
