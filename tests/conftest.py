"""Shared by the whole suite: whether the Debian packages a real Apache needs are here, the
``apache`` marker on every test that starts one, and mod_overtake_prio compiled once per run.

The packages are installed by ``apache-conf/install-debian-packages.sh`` (``make test`` runs it
first); a test never installs anything, it skips and names the installer. Helpers shared across
folders live in the ``support`` package next to this file (pytest puts this folder on the path
for its conftest).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from overtake.controller.errors import ApacheNotInstalledError
from overtake.controller.harness import apache
from overtake.controller.harness.apache import cpu_priority, lifecycle


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


@pytest.fixture(scope="session", autouse=True)
def mod_prio_built_once(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every private Apache with ``cpu_priority=`` compiles mod_overtake_prio into its own workdir
    (an apxs build of the whole module). The first build of a run is the harness's own, into a
    scratch workdir; later instances get a copy of that ``.so`` (its mtime kept, so newer than the
    sources) and the harness's up-to-date check then skips the compiler. A changed source, or
    another conf dir, builds again."""
    real = lifecycle.build_module
    built: dict[tuple[Path, float], Path] = {}

    def build_once(conf_dir: Path, workdir: Path) -> Path:
        sources = (Path(conf_dir) / cpu_priority.MODULE_DIR).rglob("*")
        key = (Path(conf_dir).resolve(), max(f.stat().st_mtime for f in sources))
        if key not in built:
            built[key] = real(conf_dir, tmp_path_factory.mktemp("mod-prio"))
        mod_dir = Path(workdir) / "modules"
        mod_dir.mkdir(parents=True, exist_ok=True)
        mod_dir.chmod(0o755)
        shutil.copy2(built[key], mod_dir / built[key].name)
        return real(conf_dir, workdir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lifecycle, "build_module", build_once)
        yield
