"""A real Prometheus (Debian package) scrapes the sidecar (with Apache's series) and the API.

Private Apache (controller.harness.apache) ← ``overtake sidecar`` ← requests; ``overtake api``; and
``overtake.controller.harness.prometheus`` scraping both every 0.5 s. The test reads everything back through Prometheus's
HTTP API and checks the counts against what it sent. Skips without apache2/prometheus unless root
(then it runs the installer, like the Apache tests).
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.api_helpers import REPO, exp2, free_port, live_api, wait

from overtake.controller.harness import apache, prometheus

STAGES = """
stages:
  - name: stage1
    path: "^/stage1$"
  - name: stage2
    path: "^/stage2$"
limits: {max_inflight: 8, queue_cap: 100, queue_timeout: 20}
classifier: {time_unit: 0.01}  # the API's scenario is in model units: 1 unit = 10 ms
"""


@pytest.fixture(scope="module")
def tools(apache_available: None) -> None:
    """Apache (the suite's ``apache_available``) and Prometheus, installed by the project's installer."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed: run `sh apache-conf/install-debian-packages.sh` (as root)")


@pytest.fixture()
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="overtake-prom-test-", dir="/tmp"))
    d.chmod(0o755)  # www-data must read the Lua handler
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def _value(res: list[dict]) -> float:
    assert len(res) == 1, res
    return float(res[0]["value"][1])


DASHBOARD = REPO / "dashboards" / "grafana-sidecar.json"


def _dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    # Grafana's variables, as Grafana substitutes them for "All" and a short range
    return [e.replace("$__rate_interval", "5s").replace("$job", ".*").replace("$stage", ".*") for e in exprs]


@pytest.mark.apache_functional
def test_prometheus_finds_sidecar_apache_and_api_series(tools: None, workdir: Path) -> None:
    inst = apache.start(workdir / "apache", f"127.0.0.1:{free_port()}", max_workers=16)
    side_port, admin_port = free_port(), free_port()
    (workdir / "stages.yaml").write_text(STAGES)
    log = (workdir / "sidecar.log").open("wb")
    prom_dir = workdir / "prom"
    side: subprocess.Popen[bytes] | None = None
    try:
        with live_api(workdir / "api.db") as api_base:
            api_addr = api_base.removeprefix("http://")
            # the policy comes from the API: solve, then download the artifact the sidecar loads
            sc = exp2(0.3)
            for i, st in enumerate(sc["stages"]):
                st["name"] = f"stage{i + 1}"
            model = wait(httpx, api_base + httpx.post(api_base + "/v1/models", json=sc, timeout=60).json()["url"])
            (workdir / "policy.npz").write_bytes(httpx.get(f"{api_base}/v1/models/{model['id']}/policy.npz").content)
            side = subprocess.Popen(
                [sys.executable, "-m", "overtake.api.cli", "sidecar", "--policy", str(workdir / "policy.npz"),
                 "--apache", inst.base_url, "--listen", f"127.0.0.1:{side_port}", "--stages", str(workdir / "stages.yaml"),
                 "--admin-listen", f"127.0.0.1:{admin_port}"],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while True:
                try:
                    if _get(side_port, "/-/healthz") == 200:
                        break
                except OSError:
                    pass
                assert side.poll() is None and time.monotonic() < deadline, (workdir / "sidecar.log").read_text()
                time.sleep(0.1)
            prom = prometheus.start(prom_dir, f"127.0.0.1:{free_port()}", sidecars=[f"127.0.0.1:{admin_port}"],
                                    apis=[api_addr], interval=0.5)
            sent = 6
            for _ in range(sent):
                assert _get(side_port, "/stage1?work=0.002") == 200
            # both targets are up
            assert _value(prom.wait_for('up{job="overtake-sidecar"} == 1')) == 1
            assert _value(prom.wait_for('up{job="overtake-api"} == 1')) == 1
            # the sidecar's counters: exactly the requests sent, all completed
            admitted = prom.wait_for(f'overtake_stage_admitted_total{{stage="stage1"}} >= {sent}')
            assert _value(admitted) == sent
            done = prom.wait_for(f'sum(overtake_stage_completed_total{{stage="stage1",outcome="completed"}}) >= {sent}')
            assert _value(done) == sent
            info = prom.wait_for("overtake_policy_info")
            assert info[0]["metric"]["hash"] == model["policy_hash"]
            # the model's E[W] of the running policy, in seconds (stages' default time unit 0.01 s)
            predicted = _value(prom.wait_for("overtake_policy_predicted_response_time_seconds"))
            assert predicted == pytest.approx(model["metrics"]["mean_response_time"] * 0.01, rel=1e-9)
            # Apache's mod_status through the sidecar, under apache_exporter's names
            assert _value(prom.wait_for('apache_up{job="overtake-sidecar"} == 1')) == 1
            assert _value(prom.wait_for(f"apache_accesses_total >= {sent}")) >= sent
            assert prom.wait_for('apache_workers{state="idle"}')
            # the API's own registry
            jobs = prom.wait_for('overtake_api_jobs{kind="model",status="done"} == 1')
            assert _value(jobs) == 1
            # every query of the Grafana dashboard is valid PromQL over series that exist here
            names = set(httpx.get(f"{prom.url}/api/v1/label/__name__/values").json()["data"])
            # series that exist only once an event happened (rejections, gateway errors) must at
            # least be the sidecar's documented names (controller/sidecar/metrics.py)
            documented = (REPO / "controller" / "sidecar" / "metrics.py").read_text()
            seen = set()
            for expr in _dashboard_exprs():
                prom.query(expr)  # raises on a syntax error
                for metric in re.findall(r"\b((?:overtake|apache)_[a-z_]+)", expr):
                    base = metric.removesuffix("_total")
                    assert metric in names or f'"{base}"' in documented, (metric, expr)
                    seen.add(metric in names)
            assert True in seen
    finally:
        prometheus.stop(prom_dir)
        if side is not None:
            side.terminate()
            side.wait(15)
        log.close()
        apache.stop(inst.workdir, graceful=False)


def test_config_names_jobs_paths_and_rejects_bad_targets() -> None:
    cfg = prometheus.render_config(sidecars=["127.0.0.1:8080"], apis=["127.0.0.1:8000"], interval=0.5)
    assert "job_name: overtake-sidecar\n    metrics_path: /metrics" in cfg
    assert "job_name: overtake-api\n    metrics_path: /metrics" in cfg
    assert "scrape_interval: 500ms" in cfg
    with pytest.raises(prometheus.PrometheusUsageError, match="overtake-sidecar must be HOST:PORT"):
        prometheus.render_config(sidecars=["localhost"])
    with pytest.raises(prometheus.PrometheusUsageError, match="at least one target"):
        prometheus.render_config()
