"""Shared by the whole suite: whether the Debian packages a real Apache needs are here, and the
``apache`` marker on every test that starts one.

The packages are installed by ``apache-conf/install-debian-packages.sh`` (``make test`` runs it
first); a test never installs anything, it skips and names the installer. Helpers shared across
folders live in the ``support`` package next to this file (pytest puts this folder on the path
for its conftest).
"""

from __future__ import annotations

import pytest

from overtake.controller.errors import ApacheNotInstalledError
from overtake.controller.harness import apache


@pytest.fixture(scope="session")
def apache_available() -> None:
    """Apache, mod_lua and the C toolchain are installed; every test using this is marked ``apache``."""
    try:
        apache.check_installed()
    except ApacheNotInstalledError as e:  # its message names the package and the installer
        pytest.skip(str(e))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "apache_available" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.apache)
