"""REST API: jobs, known answers, validation, limits, auth, fits, metrics, persistence across restarts."""

from __future__ import annotations

import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from support.api_helpers import exp2, wait

from overtake.api.app import Settings, create_app
from overtake.api.db import Store
from overtake.mdp.policy import Policy


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("api") / "jobs.db"


@pytest.fixture(scope="module")
def client(db: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(db=str(db), max_states=50_000))) as c:
        yield c


@pytest.fixture(scope="module")
def solved(client: TestClient) -> dict:
    r = client.post("/v1/models", json=exp2(0.3), params={"name": "exp-0.3"})
    assert r.status_code == 202
    assert r.json()["status"] == "queued"
    return wait(client, r.json()["url"])


def test_solve_matches_closed_forms(solved: dict) -> None:
    assert solved["status"] == "done", solved["reason"]
    assert solved["progress"] == 1.0
    pols = solved["comparison"]["policies"]
    # pi(inf) on exponential stages is M/M/1-PS with E[S] = 2: E[W] = 2/(1 - 0.3); truncation at 8
    # blocks a fraction of about rho^8 = 7e-5 of the arrivals
    assert pols["pi(inf)"]["mean_response_time"] == pytest.approx(2 / 0.7, rel=2e-3)
    # pi* = pi(1) for exponential stages (van der Weij et al., "Dynamic thread assignment" §3): gain over pi(1)
    # is zero up to truncation
    assert abs(solved["comparison"]["gains"]["pi(1)"]) < 1e-3
    assert solved["comparison"]["gains"]["pi(inf)"] == pytest.approx(
        (pols["pi(inf)"]["mean_response_time"] - solved["metrics"]["mean_response_time"])
        / solved["metrics"]["mean_response_time"])
    assert solved["metrics"] == pols["pi*"]


def test_policy_rules_and_artifact_agree_with_decisions(client: TestClient, solved: dict, tmp_path: Path) -> None:
    mid = solved["id"]
    doc = client.get(f"/v1/models/{mid}/policy").json()
    assert doc["columns"] == ["waiting:front/phase1", "waiting:back/phase1", "threads:front/phase1",
                              "threads:back/phase1"]
    assert doc["hash"] == solved["policy_hash"]
    assert doc["rules"]["text"] and 0.0 < doc["rules"]["agreement"] <= 1.0
    blob = client.get(doc["artifact"])
    assert blob.headers["content-type"] == "application/octet-stream"
    assert blob.headers["etag"] == f'"{doc["hash"]}"'
    assert client.get(doc["artifact"], headers={"If-None-Match": blob.headers["etag"]}).status_code == 304
    path = tmp_path / "p.npz"
    path.write_bytes(blob.content)
    pol = Policy.load(path)  # the same artifact `overtake solve --out` writes; its hash is checked on load
    assert pol.digest() == doc["hash"]
    rng = np.random.default_rng(3)
    states = [[1, 0, 0, 0], [2, 0, 1, 0], [0, 3, 0, 0], *rng.integers(0, 4, size=(20, 4)).tolist()]
    for s in states:
        d = client.get(f"/v1/models/{mid}/decision", params={"state": ",".join(map(str, s))}).json()
        assert list(d["spawn"].values()) == pol.action(s).tolist(), s
        assert d["total"] == sum(d["spawn"].values())
    # pi* = pi(1): an idle server starts exactly one thread; a busy one starts none
    assert client.get(f"/v1/models/{mid}/decision", params={"state": "1,0,0,0"}).json()["total"] == 1
    assert client.get(f"/v1/models/{mid}/decision", params={"state": "2,0,1,0"}).json()["total"] == 0


@pytest.mark.parametrize(("state", "field"), [
    ("1,0,0", "state:"), ("1,0,x,0", "state[2]"), ("1,0,-1,0", "state[2]"),
    # digits of other scripts: str.isdigit() takes them, int() refuses '²' (a 500) and reads '٣' as 3
    ("\u00b2,0,0,0", "state[0]"), ("1,\u0663,0,0", "state[1]"), ("1,0,\uff11,0", "state[2]"),
])
def test_bad_state_is_422_naming_it(client: TestClient, solved: dict, state: str, field: str) -> None:
    r = client.get(f"/v1/models/{solved['id']}/decision", params={"state": state})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith(field)
    assert "ASCII digits 0-9" in r.json()["detail"] or field == "state:"


@pytest.mark.parametrize(("change", "field"), [
    ({"load": 1.2}, "load must be < 1"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"stages": [{"name": "a", "service": {"ph": {"alpha": [0.5, 0.2], "T": [[-1, 0], [0, -1]]}}}]},
     "stages.0.service: stages[a].alpha must sum to 1"),
    ({"stages": [{"name": "a", "service": {"ph": {"alpha": [1.0], "T": [[0.5]]}}}]}, "stages.0.service"),
    ({"tolerance": 0.9}, "tolerance:"),
])
def test_invalid_scenario_is_422_naming_the_field(client: TestClient, change: dict, field: str) -> None:
    r = client.post("/v1/models", json={**exp2(), **change})
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"]


def test_not_json_is_422(client: TestClient) -> None:
    r = client.post("/v1/models", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"].startswith("body: not valid JSON")


def test_state_space_over_the_cap_is_413_with_estimate_and_cap(client: TestClient) -> None:
    from overtake.mdp.scenario import parse_scenario
    from overtake.mdp.statespace import Truncation, count_states

    sc = exp2(0.5, max_requests=200)
    r = client.post("/v1/models", json=sc)
    assert r.status_code == 413
    model = parse_scenario(sc).build_model()
    # pi(inf) in the phase-at-start layout on cap 200 is the largest chain of this job
    est = max(count_states(model, Truncation(200, None), "full"), count_states(model, Truncation(200, None), "start"))
    assert f"estimated state space {est} states" in r.json()["detail"]
    assert "cap of 50000" in r.json()["detail"]


def test_unknown_and_unfinished(client: TestClient) -> None:
    assert client.get("/v1/models/nope").status_code == 404
    assert client.get("/v1/fits/nope").status_code == 404
    assert client.get("/v1/models/nope/decision", params={"state": "0"}).status_code == 404


def test_fit_json_exponential_is_the_mle(client: TestClient) -> None:
    x = np.random.default_rng(5).exponential(0.25, 400)
    r = client.post("/v1/fits", json={"samples": x.tolist(), "order": 1, "name": "db"})
    assert r.status_code == 202
    doc = wait(client, r.json()["url"])
    assert doc["status"] == "done", doc["reason"]
    # order-1 PH = exponential; its MLE rate is 1/sample mean exactly
    assert doc["stages"]["db"]["T"][0][0] == pytest.approx(-1 / x.mean(), rel=1e-6)


def test_fit_csv_upload_equals_json(client: TestClient) -> None:
    x = np.random.default_rng(6).exponential(2.0, 300)
    csv = "id,ms\n" + "".join(f"{i},{v * 1000:.6f}\n" for i, v in enumerate(x))
    r = client.post("/v1/fits", data={"kind": "csv", "column": "ms", "scale": "0.001", "name": "upload", "order": "1"},
                    files={"file": ("d.csv", io.BytesIO(csv.encode()), "text/csv")})
    assert r.status_code == 202, r.text
    doc = wait(client, r.json()["url"])
    assert doc["status"] == "done" and doc["source"] == "csv"
    assert doc["stages"]["upload"]["mean"] == pytest.approx(x.mean(), rel=1e-6)


def test_fit_access_log_upload_splits_stages(client: TestClient) -> None:
    rng = np.random.default_rng(7)
    a, b = rng.exponential(0.01, 200), rng.exponential(0.05, 150)
    fmt = '%h %l %u %t "%r" %>s %b %D'
    lines = [f'127.0.0.1 - - [21/Nov/2026:09:00:00 +0000] "GET /stage1?w=1 HTTP/1.1" 200 12 {int(v * 1e6) + 1}'
             for v in a]
    lines += [f'127.0.0.1 - - [21/Nov/2026:09:00:00 +0000] "GET /stage2 HTTP/1.1" 200 12 {int(v * 1e6) + 1}'
              for v in b]
    lines += ['127.0.0.1 - - [21/Nov/2026:09:00:00 +0000] "GET /stage2 HTTP/1.1" 500 12 999', "garbage line"]
    r = client.post("/v1/fits", data={"kind": "apache-log", "log_format": fmt, "stage": ["s1=^/stage1", "s2=^/stage2"],
                                      "order": "1"},
                    files={"file": ("access.log", io.BytesIO("\n".join(lines).encode()), "text/plain")})
    assert r.status_code == 202, r.text
    doc = wait(client, r.json()["url"])
    assert doc["status"] == "done", doc["reason"]
    assert doc["report"][0].startswith("352 lines: 350 kept, 1 unparsable, 1 non-2xx")
    a_us = (np.floor(a * 1e6) + 1) * 1e-6
    assert doc["stages"]["s1"]["mean"] == pytest.approx(a_us.mean(), rel=1e-6)
    assert doc["stages"]["s2"]["n"] == 150


@pytest.mark.parametrize(("body", "field"), [
    ({"samples": [1.0, -2.0]}, "samples.stage1[1]"),
    ({"samples": [1.0]}, "samples.stage1: needs at least 2"),
    ({"samples": [1.0, 2.0], "structure": "nope"}, "structure:"),
    ({"samples": [1.0, 2.0], "order": 0}, "order"),
    ({"samples": {"a/b": [1.0, 2.0]}}, "samples: stage name 'a/b'"),
])
def test_bad_fit_is_422_naming_the_field(client: TestClient, body: dict, field: str) -> None:
    r = client.post("/v1/fits", json=body)
    assert r.status_code == 422
    assert r.json()["detail"].startswith(field), r.json()


def test_bad_log_upload_is_422(client: TestClient) -> None:
    r = client.post("/v1/fits", data={"kind": "apache-log", "log_format": "%h %t", "stage": ["a=/"]},
                    files={"file": ("a.log", io.BytesIO(b"x"), "text/plain")})
    assert r.status_code == 422 and r.json()["detail"].startswith("log_format:")
    r = client.post("/v1/fits", data={"kind": "apache-log", "log_format": "%h %D %r"},
                    files={"file": ("a.log", io.BytesIO(b"x"), "text/plain")})
    assert r.status_code == 422 and r.json()["detail"].startswith("stage:")
    r = client.post("/v1/fits", data={"kind": "apache-log", "log_format": "%h %D %r", "stage": ["a=^/(?!x)"]},
                    files={"file": ("a.log", io.BytesIO(b"x"), "text/plain")})
    detail = r.json()["detail"]
    assert r.status_code == 422 and detail.startswith("stage: a=^/(?!x): not supported by the linear-time matcher")


def test_model_from_a_fit(client: TestClient) -> None:
    x = np.random.default_rng(8).exponential(1.0, 300)
    fit = wait(client, client.post("/v1/fits", json={"samples": {"a": x.tolist(), "b": x.tolist()}, "order": 1})
               .json()["url"])
    sc = {"load": 0.3, "truncation": {"max_requests": 6},
          "stages": [{"name": "a", "service": {"fit": {"id": fit["id"], "stage": "a"}}},
                     {"name": "b", "service": {"fit": {"id": fit["id"], "stage": "b"}}}]}
    doc = wait(client, client.post("/v1/models", json=sc).json()["url"])
    assert doc["status"] == "done"
    rate = -fit["stages"]["a"]["T"][0][0]
    assert doc["scenario"]["stages"][0]["service"]["ph"]["T"] == [[-rate]]
    # the model's distribution figure overlays the fit's samples on its PH
    png = client.get(f"/v1/models/{doc['id']}/plots/distributions.png")
    assert png.content[:4] == b"\x89PNG", png.text
    bad = {**sc, "stages": [{"name": "a", "service": {"fit": {"id": fit["id"], "stage": "zzz"}}}]}
    r = client.post("/v1/models", json=bad)
    assert r.status_code == 422 and r.json()["detail"].startswith("stages.0.service.fit.stage")


def test_plots_are_png(client: TestClient, solved: dict) -> None:
    for kind in ("gains", "policy", "distributions"):
        r = client.get(f"/v1/models/{solved['id']}/plots/{kind}.png")
        assert r.status_code == 200 and r.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert client.get(f"/v1/models/{solved['id']}/plots/other.png").status_code == 404


def test_metrics_count_what_happened(client: TestClient, solved: dict) -> None:
    before = _samples(client)
    client.post("/v1/models", json={**exp2(), "load": 2.0})
    client.get(f"/v1/models/{solved['id']}/decision", params={"state": "1,0,0,0"})
    after = _samples(client)
    assert after[("overtake_api_jobs_rejected_total", (("kind", "model"), ("reason", "invalid")))] == \
        before[("overtake_api_jobs_rejected_total", (("kind", "model"), ("reason", "invalid")))] + 1
    assert after[("overtake_api_decisions_total", ())] == before[("overtake_api_decisions_total", ())] + 1
    done = after[("overtake_api_jobs", (("kind", "model"), ("status", "done")))]
    assert done == len([m for m in client.get("/v1/models").json() if m["status"] == "done"])


def _samples(client: TestClient) -> dict:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_healthz(client: TestClient) -> None:
    doc = client.get("/healthz").json()
    assert doc["status"] == "ok" and doc["workers"] == 1


def test_token_guards_mutations_only(tmp_path: Path) -> None:
    with TestClient(create_app(Settings(db=str(tmp_path / "t.db"), token="s3cret"))) as c:
        r = c.post("/v1/models", json=exp2())
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert c.post("/v1/fits", json={"samples": [1.0, 2.0]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = c.post("/v1/models", json=exp2(), headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 202
        assert c.get(r.json()["url"]).status_code == 200  # reads stay open
        assert c.get("/v1/models").status_code == 200


def test_full_queue_is_429(tmp_path: Path) -> None:
    with TestClient(create_app(Settings(db=str(tmp_path / "q.db"), max_queued=1))) as c:
        # a job stored but never handed to a worker holds the only queue slot
        Store(str(tmp_path / "q.db")).create("fit", "held", {"source": "json", "samples": {}, "options": {}})
        r = c.post("/v1/models", json=exp2())
        assert r.status_code == 429 and r.headers["retry-after"] == "10"


def test_restart_keeps_models_and_fails_interrupted_jobs(tmp_path: Path) -> None:
    db = str(tmp_path / "r.db")
    with TestClient(create_app(Settings(db=db))) as c:
        done = wait(c, c.post("/v1/models", json=exp2(0.4)).json()["url"])
        assert done["status"] == "done"
        dec = c.get(f"/v1/models/{done['id']}/decision", params={"state": "1,1,0,0"}).json()
        # a job of a few seconds (two H2 stages, 48915 states): stop the API while it runs
        h2 = {"hyperexponential": {"probs": [0.91, 0.09], "means": [0.55, 5.45]}}
        slow = {"load": 0.6, "truncation": {"max_requests": 12, "max_threads": 4},
                "stages": [{"name": "a", "service": h2}, {"name": "b", "service": h2}]}
        sid = c.post("/v1/models", json=slow).json()["id"]
        t0 = time.monotonic()
        while c.get(f"/v1/models/{sid}").json()["status"] != "running":
            assert time.monotonic() - t0 < 60
            time.sleep(0.05)
        # the API answers while the worker process solves (how fast: bench/api_bench.py, not a
        # timed test)
        assert c.get("/healthz").status_code == 200
        qid = c.post("/v1/models", json=exp2(0.2)).json()["id"]  # waits behind the slow one (1 worker)
        assert c.get(f"/v1/models/{qid}").json()["status"] == "queued"
    with TestClient(create_app(Settings(db=db))) as c:
        again = c.get(f"/v1/models/{done['id']}").json()
        assert again["status"] == "done" and again["comparison"] == done["comparison"]
        assert c.get(f"/v1/models/{done['id']}/decision", params={"state": "1,1,0,0"}).json() == dec
        interrupted = c.get(f"/v1/models/{sid}").json()
        assert interrupted["status"] == "failed" and interrupted["reason"].startswith("interrupted")
        requeued = wait(c, f"/v1/models/{qid}")
        assert requeued["status"] == "done"


def test_a_killed_worker_fails_its_job_and_the_pool_recovers(tmp_path: Path) -> None:
    h2 = {"hyperexponential": {"probs": [0.91, 0.09], "means": [0.55, 5.45]}}
    slow = {"load": 0.6, "truncation": {"max_requests": 12, "max_threads": 4},
            "stages": [{"name": "a", "service": h2}, {"name": "b", "service": h2}]}
    app = create_app(Settings(db=str(tmp_path / "k.db")))
    with TestClient(app) as c:
        sid = c.post("/v1/models", json=slow).json()["id"]
        t0 = time.monotonic()
        while c.get(f"/v1/models/{sid}").json()["status"] != "running":
            assert time.monotonic() - t0 < 60
            time.sleep(0.05)
        workers = app.state.runner.pids()
        assert len(workers) == 1  # workers=1
        os.kill(workers[0], signal.SIGKILL)  # the fault: the solver process dies (OOM killer, kill -9)
        doc = wait(c, f"/v1/models/{sid}")
        assert doc["status"] == "failed"
        assert doc["reason"].startswith("worker process failed (killed by signal SIGKILL: out of memory, or killed?)")
        after = wait(c, c.post("/v1/models", json=exp2(0.2)).json()["url"])  # a fresh process runs the next job
        assert after["status"] == "done"
        assert workers[0] not in app.state.runner.pids()


def test_page_escapes_user_text(client: TestClient) -> None:
    r = client.post("/v1/models", json=exp2(0.2), params={"name": "<script>alert(1)</script>"})
    assert r.status_code == 202
    page = client.get("/").text
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    wait(client, r.json()["url"])
