"""mod_overtake_prio's build: one list of files, shipped whole, compiled with ``-Werror``.

The private Apache's build (``MODULE_SOURCES``, ``MODULE_HEADERS``, ``MODULE_CFLAGS`` in
``controller/harness/apache/cpu_priority.py``) and ``apache-conf/mod_overtake_prio/Makefile`` (what a
package build runs) must name the same files and flags; every C file of the folder is in them and
in the package data. ``make`` builds the module with ``apxs``: a warning fails it, and the module
exports its record and nothing else (Apache loads modules with RTLD_GLOBAL).
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from overtake.controller.harness.apache.cpu_priority import (
    MODULE_CFLAGS,
    MODULE_DIR,
    MODULE_HEADERS,
    MODULE_SOURCES,
)

REPO = Path(__file__).resolve().parents[3]
CONF = REPO / "apache-conf"
SRC = CONF / MODULE_DIR


def _make_var(name: str) -> list[str]:
    m = re.search(rf"^{name}\s*=\s*(.*)$", (SRC / "Makefile").read_text(), re.M)
    assert m, f"Makefile has no {name}"
    return m.group(1).split()


def test_makefile_and_harness_name_the_same_files_and_flags() -> None:
    assert _make_var("SOURCES") == list(MODULE_SOURCES)
    assert _make_var("HEADERS") == list(MODULE_HEADERS)
    assert [*_make_var("WARNINGS"), "-O2"] == list(MODULE_CFLAGS)
    assert "-Werror" in MODULE_CFLAGS


def test_every_file_is_listed_and_shipped() -> None:
    on_disk = {p.name for p in SRC.iterdir() if p.suffix in (".c", ".h")}
    assert on_disk == {*MODULE_SOURCES, *MODULE_HEADERS}
    cfg = (REPO / "setup.cfg").read_text()
    line = next(ln for ln in cfg.splitlines() if ln.startswith("overtake.apache_conf ="))
    patterns = [p.strip() for p in line.split("=", 1)[1].split(",")]
    for name in (*MODULE_SOURCES, *MODULE_HEADERS, "Makefile", "README.md"):
        rel = (MODULE_DIR / name).as_posix()
        assert any(fnmatch.fnmatchcase(rel, p) for p in patterns), f"{rel} is not package data"


@pytest.fixture(scope="module")
def tools() -> None:
    for tool in ("apxs", "make", "nm"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (apache-conf/install-debian-packages.sh installs apache2-dev)")


def _make(tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-C", str(tmp)], capture_output=True, text=True, check=False, timeout=600)


@pytest.mark.timeout(900)  # a full apxs build of the module (600 s at most)
def test_make_exports_only_the_module_record(tools: None, tmp_path: Path) -> None:
    build = tmp_path / "mod"
    shutil.copytree(SRC, build)
    proc = _make(build)
    assert proc.returncode == 0, proc.stderr[-2000:]
    nm = subprocess.run(["nm", "-D", "--defined-only", str(build / ".libs" / "mod_overtake_prio.so")],
                        capture_output=True, text=True, check=True)
    assert [ln.split()[-1] for ln in nm.stdout.splitlines()] == ["overtake_prio_module"]


@pytest.mark.timeout(900)  # a full apxs build of the module (600 s at most)
def test_a_warning_fails_the_build(tools: None, tmp_path: Path) -> None:
    build = tmp_path / "mod"
    shutil.copytree(SRC, build)
    with (build / "op_status.c").open("a") as f:
        f.write("\nstatic int op_unused(void) { return 0; }\n")
    proc = _make(build)
    assert proc.returncode != 0
    assert "op_unused" in proc.stderr + proc.stdout


def _ranges(text: str) -> set[int]:
    """The ids a "`AH90001`–`AH90009`, `AH90200` and ..." list names, ranges expanded."""
    out: set[int] = set()
    for a, b in re.findall(r"`AH(\d+)`(?:–`AH(\d+)`)?", text):
        out.update(range(int(a), int(b or a) + 1))
    return out


def test_the_readme_lists_exactly_the_log_ids_the_module_uses() -> None:
    used = {int(n) for f in SRC.glob("*.[ch]") for n in re.findall(r"APLOGNO\((\d+)\)", f.read_text())}
    readme = (SRC / "README.md").read_text(encoding="utf-8")
    m = re.search(r"The module's log messages carry\s+the\s+ids\s+(.*?)\.\s", readme, re.S)
    assert m, "README: the sentence listing the log ids is gone"
    assert _ranges(m.group(1)) == used, f"README lists {sorted(_ranges(m.group(1)))}, the sources use {sorted(used)}"


def test_the_readme_has_a_row_for_every_directive() -> None:
    declared = {n for f in SRC.glob("*.[ch]") for n in re.findall(r'AP_INIT_\w+\(\s*"(\w+)"', f.read_text())}
    rows = set(re.findall(r"^\| `(Overtake\w+)", (SRC / "README.md").read_text(encoding="utf-8"), re.M))
    assert len(declared) >= 20
    assert declared == rows, (f"README rows without a directive: {sorted(rows - declared)}; "
                              f"directives without a row: {sorted(declared - rows)}")
