"""``make demo``'s script (examples/demo/run.sh) on the bundled example, end to end, with short
load rows: fits, solves, compares, starts two private Apaches (one with mod_overtake_prio reading
the sidecar's control file), the sidecars and a private Prometheus, replays one trace per row and
writes its report. It exits 0, every request of every row is answered, and Prometheus saw the
sidecar admit requests. The README's first command runs this script; nothing else runs it whole.

It uses ``apache_available``, so it is one of the ``apache_timed`` tests (tests/conftest.py): its
Apaches, sidecars and load driver, pinned and raised as the demo does, never run beside another
timed test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from overtake.controller.harness.scratch import scratch_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_the_demo_runs_end_to_end(apache_available: None) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (the demo's Apache with mod_overtake_prio)")
    for tool in ("apxs", "prometheus", "curl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (apache-conf/install-debian-packages.sh installs it)")
    out = scratch_dir("overtake-demo-test-")
    out.chmod(0o755)  # Apache's children read their folders under it
    try:
        env = {**os.environ, "DEMO_SECONDS": "6", "DEMO_OUT": str(out / "demo-out")}
        r = subprocess.run(["bash", "examples/demo/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=840, check=False)
        assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
        live = json.loads((out / "demo-out" / "live.json").read_text())
        assert set(live["rows"]) == {"pi(inf)", "no header", "header"}
        for name, row in live["rows"].items():
            assert row["failures"] == 0 and row["measured_ms"] > 0, (name, row)
        assert sum(live["prometheus"]["admitted"].values()) > 0
        assert (out / "demo-out" / "report.png").stat().st_size > 0
    finally:
        shutil.rmtree(out, ignore_errors=True)
