"""``overtake sidecar --policy-url``: the policy taken from a real ``overtake api``.

A real API process solves two small models; a real sidecar process follows the first model's
artifact URL. Known answers: the sidecar's policy hash equals the API's ``policy_hash`` (the
artifact's content digest, also the ETag); while the model is unchanged every poll is a 304 and
nothing is swapped; a PUT of the second model's URL installs exactly that hash; a corrupted
artifact (bytes truncated in the API's database: the fault injection) is refused and the old
policy kept; with the API stopped every poll is counted as an error and the policy stays.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.api_helpers import exp2, free_port, live_api, wait
from support.service_helpers import ADMIN_TOKEN, admin_token_file

REPO = Path(__file__).resolve().parents[3]
POLL = 0.3
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}  # PUT /-/policy carries the admin token
STAGES = """stages:
  - name: front
    path: "^/front$"
  - name: back
    path: "^/back$"
classifier: {mode: explicit, header: X-Overtake-Phase, time_unit: 0.01}
"""


def h2(load: float = 0.4) -> dict[str, Any]:
    """Two hyperexponential stages (van der Weij et al., "Dynamic thread assignment", the shape of
    Table 1's case 4): π* differs from π(1)."""
    svc = {"hyperexponential": {"probs": [0.91, 0.09], "means": [0.55, 5.45]}}
    return {"load": load, "stages": [{"name": "front", "service": svc}, {"name": "back", "service": svc}],
            "truncation": {"max_requests": 6, "max_threads": 2}}


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in metrics"
    return float(m.group(1))


class Side:
    def __init__(self, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.proc = proc
        self.log = log

    def info(self) -> dict[str, Any]:
        doc: dict[str, Any] = httpx.get(self.base + "/-/policy", timeout=5).json()
        return doc

    def fetches(self, result: str) -> float:
        text = httpx.get(self.base + "/-/metrics", timeout=5).text
        return _metric(text, "overtake_policy_fetches_total", f'{{result="{result}"}}')

    def wait_for(self, result: str, at_least: float, timeout: float = 15.0) -> None:
        t0 = time.monotonic()
        while self.fetches(result) < at_least:
            assert time.monotonic() - t0 < timeout, f"fetches {result} < {at_least}: {self.info()}"
            time.sleep(0.05)


def start_sidecar(tmp: Path, *args: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    """The sidecar, its admin port (every request of these tests goes there), its log."""
    port, admin = free_port(), free_port()
    stages = tmp / "stages.yaml"
    stages.write_text(STAGES)
    log = tmp / f"sidecar-{port}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "overtake.api.cli", "sidecar", *args, "--apache", f"http://127.0.0.1:{free_port()}",
             "--listen", f"127.0.0.1:{port}", "--stages", str(stages), "--loop", "asyncio",
             "--admin-listen", f"127.0.0.1:{admin}", "--admin-token-file", str(admin_token_file(tmp))],
            cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    return proc, admin, log


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, dict[str, str]]]:
    db = tmp_path_factory.mktemp("api") / "api.db"
    with live_api(db) as base, httpx.Client(base_url=base, timeout=30) as c:
        ids = {}
        for key, sc in (("a", exp2(0.3)), ("b", h2()), ("c", exp2(0.5))):
            r = c.post("/v1/models", json=sc)
            assert r.status_code == 202, r.text
            ids[key] = r.json()["id"]
        for i in ids.values():
            assert wait(c, f"/v1/models/{i}")["status"] == "done"
        yield base, db, ids


def _hash(base: str, model: str) -> str:
    h: str = httpx.get(f"{base}/v1/models/{model}/policy", timeout=10).json()["hash"]
    return h


def test_follow_api_policy(api: tuple[str, Path, dict[str, str]], tmp_path: Path) -> None:
    base, db, ids = api
    ha, hb = _hash(base, ids["a"]), _hash(base, ids["b"])
    assert ha != hb
    # the download answers 304 to its own ETag (the poller relies on it)
    r = httpx.get(f"{base}/v1/models/{ids['a']}/policy.npz")
    assert r.headers["etag"] == f'"{ha}"'
    assert httpx.get(f"{base}/v1/models/{ids['a']}/policy.npz", headers={"If-None-Match": f'"{ha}"'}).status_code == 304

    proc, port, log = start_sidecar(tmp_path, "--policy-url", f"{base}/v1/models/{ids['a']}/policy",
                                    "--policy-poll", str(POLL), "--policy-token", "not-checked-on-get")
    side = Side(port, proc, log)
    try:
        t0 = time.monotonic()
        while True:
            try:
                info = side.info()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() - t0 < 30, log.read_text()
                time.sleep(0.1)
        # initial fetch: the API's model a, its hash = ETag
        assert info["hash"] == ha and info["etag"] == f'"{ha}"'
        assert info["name"] == f"policy-{ids['a']}.npz"
        assert info["policy_url"] == f"{base}/v1/models/{ids['a']}/policy.npz"
        assert side.fetches("updated") == 1
        text = httpx.get(side.base + "/-/metrics").text
        assert (
            _metric(
                text,
                "overtake_policy_info",
                f'{{chosen="policy-{ids["a"]}.npz",hash="{ha}",name="policy-{ids["a"]}.npz",phase_info="full",'
                f'reason="",version="{info["version"]}"}}',
            )
            == 1
        )

        # unchanged model: polls are 304, nothing swapped
        side.wait_for("not_modified", 3)
        info = side.info()
        assert info["hash"] == ha and info["swaps"] == 0 and info["fetch_error"] is None

        # a new model's policy: PUT its URL, the sidecar installs it and follows it
        r = httpx.put(side.base + "/-/policy", headers=AUTH, content=f"{base}/v1/models/{ids['b']}".encode())
        assert r.status_code == 200, r.text
        info = side.info()
        assert info["hash"] == hb and info["swaps"] == 1 and info["phases"] == [2, 2]
        assert side.fetches("updated") == 2
        n304 = side.fetches("not_modified")
        side.wait_for("not_modified", n304 + 2)
        assert side.info()["hash"] == hb

        # bad bytes: model c's artifact truncated in the API's database -> refused, b kept
        with sqlite3.connect(db) as con:
            blob = con.execute("SELECT artifact FROM jobs WHERE id=?", (ids["c"],)).fetchone()[0]
            con.execute("UPDATE jobs SET artifact=? WHERE id=?", (blob[: len(blob) // 2], ids["c"]))
        r = httpx.put(side.base + "/-/policy", headers=AUTH, content=f"{base}/v1/models/{ids['c']}/policy.npz".encode())
        assert r.status_code == 422 and r.text.startswith("refused, old policy kept: policy:"), r.text
        assert "not an overtake policy file" in r.text
        info = side.info()
        assert info["hash"] == hb and info["refused"] == 1 and side.fetches("refused") == 1
        assert info["policy_url"] == f"{base}/v1/models/{ids['b']}/policy.npz"  # still following b

        # a URL the API answers 404 for is refused the same way
        r = httpx.put(side.base + "/-/policy", headers=AUTH, content=f"{base}/v1/models/nosuchmodel/policy.npz".encode())
        assert r.status_code == 422 and "HTTP 404" in r.text
        assert side.info()["hash"] == hb
    finally:
        proc.terminate()
        proc.wait(10)
    events = [json.loads(ln)["event"] for ln in log.read_text().splitlines() if ln.startswith("{")]
    assert events.count("policy_swap") == 1 and events.count("policy_refused") == 1


def test_api_down_keeps_policy(tmp_path: Path) -> None:
    """The API stops: every poll is an error, the policy stays; it comes back: polls are 304 again."""
    db = tmp_path / "api.db"
    port = free_port()
    with live_api(db, "--token", "s3cret") as base, httpx.Client(base_url=base, timeout=30) as c:
        r = c.post("/v1/models", json=exp2(0.3), headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 202, r.text
        mid = r.json()["id"]
        assert wait(c, f"/v1/models/{mid}")["status"] == "done"
        h = _hash(base, mid)
        proc, port, log = start_sidecar(tmp_path, "--policy-url", f"{base}/v1/models/{mid}",
                                        "--policy-poll", str(POLL), "--policy-token", "s3cret")
        side = Side(port, proc, log)
        t0 = time.monotonic()
        while True:
            try:
                assert side.info()["hash"] == h
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() - t0 < 30, log.read_text()
                time.sleep(0.1)
        side.wait_for("not_modified", 1)
    try:
        # live_api has terminated the API process
        side.wait_for("error", 3)
        info = side.info()
        assert info["hash"] == h and info["swaps"] == 0 and info["refused"] == 0
        assert "Connection refused" in info["fetch_error"]
        assert side.fetches("updated") == 1
    finally:
        proc.terminate()
        proc.wait(10)
    assert any(json.loads(ln).get("event") == "policy_fetch_error" for ln in log.read_text().splitlines()
               if ln.startswith("{"))


def test_unreachable_at_start(tmp_path: Path) -> None:
    """No API and no fallback: one line naming --policy-url, exit 2; with --policy the sidecar starts on it."""
    url = f"http://127.0.0.1:{free_port()}/v1/models/abc/policy.npz"
    stages = tmp_path / "stages.yaml"
    stages.write_text(STAGES)
    base_args = [sys.executable, "-m", "overtake.api.cli", "sidecar", "--apache", "http://127.0.0.1:1",
                 "--listen", f"127.0.0.1:{free_port()}", "--stages", str(stages), "--loop", "asyncio"]
    r = subprocess.run([*base_args, "--policy-url", url], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("overtake: policy-url: GET ") or "policy-url: GET " in line, r.stderr
    assert "Connection refused" in line and "--policy as a fallback" in line
    r = subprocess.run([*base_args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--policy-url URL" in r.stderr
    r = subprocess.run([*base_args, "--policy-url", "ftp://x/y"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "policy-url: expected http://" in r.stderr

    proc, port, log = start_sidecar(tmp_path, "--policy-url", url, "--policy", "pi(2)", "--policy-poll", str(POLL))
    side = Side(port, proc, log)
    try:
        t0 = time.monotonic()
        while True:
            try:
                info = side.info()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() - t0 < 30, log.read_text()
                time.sleep(0.1)
        assert info["name"] == "pi(2)" and info["policy_url"] == url
        side.wait_for("error", 3)
        assert side.info()["name"] == "pi(2)"
    finally:
        proc.terminate()
        proc.wait(10)
