"""numba's kernels run from a read-only install whose user has no writable home.

numba caches a kernel beside its source or in ``~/.cache/numba`` and, where it can write neither
(a package's tree under systemd's ``ProtectSystem=strict`` and ``ProtectHome=``), refused to define
the kernel: ``cannot cache function ...: no locator available``. :mod:`overtake.jit` then points it
at the service's cache directory or a private folder under the temporary directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from overtake import jit

REPO = Path(__file__).resolve().parent.parent
UNWRITABLE = Path("/proc")  # not writable even for root: stands for a read-only tree and home


@pytest.fixture
def no_numba_places(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Neither beside the source nor in the home can be written; the temporary directory is tmp_path/tmp."""
    for var in (jit.CACHE_ENV, "CACHE_DIRECTORY", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(UNWRITABLE))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_numbas_own_places_are_kept_when_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(jit.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(UNWRITABLE))
    assert jit.cache_dir(tmp_path) is None  # beside the source
    monkeypatch.setenv("HOME", str(tmp_path))
    assert jit.cache_dir(UNWRITABLE) is None  # ~/.cache/numba
    assert (tmp_path / ".cache" / "numba").is_dir()


def test_a_users_numba_cache_dir_wins(no_numba_places: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jit.CACHE_ENV, str(no_numba_places / "mine"))
    assert jit.cache_dir(UNWRITABLE) is None


def test_the_services_cache_directory_comes_first(no_numba_places: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = no_numba_places / "var-cache-overtake"
    service.mkdir()
    monkeypatch.setenv("CACHE_DIRECTORY", f"{service}:{no_numba_places / 'second'}")
    assert jit.cache_dir(UNWRITABLE) == service / "numba"
    monkeypatch.setenv("CACHE_DIRECTORY", str(UNWRITABLE / "gone"))  # not writable: the next choice
    assert jit.cache_dir(UNWRITABLE) == no_numba_places / f"overtake-numba-{os.getuid()}"


def test_the_temporary_folder_is_private_to_the_user(no_numba_places: Path) -> None:
    folder = jit.cache_dir(UNWRITABLE)
    assert folder == no_numba_places / f"overtake-numba-{os.getuid()}"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert jit.cache_dir(UNWRITABLE) == folder  # reused by the next process


@pytest.mark.parametrize("spoil", ["other owner", "group writable", "a file"])
def test_a_temporary_folder_someone_else_controls_is_not_used(no_numba_places: Path, spoil: str) -> None:
    """numba's cache files are pickles: loading one another user planted would run their code."""
    planted = no_numba_places / f"overtake-numba-{os.getuid()}"
    if spoil == "a file":
        planted.write_text("")
    else:
        planted.mkdir(mode=0o700)
        if spoil == "group writable":
            planted.chmod(0o770)
        elif os.geteuid() == 0:
            os.chown(planted, 65534, 65534)
        else:
            pytest.skip("chown to another user needs root")
    folder = jit.cache_dir(UNWRITABLE)
    assert folder is not None and folder != planted
    assert folder.parent == no_numba_places and folder.stat().st_uid == os.getuid()
    assert folder.stat().st_mode & 0o777 == 0o700


RUN = """
import sys
from overtake.api.cli import main

code = main(["solve", {scenario!r}, "--out", "policy.npz", "--quiet"])
# every module that defines cached kernels (numba looks for a cache folder when a kernel is defined)
import overtake.fitting._hypererlang, overtake.fitting._uniformization, overtake.mdp._kernels_jit
import overtake.mdp._simkernel, overtake.mdp._heurkernel
from overtake.fitting._uniformization import poisson_capacity
from overtake.mdp.model import capacity_compiled

# two small kernels compiled, and cached, here
print(code, capacity_compiled(3.0, 2, 0.0), poisson_capacity(100.0))
"""


def _read_only_run(tmp: Path) -> subprocess.CompletedProcess[str]:
    """Run RUN with the checkout (package, venv) mounted read-only and an unwritable home."""
    env = {k: v for k, v in os.environ.items() if k not in (jit.CACHE_ENV, "CACHE_DIRECTORY", "XDG_CACHE_HOME")}
    env.update(HOME=str(REPO / "tests"), TMPDIR=str(tmp))
    mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    code = RUN.format(scenario=str(REPO / "examples" / "table1" / "case01.yaml"))
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(REPO),
                           sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=tmp)


@pytest.mark.timeout(900)  # numba compiles every kernel from scratch (600 s at most)
def test_a_read_only_install_with_no_writable_home_solves_and_compiles(tmp_path: Path) -> None:
    """The checkout mounted read-only, HOME not writable: a solve runs, every module with cached kernels
    imports, and numba compiles into the private folder under the temporary directory."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root (a read-only bind mount in a private mount namespace)")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespaces here: {probe.stderr.decode().strip()}")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = _read_only_run(tmp)
    assert "no locator" not in out.stderr
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1].split() == ["0", "2.0", str(100 + 10 * 10 + 60)]
    assert (tmp / "policy.npz").is_file()
    # numba's index files are named <source file>.<function>-<line>.pyXY.nbi
    cached = sorted(p.name.split("-")[0] for p in (tmp / f"overtake-numba-{os.getuid()}").rglob("*.nbi"))
    assert {"_uniformization.poisson_capacity", "model.capacity"} <= set(cached), cached
