"""No import cycles among the product's modules, imports inside functions and ``TYPE_CHECKING`` included.

A cycle held together by a lazy import still ties the modules into one unit: neither can be read,
tested or moved without the other, and the order of first use decides what works. The product's
modules are the packages of setup.cfg's ``package_dir`` (the harness package, which only tests,
benches and the demo use, is not product code). Every ``import`` statement anywhere in a module
is an edge to the product module it names: ``from p import x`` names ``p.x`` when that is a
module, else ``p``; the parent packages a dotted import loads on the way are not edges.

The harness goes one way too: it may import the product, no product module imports it (a
product that needs the harness would ship test tooling and break when it changes).
"""

from __future__ import annotations

import ast
import configparser
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the harness: launchers for a private Apache and Prometheus, load generation (tests, benches, the demo)
HARNESS = "overtake.controller.harness"
#: packages whose modules are not product code
EXCLUDED = (HARNESS,)
#: the harness's command-line front ends (``overtake apache``, ``overtake prometheus``): they exist to
#: start the harness's Apache and Prometheus, so they are the one place the product names it
HARNESS_FRONT_ENDS = frozenset({"overtake.api.commands.apache", "overtake.api.commands.prometheus"})



def package_dirs() -> dict[str, Path]:
    """Import name -> folder, from setup.cfg's ``package_dir``."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    out: dict[str, Path] = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = (s.strip() for s in line.partition("="))
        out[name] = ROOT / folder
    return out


def product_modules() -> dict[str, Path]:
    """Every module of the product: dotted name -> file (a package's is its ``__init__.py``)."""
    dirs = package_dirs()
    out: dict[str, Path] = {}
    for pkg, folder in dirs.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            if any(not (folder.joinpath(*rel[:i]) / "__init__.py").exists() for i in range(len(rel))):
                continue  # not inside a package (scripts, examples)
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            name = ".".join((pkg, *parts))
            if any(name == d or name.startswith(d + ".") for d in dirs if d != pkg and d.startswith(pkg + ".")):
                continue  # a sub-package with a folder of its own is listed under its own entry
            if any(name == e or name.startswith(e + ".") for e in EXCLUDED):
                continue
            out[name] = path
    return out


def _imported(name: str, path: Path, tree: ast.AST) -> Iterator[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement of module ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names]


def imports_under(name: str, path: Path, package: str) -> list[str]:
    """The modules under ``package`` that module ``name`` imports, anywhere in its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[str] = []
    for mod, names in _imported(name, path, tree):
        for target in [mod, *(f"{mod}.{n}" for n in names)]:
            if target == package or target.startswith(package + "."):
                found.append(target)
                break
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the product modules it imports (anywhere in its source)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for mod, names in _imported(name, path, tree):
            targets = [f"{mod}.{n}" if f"{mod}.{n}" in modules else mod for n in names] or [mod]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.add(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def describe(comp: frozenset[str], graph: dict[str, set[str]]) -> str:
    """One closed path through the component, for the failure message."""
    start = min(comp)
    path, seen = [start], {start}
    node = start
    while True:
        nxt = sorted(graph[node] & comp)
        back = [n for n in nxt if n == start]
        if back and len(path) > 1:
            return " -> ".join([*path, start])
        fresh = [n for n in nxt if n not in seen]
        if not fresh:
            return " -> ".join([*path, nxt[0]]) + f"  (component: {', '.join(sorted(comp))})"
        node = fresh[0]
        path.append(node)
        seen.add(node)


def test_the_checker_finds_a_lazy_cycle(tmp_path):
    """Two modules importing each other, one of them inside a function, are one cycle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    mods = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py", "pkg.c": pkg / "c.py"}
    graph = import_graph(mods)
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.b"] == {"pkg.a"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b"})]


def test_no_import_cycles_among_product_modules():
    modules = product_modules()
    assert "overtake.mdp.model" in modules and "overtake.fitting" in modules
    graph = import_graph(modules)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(c, graph) for c in found)


def test_the_checker_finds_a_lazy_harness_import(tmp_path):
    """A module importing the harness inside a function, or naming it with ``from pkg import``, is found."""
    pkg = tmp_path / "pkg"
    (pkg / "harness").mkdir(parents=True)
    (pkg / "harness" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.harness import tool\n    return tool\n")
    (pkg / "b.py").write_text("from pkg import harness\n")
    (pkg / "c.py").write_text("from pkg import harnessing\n")
    assert imports_under("pkg.a", pkg / "a.py", "pkg.harness") == ["pkg.harness"]
    assert imports_under("pkg.b", pkg / "b.py", "pkg.harness") == ["pkg.harness"]
    assert imports_under("pkg.c", pkg / "c.py", "pkg.harness") == []


def test_no_product_module_imports_the_harness():
    modules = product_modules()
    assert "overtake.controller.sidecar.metrics" in modules and not any(m.startswith(HARNESS) for m in modules)
    found = {name: imports_under(name, path, HARNESS) for name, path in modules.items()}
    found = {name: hits for name, hits in found.items() if hits and name not in HARNESS_FRONT_ENDS}
    assert not found, "product modules importing the harness (move what they need to the product side):\n" + \
        "\n".join(f"{name}: {', '.join(hits)}" for name, hits in sorted(found.items()))
    assert all(imports_under(m, modules[m], HARNESS) for m in HARNESS_FRONT_ENDS), \
        "a harness front end no longer imports the harness: remove it from HARNESS_FRONT_ENDS"
