"""OpenAPI fuzzing with schemathesis against a running ``overtake api``: no 5xx on generated input,
only documented status codes, responses that match their schemas.

The server runs with a small state-space cap and queue so that generated scenarios that happen to
be valid solve in well under a second (or are refused with 413/429), keeping the run short.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance
from support.api_helpers import live_api


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    with live_api(db, "--max-states", "3000", "--max-queued", "4") as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(base: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(base + "/openapi.json")


@pytest.mark.slow  # every operation's generated cases against a live API
def test_no_server_errors_on_generated_input(api_schema: schemathesis.BaseSchema) -> None:
    ops = [r.ok() for r in api_schema.get_all_operations()]
    assert len(ops) >= 12
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=(not_a_server_error, status_code_conformance, response_schema_conformance))

        check()


def test_schema_documents_the_state_format(api_schema: schemathesis.BaseSchema) -> None:
    raw = api_schema.raw_schema
    params = raw["paths"]["/v1/models/{model_id}/decision"]["get"]["parameters"]
    state = next(p for p in params if p["name"] == "state")
    assert "waiting" in state["description"] and "threads" in state["description"]
    body = raw["paths"]["/v1/models"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    # the scenario schema is the CLI's pydantic model (mdp.scenario_schema.Scenario)
    assert set(body["properties"]) >= {"load", "arrival_rate", "stages", "truncation", "tolerance"}
    assert "StageSpec" in raw["components"]["schemas"]
