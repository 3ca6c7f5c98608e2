"""The bench scripts, imported by file path for the tests of the bench.

bench/ is a folder of scripts, not a package: each runs as ``python bench/X.py`` (so bench/ is
its ``sys.path[0]``) and imports its siblings by name (``from _report import ...``, ``from uplink
import testbed``). :func:`bench_module` loads a script, or one of the folder's packages, under
that same name from its file, after first loading the siblings it imports, so that those
imports find them in ``sys.modules``; nothing is added to ``sys.path``.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"

_loading: set[str] = set()  # names whose siblings are being loaded (a cycle stops here)


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py or the package bench/NAME/, imported as module ``NAME``; ``PACKAGE.MODULE``
    names a module of one of bench/'s packages."""
    if "." in name:
        bench_module(name.split(".")[0])
        return importlib.import_module(name)  # found through the package's __path__
    loaded = sys.modules.get(name)
    if loaded is not None:
        if not _is_bench(loaded):
            raise ImportError(f"a module {name!r} from outside bench/ is already imported ({loaded!r})")
        return loaded
    spec = PathFinder.find_spec(name, [str(BENCH)])
    if spec is None or spec.loader is None or spec.origin is None:
        raise ModuleNotFoundError(f"no bench/{name}.py nor bench/{name}/", name=name)
    _loading.add(name)
    try:
        for sibling in sorted(_siblings(spec) - _loading):
            bench_module(sibling)
    finally:
        _loading.discard(name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _is_bench(module: ModuleType) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is not None and Path(origin).resolve().is_relative_to(BENCH)


def _siblings(spec: ModuleSpec) -> set[str]:
    """Top-level names imported by the module (every file of a package) that live in bench/."""
    assert spec.origin is not None
    files = sorted(Path(spec.origin).parent.glob("*.py")) if spec.submodule_search_locations else [Path(spec.origin)]
    names: set[str] = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    own = spec.name.split(".")[0]
    return {n for n in names if n != own and ((BENCH / f"{n}.py").is_file() or (BENCH / n / "__init__.py").is_file())}
