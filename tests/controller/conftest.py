"""Shared by the controller tests: the real Apache they run against (installed on demand), and
for the sidecar-as-a-process tests a module-wide scratch directory and stub upstream."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_helpers import StubApache

from overtake.controller.errors import ApacheNotInstalledError
from overtake.controller.harness import apache

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "apache-conf" / "install-debian-packages.sh"


def apache_installed() -> bool:
    try:
        apache.check_installed()
    except ApacheNotInstalledError:
        return False
    return True


@pytest.fixture(scope="module")
def apache_available() -> None:
    """Apache, mod_lua and the C toolchain, installed by the project's installer when root."""
    if apache_installed():
        return
    if os.geteuid() != 0:
        pytest.skip(
            "apache2/liblua5.3-dev/gcc not installed and not root: run "
            "`sudo apache-conf/install-debian-packages.sh` to enable these tests"
        )
    subprocess.run(["sh", str(INSTALLER)], check=True)
    assert apache_installed(), "install-debian-packages.sh ran but the packages are still missing"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch directory shared by one test module."""
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="module")
def stub() -> Iterator[StubApache]:
    """service_helpers' loopback stand-in for Apache, one per test module."""
    s = StubApache()
    try:
        yield s
    finally:
        s.close()
