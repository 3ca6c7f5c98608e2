"""The files an operator gets with the package: the dashboard, its scrape job and the example stages file.

They ship in the wheel (package data: ``overtake.dashboards``, ``overtake.apache_conf``) and in the
Debian package (``/usr/share/overtake``; tests/test_deb.py); here: they are what they say.
"""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest
import yaml

from overtake.controller.sidecar.stages import load_stages

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = REPO / "dashboards"
SCRAPE = DASHBOARDS / "prometheus-scrape.yml"
FILE_NAME = re.compile(r"[\w./-]+\.(?:json|ya?ml|py|md|conf|service)\b")


def test_the_dashboards_description_names_files_shipped_beside_it() -> None:
    """An installed dashboard can only point at what was installed with it (not at the source tree)."""
    description = json.loads((DASHBOARDS / "grafana-sidecar.json").read_text())["description"]
    named = FILE_NAME.findall(description)
    assert named, f"the description names no file (the scrape job's): {description}"
    shipped = {p.name for p in resources.files("overtake.dashboards").iterdir()}
    missing = [n for n in named if n not in shipped]
    assert not missing, f"named in the dashboard's description but not shipped beside it: {missing}"
    assert SCRAPE.name in named


def test_the_scrape_job_reaches_the_shipped_configs_admin_listener() -> None:
    """Prometheus scrapes /metrics unless told: the job names the admin listener's path and address."""
    job, = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    config = yaml.safe_load((REPO / "apache-conf" / "examples" / "sidecar.yaml").read_text())
    assert job["static_configs"] == [{"targets": [config["admin_listen"]]}]
    assert job["metrics_path"] == "/metrics"  # Prometheus's default; bench/deb_install.py scrapes it from an installed sidecar


def test_the_scrape_job_is_a_valid_prometheus_configuration(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian package prometheus) not installed: apache-conf/install-debian-packages.sh")
    out = subprocess.run([promtool, "check", "config", str(SCRAPE)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_example_stages_file_ships_beside_the_example_config() -> None:
    """The example config says ``stages: stages.yaml``: the shipped examples folder has one, and it loads."""
    examples = resources.files("overtake.apache_conf") / "examples"
    config = yaml.safe_load((examples / "sidecar.yaml").read_text())
    stages = examples / config["stages"]
    assert stages.read_text() == (REPO / "examples" / "sidecar" / "stages.yaml").read_text()
    assert load_stages(Path(str(stages))).names == ("stage1", "stage2")


def test_package_data_lists_the_shipped_files() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    data = cfg["options.package_data"]
    assert "overtake.dashboards" in data and "*.json" in data["overtake.dashboards"] and "*.yml" in data["overtake.dashboards"]
