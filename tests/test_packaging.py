"""Packaging: one import root, every sub-package listed, and a built wheel that works outside the checkout."""

from __future__ import annotations

import configparser
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

import overtake

REPO = Path(__file__).resolve().parent.parent


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _lines(value: str) -> list[str]:
    return [ln.strip() for ln in value.splitlines() if ln.strip()]


def test_every_subpackage_is_listed_in_setup_cfg() -> None:
    cfg = _setup_cfg()
    packages = set(_lines(cfg["options"]["packages"]))
    roots = dict(ln.split(" = ") for ln in _lines(cfg["options"]["package_dir"]))
    on_disk = set()
    for name, folder in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            on_disk.add(".".join([name, *rel.parts]))
    assert on_disk <= packages, f"add to setup.cfg [options] packages: {sorted(on_disk - packages)}"
    assert packages <= on_disk, f"listed but not on disk: {sorted(packages - on_disk)}"


def test_distribution_has_one_top_level_import_name() -> None:
    dist = metadata.distribution(overtake.DISTRIBUTION)
    tops = {name for name, dists in metadata.packages_distributions().items() if dist.name in dists}
    assert tops == {"overtake"}
    assert dist.entry_points.select(group="console_scripts", name="overtake")


def test_version_flag_prints_the_installed_version() -> None:
    out = subprocess.run([sys.executable, "-m", "overtake", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"overtake {metadata.version(overtake.DISTRIBUTION)} ({overtake.DISTRIBUTION})"


def test_the_version_constant_is_setup_cfgs() -> None:
    """``overtake.__version__`` is written out (no importlib.metadata at start-up): it must stay setup.cfg's."""
    assert overtake.__version__ == _setup_cfg()["metadata"]["version"]


def test_license_file_matches_the_metadata() -> None:
    assert "MIT License" in (REPO / "LICENSE").read_text()
    assert _setup_cfg()["metadata"]["license"] == "MIT"


@pytest.mark.timeout(900)  # a wheel build, a venv and three commands from it
@pytest.mark.slow
def test_built_wheel_runs_outside_the_checkout(tmp_path: Path) -> None:
    """`pip wheel . --no-deps` into a fresh venv: --version, compare and apache start all work from /tmp."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                   check=True, capture_output=True)
    (wheel,) = wheels.glob("overtake_server-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The dependencies come from this test's environment (a .pth line adds its site-packages after
    # the fresh venv's own, and .pth files inside it are not processed: the editable install is not seen).
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "_deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True)
    exe = venv / "bin" / "overtake"
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)

    out = run("--version")
    assert out.returncode == 0 and out.stdout.startswith("overtake "), out.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import overtake.mdp; print(overtake.mdp.__file__)"],
                           cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout
    assert str(venv) in where and str(REPO) not in where
    # the operator's files are package data: the dashboard, its scrape job, the example stages file
    shipped = ("import importlib.resources as r; d = r.files('overtake.dashboards'); e = r.files('overtake.apache_conf') / "
               "'examples'; print((d / 'grafana-sidecar.json').is_file(), (d / 'prometheus-scrape.yml').is_file(), "
               f"(e / 'stages.yaml').read_text() == open({str(REPO / 'examples' / 'sidecar' / 'stages.yaml')!r}).read())")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", shipped], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr
    scenario = shutil.copy(REPO / "examples" / "table1" / "case01.yaml", cwd / "case01.yaml")
    out = run("compare", str(scenario), "--json")
    assert out.returncode == 0, out.stderr
    assert '"pi*"' in out.stdout
    if not Path("/usr/sbin/apache2").exists():
        pytest.skip("apache2 not installed (apache-conf/install-debian-packages.sh)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Apache's worker user must reach the workdir: not under pytest's 0700 tmp root.
    workdir = Path(tempfile.mkdtemp(prefix="overtake-wheel-"))
    workdir.chmod(0o755)
    out = run("apache", "start", "--workdir", str(workdir), "--listen", f"127.0.0.1:{port}")
    try:
        assert out.returncode == 0, out.stderr
        assert "overtake_server" not in str(workdir)
        lua = (workdir / "lua" / "stage.lua").read_text()
        assert lua == (REPO / "apache-conf" / "lua" / "stage.lua").read_text()
    finally:
        run("apache", "stop", "--workdir", str(workdir))
        shutil.rmtree(workdir, ignore_errors=True)
