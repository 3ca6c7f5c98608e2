"""A 202 says where to poll (``Location``), and two different jobs never share a name.

Before: the 202 had no ``Location``, and a model's default name was its stages and load only, so
two scenarios differing in a service time (or posted under one ``name``) showed the same name on
the page.
"""

from __future__ import annotations

import html
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from support.api_helpers import exp2

from overtake.api.app import create_app
from overtake.api.db import Store
from overtake.api.deps import Settings, unique_name


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("names") / "api.db"


@pytest.fixture(scope="module")
def client(db: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(db=str(db)))) as c:
        yield c


def _slower_back(mean: float) -> dict:
    sc = exp2(0.3)
    sc["stages"][1]["service"] = {"exponential": {"mean": mean}}
    return sc


def _accepted(r) -> dict:  # type: ignore[no-untyped-def]
    assert r.status_code == 202, r.text
    doc: dict = r.json()
    assert r.headers["location"] == doc["url"]
    return doc


def test_202_location_points_at_the_job(client: TestClient) -> None:
    posts = [
        client.post("/v1/models", json=exp2(0.3)),
        client.post("/v1/fits", json={"samples": [0.5, 1.5, 2.5], "order": 1}),
        client.post("/v1/fits", data={"kind": "csv", "order": "1"},
                    files={"file": ("d.txt", io.BytesIO(b"0.5\n1.5\n2.5\n"), "text/plain")}),
    ]
    for r in posts:
        doc = _accepted(r)
        polled = client.get(r.headers["location"])
        assert polled.status_code == 200 and polled.json()["id"] == doc["id"]


def test_openapi_declares_the_location_header(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/models", "/v1/fits"):
        assert "Location" in paths[path]["post"]["responses"]["202"]["headers"]


def test_different_models_get_different_names_on_the_page(client: TestClient) -> None:
    # same stages and load (the old default name), different service: different models
    a = _accepted(client.post("/v1/models", json=_slower_back(1.0)))
    b = _accepted(client.post("/v1/models", json=_slower_back(1.5)))
    # one name given to two different scenarios
    c = _accepted(client.post("/v1/models", json=_slower_back(1.0), params={"name": "mine"}))
    d = _accepted(client.post("/v1/models", json=_slower_back(2.0), params={"name": "mine"}))
    # the same scenario posted again is the same model: the same name
    e = _accepted(client.post("/v1/models", json=_slower_back(1.0)))
    names = {j["id"]: client.get(j["url"]).json()["name"] for j in (a, b, c, d, e)}
    assert len({names[a["id"]], names[b["id"]], names[c["id"]], names[d["id"]]}) == 4, names
    assert names[e["id"]] == names[a["id"]]
    assert names[a["id"]].startswith("front + back @ rho 0.3") and names[c["id"]].startswith("mine")
    page = html.unescape(client.get("/").text)
    for n in names.values():
        assert n in page


def test_different_fits_get_different_names(client: TestClient) -> None:
    f1 = _accepted(client.post("/v1/fits", json={"samples": {"db": [0.5, 1.5]}, "order": 1}))
    f2 = _accepted(client.post("/v1/fits", json={"samples": {"db": [0.5, 1.6]}, "order": 1}))
    f3 = _accepted(client.post("/v1/fits", json={"samples": {"db": [0.5, 1.5]}, "order": 2}))
    names = [client.get(f["url"]).json()["name"] for f in (f1, f2, f3)]
    assert len(set(names)) == 3 and all(n.startswith("db · ") for n in names), names


def test_a_taken_name_gets_a_longer_hash(db: Path) -> None:
    store = Store(str(db))
    digest, other = "ab" * 32, "ab" * 4 + "cd" * 28  # same first 8 hex digits
    store.create("model", f"x · {other[:8]}", {"digest": other})
    assert unique_name(store, "model", "x", digest) == f"x · {digest[:16]}"
    assert unique_name(store, "model", "x", other) == f"x · {other[:8]}"  # its own name
