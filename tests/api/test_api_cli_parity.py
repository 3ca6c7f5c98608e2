"""The API and the CLI answer the same scenario with the same document (one loader, one truncation).

van der Weij et al., "Dynamic thread assignment", Table 1, case 4 (two H2 stages at ρ = 0.6)
through ``POST /v1/models`` and through
``overtake compare --json``: the same auto-truncation, the same E[W] (4.3412 to the printed
digits), the same baselines; and the API's state estimate admits it (the real count is 68,355).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from support.api_helpers import REPO, wait

from overtake.api.app import Settings, create_app
from overtake.api.cli import main

CASE04 = REPO / "examples" / "table1" / "case04.yaml"


def _numbers(doc: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a document by its path, wall-clock times left out."""
    if isinstance(doc, dict):
        return {k: v for key, val in doc.items() if key != "seconds" for k, v in _numbers(val, f"{path}/{key}").items()}
    if isinstance(doc, list):
        return {k: v for i, val in enumerate(doc) for k, v in _numbers(val, f"{path}/{i}").items()}
    return {path: doc}


@pytest.mark.timeout(1200)  # the API's job may take up to its 900 s wait
@pytest.mark.slow
def test_case04_through_the_api_is_the_clis_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with TestClient(create_app(Settings(db=str(tmp_path / "jobs.db")))) as client:
        r = client.post("/v1/models", json=yaml.safe_load(CASE04.read_text()))
        assert r.status_code == 202, r.text
        api = wait(client, r.json()["url"], timeout=900)
    assert api["status"] == "done", api["reason"]
    assert main(["compare", str(CASE04), "--json", "--quiet"]) == 0
    cli = json.loads(capsys.readouterr().out)

    assert f"{cli['policies']['pi*']['mean_response_time']:.4f}" == "4.3412"
    assert api["metrics"] == api["comparison"]["policies"]["pi*"]
    a, c = _numbers(api["comparison"]), _numbers(cli)
    assert a.keys() == c.keys()
    for key, v in c.items():  # two processes, the same arithmetic
        assert a[key] == (pytest.approx(v, rel=1e-9, abs=1e-12) if isinstance(v, float) else v), key
    assert (cli["truncation"]["max_requests"], cli["truncation"]["max_threads"], cli["states"]) == (13, 4, 68_355)

    # the estimate the API admitted the job on, against the largest MDP the solve built
    largest = max(t["states"] for t in cli["truncation"]["trace"] if "check" not in t)
    assert largest == 68_355
    assert api["estimated_states"] == 68_355  # count(13 requests, 4 threads): the cap and threads it settled on
