"""The size guide's offenders: modules over 600 lines, classes over 250, functions over 60.

A guide, not a rule (a maintainer reads a short function whole), so this lists and does not fail.
Numba kernels are excepted: a function compiled by numba (decorated ``njit``/``jit``/
``vectorize``/``guvectorize``/``cfunc``, or marked ``# size: numba kernel`` on its ``def`` line)
is one loop nest the compiler wants whole, and a module of nothing but kernels is excepted from
the module limit. Run from the repository's root::

    python tests/support/sizes.py [fitting mdp controller api]
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MODULE_MAX, CLASS_MAX, FUNCTION_MAX = 600, 250, 60
PRODUCT = ("fitting", "mdp", "controller", "api")
_NUMBA = frozenset({"njit", "jit", "vectorize", "guvectorize", "cfunc", "generated_jit"})
MARK = "# size: numba kernel"


def _decorator_name(d: ast.expr) -> str:
    if isinstance(d, ast.Call):
        d = d.func
    if isinstance(d, ast.Attribute):
        return d.attr
    return d.id if isinstance(d, ast.Name) else ""


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    return any(_decorator_name(d) in _NUMBA for d in node.decorator_list) or MARK in lines[node.lineno - 1]


def offenders(path: Path) -> Iterator[tuple[str, str, int]]:
    """(kind, name, lines) of each part of the module at ``path`` above its limit."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text, str(path))
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    kernels_only = bool(defs) and all(not isinstance(n, ast.ClassDef) and _is_kernel(n, lines) for n in defs)
    if len(lines) > MODULE_MAX and not kernels_only:
        yield "module", str(path), len(lines)
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        n = (node.end_lineno or node.lineno) - node.lineno + 1
        where = f"{path}:{node.lineno} {node.name}"
        if isinstance(node, ast.ClassDef):
            if n > CLASS_MAX:
                yield "class", where, n
        elif n > FUNCTION_MAX and not _is_kernel(node, lines):
            yield "function", where, n


def main(roots: list[str]) -> int:
    found = [o for root in roots for p in sorted(Path(root).rglob("*.py")) for o in offenders(p)]
    for kind, plural, limit in (("module", "modules", MODULE_MAX), ("class", "classes", CLASS_MAX),
                                ("function", "functions", FUNCTION_MAX)):
        rows = sorted((o for o in found if o[0] == kind), key=lambda o: -o[2])
        print(f"{plural} over {limit} lines: {len(rows)}")
        for _, where, n in rows:
            print(f"  {n:5d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(PRODUCT)))
