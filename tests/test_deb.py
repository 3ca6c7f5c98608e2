"""The Debian package `make deb` builds: its files, conffiles and metadata (dpkg-deb -I, its file tree).

Built once (make rebuilds it only when a shipped file changed; `make test` builds it in its
set-up, beside the other jobs there). Installing it into a clean Debian 12 root and serving
requests through it is bench/deb_install.py (minutes: not here).
"""

from __future__ import annotations

import configparser
import json
import marshal
import os
import re
import shlex
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
VENV = "/opt/overtake/venv"
SITE = f"{VENV}/lib/python3.11/site-packages"
#: files whose content the tests read (the rest: names, types and link targets)
READ = ("/lib/systemd/system/overtake-sidecar.service", "/etc/apache2/mods-available/overtake_prio.load",
        "/etc/apache2/mods-available/overtake_prio.conf", "/etc/overtake/sidecar.yaml", f"{VENV}/bin/overtake",
        f"{VENV}/pyvenv.cfg", f"{SITE}/overtake/__pycache__/__init__.cpython-311.pyc",
        "/usr/share/overtake/dashboards/grafana-sidecar.json", "/usr/share/overtake/dashboards/prometheus-scrape.yml",
        "/usr/share/overtake/examples/stages.yaml", "/usr/share/overtake/examples/sidecar.yaml")


@dataclass
class Deb:
    path: Path
    control: dict[str, str]
    conffiles: list[str]
    scripts: dict[str, str]
    members: dict[str, tarfile.TarInfo]  # absolute path -> entry
    content: dict[str, bytes]

    def exists(self, path: str) -> bool:
        """The path, or what a symlink on the way points at, is in the package."""
        seen = 0
        while path in self.members and self.members[path].issym() and seen < 10:
            target = self.members[path].linkname
            path = target if target.startswith("/") else str(Path(path).parent / target)
            seen += 1
        return path in self.members


def _version() -> str:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg["metadata"]["version"]


def _control_file(path: Path, name: str) -> str:
    out = subprocess.run(["dpkg-deb", "-I", str(path), name], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else ""


@pytest.fixture(scope="module")
def deb() -> Iterator[Deb]:
    if shutil.which("dpkg-deb") is None:
        pytest.skip("not a Debian system (no dpkg-deb)")
    tools = shutil.which("apxs") and Path("/usr/include/python3.11/Python.h").exists() and Path("/usr/bin/python3.11").exists()
    if not tools and os.geteuid() != 0:
        pytest.skip("make deb needs python3.11-dev and apache2-dev: run it once as root (it installs them)")
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    path = REPO / "dist" / f"overtake-server_{_version()}_{arch}.deb"
    build = subprocess.run(["make", "-C", str(REPO), "deb"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-4000:]
    fields = subprocess.run(["dpkg-deb", "-f", str(path)], capture_output=True, text=True, check=True).stdout
    control = dict(re.findall(r"^(\S+): (.*)$", fields, re.MULTILINE))
    members, content = {}, {}
    with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(path)], stdout=subprocess.PIPE) as proc:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:  # one pass, streamed
            for m in tf:
                name = "/" + m.name.removeprefix("./").rstrip("/")
                members[name] = m
                if name in READ and m.isfile():
                    content[name] = tf.extractfile(m).read()  # type: ignore[union-attr]
    assert proc.returncode == 0
    scripts = {s: _control_file(path, s) for s in ("postinst", "prerm", "postrm")}
    yield Deb(path, control, _control_file(path, "conffiles").split(), scripts, members, content)


def test_name_version_and_dependencies(deb: Deb) -> None:
    assert deb.path.name == f"overtake-server_{_version()}_{deb.control['Architecture']}.deb"
    assert deb.control["Package"] == "overtake-server" and deb.control["Version"] == _version()
    depends = {d.split()[0] for d in deb.control["Depends"].split(", ")}
    assert {"python3.11", "adduser", "libc6"} <= depends, depends  # the venv's interpreter, postinst, the .so files
    assert "apache2" in deb.control["Recommends"]


def test_the_application_is_a_venv_under_opt_with_its_command_in_usr_bin(deb: Deb) -> None:
    assert deb.members["/usr/bin/overtake"].issym() and deb.members["/usr/bin/overtake"].linkname == f"{VENV}/bin/overtake"
    assert deb.exists("/usr/bin/overtake")
    assert deb.members[f"{VENV}/bin/python3.11"].linkname == "/usr/bin/python3.11"  # Debian's interpreter
    # moved from the staging folder: the entry point, the venv's config and the bytecode name /opt
    assert deb.content[f"{VENV}/bin/overtake"].split(b"\n")[0] == f"#!{VENV}/bin/python".encode()
    assert b"/tmp" not in deb.content[f"{VENV}/pyvenv.cfg"]
    code = marshal.loads(deb.content[f"{SITE}/overtake/__pycache__/__init__.cpython-311.pyc"][16:])
    assert code.co_filename == f"{SITE}/overtake/__init__.py"  # numba finds a kernel's source by this name
    assert not any(n.endswith((".nbi", ".nbc")) for n in deb.members)  # no JIT cache for another CPU


def test_the_solver_kernels_are_built_ahead_of_time(deb: Deb) -> None:
    mdp = f"{SITE}/overtake/mdp"
    assert any(re.fullmatch(re.escape(mdp) + r"/_kernels_aot\.cpython-311-.*\.so", n) for n in deb.members)
    assert deb.members[f"{mdp}/_kernels_aot.sha256"].isfile() and deb.members[f"{mdp}/_kernels_jit.py"].isfile()


def test_mod_overtake_prio_for_a2enmod(deb: Deb) -> None:
    load = deb.content["/etc/apache2/mods-available/overtake_prio.load"].decode()
    (module, so), = re.findall(r"^LoadModule\s+(\S+)\s+(\S+)", load, re.MULTILINE)
    assert module == "overtake_prio_module" and so == "/usr/lib/apache2/modules/mod_overtake_prio.so"
    assert deb.members[so].isfile()
    conf = deb.content["/etc/apache2/mods-available/overtake_prio.conf"].decode()
    assert re.search(r"<IfModule\s+overtake_prio_module>", conf) and "SetHandler overtake-prio-status" in conf


def test_the_units_command_user_and_directories_exist(deb: Deb) -> None:
    unit = deb.content["/lib/systemd/system/overtake-sidecar.service"].decode()
    assert unit == (REPO / "apache-conf" / "overtake-sidecar.service").read_text()
    svc = dict(re.findall(r"^(ExecStart|User|Group|LogsDirectory|Environment)=(.*)$", unit, re.MULTILINE))
    argv = shlex.split(svc["ExecStart"])
    assert deb.exists(argv[0]), f"ExecStart={argv[0]} is not in the package"
    config = re.search(r"OVERTAKE_CONFIG=(\S+)", unit)
    assert config and config[1] in deb.conffiles and argv[1:] == ["sidecar", "--config", "${OVERTAKE_CONFIG}"]
    # the user is the one postinst creates, and the log folder is shipped
    assert re.search(rf"adduser .*--system .*\b{svc['User']}\s*$", deb.scripts["postinst"], re.MULTILINE)
    assert svc["Group"] == svc["User"] and "--group" in deb.scripts["postinst"]
    assert deb.members[f"/var/log/{svc['LogsDirectory']}"].isdir()
    assert re.search(r"deluser .*--system .*overtake", deb.scripts["postrm"])
    assert "purge" in deb.scripts["postrm"]


def test_every_file_in_etc_is_a_conffile(deb: Deb) -> None:
    in_etc = sorted(n for n, m in deb.members.items() if n.startswith("/etc/") and m.isfile())
    assert sorted(deb.conffiles) == in_etc
    assert "/etc/overtake/sidecar.yaml" in in_etc
    assert deb.content["/etc/overtake/sidecar.yaml"] == (REPO / "apache-conf" / "examples" / "sidecar.yaml").read_bytes()


def test_the_dashboard_scrape_job_and_examples_are_shipped(deb: Deb) -> None:
    share = "/usr/share/overtake"
    for name, source in [("dashboards/grafana-sidecar.json", "dashboards/grafana-sidecar.json"),
                         ("dashboards/prometheus-scrape.yml", "dashboards/prometheus-scrape.yml"),
                         ("examples/stages.yaml", "examples/sidecar/stages.yaml"),
                         ("examples/sidecar.yaml", "apache-conf/examples/sidecar.yaml")]:
        assert deb.content[f"{share}/{name}"] == (REPO / source).read_bytes(), name
    # the dashboard's description names files installed beside it
    description = json.loads(deb.content[f"{share}/dashboards/grafana-sidecar.json"])["description"]
    for named in re.findall(r"[\w./-]+\.(?:json|ya?ml)\b", description):
        assert f"{share}/dashboards/{named}" in deb.members, named
    assert yaml.safe_load(deb.content[f"{share}/dashboards/prometheus-scrape.yml"])["scrape_configs"][0]["metrics_path"]
    # the example config's relative stages: file is beside it
    assert yaml.safe_load(deb.content[f"{share}/examples/sidecar.yaml"])["stages"] == "stages.yaml"
    # and in the wheel's package data, for the venv
    assert deb.members[f"{SITE}/overtake/dashboards/prometheus-scrape.yml"].isfile()
    assert deb.members[f"{SITE}/overtake/apache_conf/examples/stages.yaml"].isfile()
