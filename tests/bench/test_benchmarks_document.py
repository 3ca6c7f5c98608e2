"""BENCHMARKS.md stays a curated result: short, one provenance line per claim, no lab history.

Benches write their full write-ups to bench/results/sections.md (bench/_report.py); the curated
document is edited by hand, so these checks are what keeps it from growing back into a log.
"""

from __future__ import annotations

import re
from pathlib import Path

from support.bench import bench_module

report = bench_module("_report")

DOC = report.BENCHMARKS
ROOT = report.ROOT


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {p.split("\n", 1)[0].strip(): p for p in parts}


def test_the_document_is_at_most_40_kb() -> None:
    assert DOC.stat().st_size <= 40 * 1024, f"BENCHMARKS.md is {DOC.stat().st_size} bytes; curate it"


def test_no_issue_numbers_and_no_paper_paths() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert not re.search(r"\bissues? #?\d+", text, flags=re.I)
    assert "shared/" not in text


def test_every_claim_has_a_table_a_conclusion_and_a_provenance_line_that_resolves() -> None:
    sections = _sections(DOC.read_text(encoding="utf-8"))
    assert len(sections) >= 20
    for name, body in sections.items():
        assert "\n|---" in body, f"{name}: no table"
        assert "Conclusion:" in body, f"{name}: no conclusion"
        prov = [ln for ln in body.splitlines() if ln.startswith("Provenance:")]
        assert len(prov) == 1, f"{name}: needs exactly one Provenance: line"
        for target in re.findall(r"\]\(([^)#]+)", prov[0]):
            assert (ROOT / target).exists(), f"{name}: {target} does not exist"
        for raw in re.findall(r"`(?:bench/results/)?([a-z0-9_.-]+\.jsonl?)`", prov[0]):
            assert (report.RESULTS / raw).exists(), f"{name}: bench/results/{raw} does not exist"


def test_each_table_of_contents_entry_names_a_section() -> None:
    text = DOC.read_text(encoding="utf-8")
    names = set(_sections(text))
    for anchor in re.findall(r"\]\(#([a-z0-9-]+)\)", text):
        assert anchor in names, f"table of contents links #{anchor}, which is no section"


def test_write_ups_go_to_sections_md_never_to_the_document() -> None:
    assert report.SECTIONS == ROOT / "bench" / "results" / "sections.md"
    import inspect
    for fn in (report.replace_section, report.write_section, report.publish):
        assert inspect.signature(fn).parameters["path"].default == report.SECTIONS
    text = report.SECTIONS.read_text(encoding="utf-8")
    for name in re.findall(r"<!-- ([a-z0-9_.-]+):begin -->", text):
        assert text.count(f"<!-- {name}:begin -->") == 1 and text.count(f"<!-- {name}:end -->") == 1


def test_bench_scripts_do_not_open_the_curated_document() -> None:
    for script in sorted((ROOT / "bench").glob("*.py")):
        if script.name == "_report.py":
            continue
        src = script.read_text(encoding="utf-8")
        assert '"BENCHMARKS.md"' not in src and "report.BENCHMARKS" not in src, script.name
        assert not re.search(r"\bBENCHMARKS\b(?!\.md)", src), f"{script.name} uses _report.BENCHMARKS"


def test_sections_path_is_a_file_in_the_repository() -> None:
    assert Path(report.SECTIONS).is_file()
