"""The user documents the document tests read: README.md, docs/ (not its decision records) and the
READMEs under apache-conf/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "decisions" not in p.parts),
             *sorted((ROOT / "apache-conf").rglob("*.md"))]
