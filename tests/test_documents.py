"""User documents: short enough to read, no lab history, and every relative link resolves.

README and docs/ are for users (what, how, reference, why); measurements live in BENCHMARKS.md
and decisions in docs/decisions/. Issue numbers and test names mean nothing to a user.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.documents import ROOT, USER_DOCS

LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_at_most_2500_words() -> None:
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words <= 2500, f"README.md has {words} words; move detail into docs/"


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_numbers_test_names_or_paper_numbers(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert not re.search(r"\bissues? #?\d+", text, flags=re.I), "an issue number"
    assert not re.search(r"\btest_[a-z0-9_]+\b", text), "a test's name (lab history)"
    assert not re.search(r"\bpaper \[?\d{3}\]?", text, flags=re.I), "a paper cited by number, not by authors"
    assert "../shared" not in text


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        assert (doc.parent / path).exists(), f"{doc.relative_to(ROOT)} links {target}, which does not exist"
