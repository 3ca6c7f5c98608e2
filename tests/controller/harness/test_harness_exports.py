"""The harness room's curated API (httpx-style guard) and its walls: the proxy never imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

import overtake.controller.harness as harness
from overtake.controller.harness import apache, loadgen, prometheus

APACHE_MODULES = {"access_log", "config", "cpu_priority", "instance", "lifecycle", "mod_status", "prepare", "prio_status"}


def test_apache_all_is_sorted_and_complete() -> None:
    assert apache.__all__ == sorted(apache.__all__)
    public = {n for n in dir(apache) if not n.startswith("_")} - APACHE_MODULES - {"annotations"}
    assert public == set(apache.__all__)
    assert {p.stem for p in Path(apache.__file__).parent.glob("*.py")} - {"__init__"} == APACHE_MODULES


def test_launchers_list_only_names_they_have() -> None:
    assert harness.__all__ == []
    for mod in (loadgen, prometheus):
        assert all(hasattr(mod, n) for n in mod.__all__), mod.__name__


def test_the_room_imports_only_itself_the_error_root_the_model_and_apache_formats() -> None:
    """Besides the model, the harness takes from the product only what Apache writes and the product
    reads: the mod_status parser and the access-log format."""
    allowed = ("overtake.controller.harness", "overtake.controller.errors", "overtake.mdp",
               "overtake.controller.sidecar.mod_status", "overtake.controller.log_format")
    for path in sorted(Path(harness.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("overtake"):
                assert node.module.startswith(allowed), (path.name, node.module)
