"""A missing optional dependency names the distribution to install and one of its extras.

The import root is ``overtake``, but ``pip install 'overtake[...]'`` installs an unrelated project
(the name is taken on PyPI): every hint must name ``overtake.DISTRIBUTION``.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import overtake
from overtake.api.cli import main

REPO = Path(__file__).resolve().parent.parent
HINT = re.compile(r"pip install '([A-Za-z0-9_.-]+)\[([A-Za-z0-9_-]+)\]'")
#: the folders installed as the package (setup.cfg package_dir) and the user documents
SOURCES = ("overtake", "fitting", "mdp", "controller", "api", "apache-conf", "docs")


def _extras() -> set[str]:
    return set(metadata.metadata(overtake.DISTRIBUTION).get_all("Provides-Extra") or [])


def _assert_names_the_distribution(message: str) -> None:
    m = HINT.search(message)
    assert m, f"no `pip install '{overtake.DISTRIBUTION}[extra]'` hint in: {message}"
    assert m.group(1) == overtake.DISTRIBUTION, message
    assert m.group(2) in _extras(), f"{m.group(2)!r} is not an extra of {overtake.DISTRIBUTION}: {message}"


def test_install_hint_names_the_distribution_and_a_real_extra() -> None:
    for extra in sorted(_extras()):
        _assert_names_the_distribution(overtake.install_hint(extra))
    with pytest.raises(ValueError, match="no extra 'nonsense'"):
        overtake.install_hint("nonsense")


def test_no_source_or_document_hints_another_distribution() -> None:
    files = [p for d in SOURCES for p in (REPO / d).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh")]
    files += [REPO / "README.md"]
    wrong = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in files for m in HINT.finditer(p.read_text())
             if m.group(1) != overtake.DISTRIBUTION or m.group(2) not in _extras()]
    assert not wrong


def test_sweep_without_dask_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "dask.distributed", None)  # import raises ImportError
    assert main(["sweep", str(REPO / "examples" / "sweep" / "grid.yaml"), "--out", str(tmp_path / "r.csv")]) == 2
    _assert_names_the_distribution(capsys.readouterr().err)


def test_constrained_solve_without_cvxpy_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "cvxpy", None)
    code = main(["solve", str(REPO / "examples" / "table1" / "case01.yaml"), "--out", str(tmp_path / "p.npz"),
                 "--max-mean-threads", "2"])
    assert code == 2
    _assert_names_the_distribution(capsys.readouterr().err)


def test_convex_fit_start_without_cvxpy_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from overtake.fitting import MissingDependencyError, fit

    monkeypatch.setitem(sys.modules, "cvxpy", None)
    x = np.random.default_rng(0).exponential(1.0, size=200)
    with pytest.raises(MissingDependencyError) as err:
        fit(x, order=2, init="convex")
    _assert_names_the_distribution(str(err.value))
