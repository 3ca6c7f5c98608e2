"""The uplink room's curated API (httpx-style guard) and its walls: it imports no other room."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import overtake.controller.uplink as uplink

MODULES = {"app", "bands", "errors", "factory", "fair", "kernel", "metrics", "permits", "qdisc", "flow", "tcpinfo"}


def test_all_is_sorted_and_complete() -> None:
    assert uplink.__all__ == sorted(uplink.__all__)
    public = {n for n in dir(uplink) if not n.startswith("_")} - MODULES - {"annotations"}
    assert public == set(uplink.__all__)


def test_every_module_lists_only_names_it_has() -> None:
    root = Path(uplink.__file__).parent
    assert {p.stem for p in root.glob("*.py")} - {"__init__"} == MODULES
    for name in sorted(MODULES):
        mod = importlib.import_module(f"overtake.controller.uplink.{name}")
        assert mod.__all__ == sorted(mod.__all__, key=lambda n: (not n.isupper(), not n[0].isupper(), n)), name
        assert all(hasattr(mod, n) for n in mod.__all__), name


def test_the_room_imports_only_itself_and_the_error_root() -> None:
    root = Path(uplink.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("overtake"):
                assert node.module.startswith("overtake.controller.uplink") or node.module == "overtake.controller.errors", (
                    path.name, node.module)
