"""Hostile input to the REST API gets a clear 4xx at once: unbounded numbers, a load
whose exact solve would not end, JSON nested 100,000 deep, bodies over the cap (chunked too), an
access log whose lines a backtracking matcher would split in exponentially many ways."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from support.api_helpers import exp2, live_api

from overtake.api.app import create_app
from overtake.api.deps import MAX_JSON_BYTES, Settings

EXP = {"exponential": {"mean": 1.0}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    app = create_app(Settings(db=str(tmp_path_factory.mktemp("limits") / "api.db")))
    with TestClient(app) as c:
        yield c


def _post(c: TestClient, body: object) -> tuple[int, str]:
    r = c.post("/v1/models", content=json.dumps(body), headers={"content-type": "application/json"})
    return r.status_code, r.json()["detail"]


@pytest.mark.parametrize(("body", "field"), [
    ({"load": 0.6, "stages": [{"name": "a", "service": EXP}], "truncation": {"max_requests": 10, "max_threads": 10**9}},
     "truncation.max_threads"),
    ({"load": 0.6, "stages": [{"name": "a", "service": EXP}], "max_threads": 10**9}, "max_threads"),
    ({"load": 0.999999999, "stages": [{"name": "a", "service": EXP}]}, "load"),
    ({"arrival_rate": 0.995, "stages": [{"name": "a", "service": EXP}]}, "arrival_rate"),
    ({"load": 0.6, "stages": [{"name": "a", "service": EXP}], "tolerance": 1e-15}, "tolerance"),
    ({"load": 0.6, "stages": [{"name": "a", "service": {"hyperexponential": {"probs": [1 / 100] * 100,
                                                                             "means": [1.0] * 100}}}]},
     "stages.0.service.hyperexponential.probs"),
])
def test_unbounded_numbers_are_refused_naming_the_field(client: TestClient, body: object, field: str) -> None:
    code, detail = _post(client, body)
    assert code == 422 and detail.startswith(field), detail


def test_deep_json_is_a_422_not_a_500(client: TestClient) -> None:
    r = client.post("/v1/models", content="[" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "nested too deeply" in r.json()["detail"]


def _chunked(head: bytes, filler: bytes, mib: int, tail: bytes) -> Iterator[bytes]:
    """A body sent chunked (no Content-Length): head, ``mib`` MiB of ``filler``, tail."""
    yield head
    for _ in range(mib):
        yield filler * ((1 << 20) // len(filler))
    yield tail


def test_bodies_over_the_cap_are_refused_declared_or_chunked(client: TestClient) -> None:
    big = b'{"pad": "' + b"x" * (MAX_JSON_BYTES + 10) + b'"}'
    r = client.post("/v1/models", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    body = _chunked(b'{"pad": "', b"x", MAX_JSON_BYTES // (1 << 20) + 2, b'"}')
    r = client.post("/v1/models", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than the limit" in r.json()["detail"]


def test_fits_count_chunked_uploads_too(client: TestClient) -> None:
    from overtake.api.routes.fits import MAX_UPLOAD_BYTES

    body = _chunked(b'{"samples": [', b"1.0,", MAX_UPLOAD_BYTES // (1 << 20) + 2, b"1.0]}")
    assert client.post("/v1/fits", content=body, headers={"content-type": "application/json"}).status_code == 413


def test_a_sane_model_still_passes(client: TestClient, tmp_path: Path) -> None:
    code = client.post("/v1/models", json={"load": 0.5, "stages": [{"name": "a", "service": EXP}],
                                           "truncation": {"max_requests": 6}}).status_code
    assert code == 202


def test_one_large_body_is_received_at_a_time(tmp_path: Path) -> None:
    """Past LARGE_BODY_BYTES a body needs the app's one permit: with it held elsewhere (no permit
    left) a larger body is a 503 naming the limit while a small one passes; the permit comes
    back after a body read whole and after one refused for the cap."""
    import asyncio

    from overtake.api.deps import LARGE_BODY_BYTES

    bad = b'{"samples": "' + b"x" * (LARGE_BODY_BYTES + (1 << 20)) + b'"'  # read whole, then 422 (not JSON)
    small = {"load": 0.5, "stages": [{"name": "a", "service": EXP}], "truncation": {"max_requests": 6}}
    app = create_app(Settings(db=str(tmp_path / "api.db"), request_deadline=2))
    with TestClient(app) as c:
        def fit(body: bytes) -> tuple[int, str]:
            r = c.post("/v1/fits", content=body, headers={"content-type": "application/json"})
            return r.status_code, r.json()["detail"]

        app.state.large_body = asyncio.Semaphore(0)  # another large upload holds the permit
        code, detail = fit(bad)
        assert code == 503 and detail.startswith("body: other uploads over") and "(2 s)" in detail
        assert c.post("/v1/models", json=small).status_code == 202
        app.state.large_body = asyncio.Semaphore(1)
        assert fit(bad)[0] == 422
        over = _chunked(b'{"pad": "', b"x", MAX_JSON_BYTES // (1 << 20) + 2, b'"}')
        assert c.post("/v1/models", content=over, headers={"content-type": "application/json"}).status_code == 413
        code, detail = fit(bad)
        assert code == 422 and detail.startswith("body: not valid JSON"), detail


#: twelve free-text fields side by side, then the path and the duration; a line of 28 words
#: (57 bytes) without a duration: a backtracking matcher tries every split of the words between
#: the fields (about 20 s here, x1.7 per extra word)
HOSTILE_FORMAT = " ".join(["%{X}i"] * 12) + " %U %D"
HOSTILE_LINE = "a " * 28 + "\n"


def test_a_log_line_that_would_backtrack_holds_up_neither_its_upload_nor_other_posts(tmp_path: Path) -> None:
    """Three such uploads (more than the parse processes) and models posted meanwhile: all are
    answered within the request deadline (5 s, against milliseconds for the linear matcher)."""
    assert len(HOSTILE_LINE.encode()) == 57
    ok = " ".join(["-"] * 12)
    log = HOSTILE_LINE + f"{ok} /a 1500\n{ok} /a 2500\n"
    with live_api(tmp_path / "api.db", "--request-deadline", "5") as base:
        def upload() -> httpx.Response:
            return httpx.post(base + "/v1/fits", data={"kind": "apache-log", "log_format": HOSTILE_FORMAT,
                                                       "stage": ["a=^/a"], "order": "1"},
                              files={"file": ("access.log", log.encode(), "text/plain")}, timeout=120)

        with ThreadPoolExecutor(3) as pool:
            uploads = [pool.submit(upload) for _ in range(3)]
            models = []
            while True:  # models posted for as long as an upload is not answered
                models.append(httpx.post(base + "/v1/models", json=exp2(0.3), timeout=120))
                if all(u.done() for u in uploads):
                    break
            answers = [u.result() for u in uploads]
        for r in models:
            assert r.status_code == 202, r.text
        for r in answers:
            assert r.status_code == 202, r.text
        fit = httpx.get(base + answers[0].headers["location"]).json()
        assert fit["report"][0].startswith("3 lines: 2 kept, 1 unparsable")
