"""The curated public API (httpx-style guard)."""

from __future__ import annotations

import pathlib

import overtake.fitting as fitting


def test_all_is_sorted_and_complete() -> None:
    assert fitting.__all__ == sorted(fitting.__all__)
    public = {n for n in dir(fitting) if not n.startswith("_")}
    # submodules appear in the namespace once anything imports them (the suite's order decides)
    modules = {p.stem for p in pathlib.Path(fitting.__file__).parent.glob("*.py")} | {"annotations"}
    assert public - modules == set(fitting.__all__)


def test_fitting_does_not_import_solver_or_apps() -> None:
    import ast
    import pathlib

    root = pathlib.Path(fitting.__file__).parent
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in {"mdp", "controller", "api", "asyncio", "os"}, (path.name, n)


def test_error_tree() -> None:
    assert issubclass(fitting.FittingInputError, fitting.FittingError)
    assert issubclass(fitting.FittingInputError, ValueError)
    for cls in (fitting.DataError, fitting.InvalidParameterError, fitting.MomentError, fitting.LogFormatError):
        assert issubclass(cls, fitting.FittingInputError)
    assert issubclass(fitting.MissingDependencyError, ImportError)
