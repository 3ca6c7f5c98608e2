"""The API reference names every endpoint the API serves: each path and method of its OpenAPI
document appears in docs/reference/api.md as ``METHOD /path`` (path parameters by any name,
``/v1/fits[/{id}]`` covering both forms)."""

from __future__ import annotations

import re
from pathlib import Path

from overtake.api.app import create_app
from overtake.api.deps import Settings

ROOT = Path(__file__).resolve().parents[2]


def _shape(text: str) -> str:
    return re.sub(r"\{[^}]+\}", "{}", text)


def test_every_endpoint_is_in_the_reference(tmp_path: Path) -> None:
    spec = create_app(Settings(db=str(tmp_path / "api.db"))).openapi()
    doc = _shape((ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8"))
    doc = re.sub(r"\[(/\{\})\]", r"\1", doc) + "\n" + re.sub(r"\[/\{\}\]", "", doc)  # GET /v1/fits[/{id}]
    served = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops if not p.startswith("/docs")]
    assert len(served) >= 10
    missing = [f"{m} {p}" for m, p in served if not re.search(rf"`{m} {re.escape(_shape(p))}[`?\s]", doc)]
    assert not missing, f"docs/reference/api.md names no {missing}"
