"""bench/_report.py: a bench's --record appends one raw run to bench/results/<bench>.jsonl and
replaces its own write-up in bench/results/sections.md (never appends); --no-write writes
nothing; --json prints the run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from support.bench import bench_module

report = bench_module("_report")

DOC = """# Benchmarks

Intro paragraph.

<!-- alpha:begin -->
## alpha: first claim

| a | b |
|---|---|
| 1 | 2 |
<!-- alpha:end -->

<!-- beta:begin -->
## beta: second claim
<!-- beta:end -->
"""


@pytest.fixture
def doc(tmp_path: Path) -> Path:
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(DOC)
    return path


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_recording_twice_leaves_one_section_with_the_latest_text(doc: Path) -> None:
    out1 = report.write_section("alpha", "## alpha: first claim\n\nrun one: 1.25", doc,
                                run={"mean": 1.25}, bench="demo_bench", command="python bench/demo_bench.py --record")
    text1 = doc.read_text()
    out2 = report.write_section("alpha", "## alpha: first claim\n\nrun two: 0.75", doc,
                                run={"mean": 0.75}, bench="demo_bench", command="python bench/demo_bench.py --record")
    text = doc.read_text()
    assert out1 == out2 == doc.parent / "bench" / "results" / "demo_bench.jsonl"
    assert text.count("<!-- alpha:begin -->") == 1 and text.count("<!-- alpha:end -->") == 1
    assert text.count("## alpha: first claim") == 1
    assert "run two: 0.75" in text and "run one" not in text
    # the rest of the document is untouched, byte for byte, and the line count did not grow
    assert text.replace("run two: 0.75", "") == text1.replace("run one: 1.25", "")
    assert text.startswith("# Benchmarks\n\nIntro paragraph.\n")
    assert "<!-- beta:begin -->\n## beta: second claim\n<!-- beta:end -->" in text


def test_jsonl_grows_by_one_line_per_record_and_keeps_every_run(doc: Path) -> None:
    results = doc.parent / "bench" / "results"
    for k in range(3):
        report.write_section("beta", f"## beta: second claim\n\nrun {k}", doc,
                             run={"k": k, "mean": 0.5 + k}, bench="demo_bench",
                             command=f"python bench/demo_bench.py --seed {k} --record")
        recs = _lines(results / "demo_bench.jsonl")
        assert len(recs) == k + 1
    assert [r["figures"]["k"] for r in recs] == [0, 1, 2]  # append-only, oldest first
    assert report.read_runs("demo_bench", results) == recs
    last = recs[-1]
    assert last["bench"] == "demo_bench" and last["section"] == "beta"
    assert last["command"] == "python bench/demo_bench.py --seed 2 --record"
    assert last["date"].endswith("Z") and last["date"][:2] == "20"
    assert "cores" in last["machine"] and "Python" in last["machine"]
    assert last["markdown"] == "## beta: second claim\n\nrun 2"
    # only the beta section changed; one section for three records
    assert doc.read_text().count("## beta: second claim") == 1


def _args(*flags: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    report.add_output_arguments(ap)
    return ap.parse_args(list(flags))


def test_no_write_writes_nothing(doc: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = doc.read_text()
    results = doc.parent / "bench" / "results"
    for flags in (("--record", "--no-write"), ("--no-write",), ("--record", "--no-write", "--json"), ()):
        got = report.publish(_args(*flags), "alpha", "## alpha: new", {"mean": 9.0}, bench="demo_bench",
                             path=doc, results=results)
        assert got is None
    assert doc.read_text() == before
    assert not results.exists()
    printed = capsys.readouterr().out
    assert "## alpha: new" in printed  # without --json the section is printed ...
    assert '"mean": 9.0' in printed  # ... with --json the run


def test_publish_json_prints_the_run_and_record_writes(doc: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = doc.parent / "r"
    got = report.publish(_args("--record", "--json"), "alpha", "## alpha: new", {"mean": 9.0},
                         bench="demo_bench", command="python bench/demo_bench.py", path=doc, results=results)
    assert json.loads(capsys.readouterr().out) == {"mean": 9.0}
    assert got == results / "demo_bench.jsonl"
    assert _lines(got)[0]["figures"] == {"mean": 9.0}
    assert "## alpha: new" in doc.read_text() and "first claim" not in doc.read_text()


def test_a_new_section_is_added_once_then_replaced(doc: Path) -> None:
    for k in range(2):
        report.write_section("gamma", f"## gamma: third claim\n\nrun {k}", doc, bench="demo_bench")
    text = doc.read_text()
    assert text.count("<!-- gamma:begin -->") == 1 and "run 1" in text and "run 0" not in text
    assert text.index("<!-- beta:end -->") < text.index("<!-- gamma:begin -->")


def test_a_section_marked_twice_is_refused_and_the_document_kept(doc: Path) -> None:
    doc.write_text(DOC + "\n<!-- beta:begin -->\nagain\n<!-- beta:end -->\n")
    before = doc.read_text()
    with pytest.raises(ValueError, match="section 'beta' is marked more than once"):
        report.replace_section("beta", "## beta", doc)
    assert doc.read_text() == before


def test_names_are_checked() -> None:
    with pytest.raises(ValueError, match="bench: '../x'"):
        report.append_run("../x", {})


def test_numpy_figures_are_stored_as_json(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    path = report.append_run("demo_bench", {"figures": {"a": np.float64(0.5), "v": np.arange(3)}}, tmp_path)
    assert _lines(path) == [{"figures": {"a": 0.5, "v": [0, 1, 2]}}]


def _uplink_run(mean_srpt: float) -> dict[str, Any]:
    def m(mean: float) -> dict[str, Any]:
        return {"mean_response_time": mean, "mean_slowdown": 2.0, "largest_1pct_mean_response_time": 1.0,
                "response_time_by_size_percentile": {"0-50": 0.01, "50-90": 0.02, "90-99": 0.05, "99-100": 1.0},
                "throughput_bytes_per_s": 1e6, "mean_connections": 3.0, "max_connections": 9, "errors": 0,
                "uplink": "test uplink"}
    return {"testbed": {"workload": "poisson", "sizes": "wc98", "load": 0.8, "duration_s": 60.0, "requests": 100,
                        "loadavg_1min_at_start": 0.1, "autogroup_nice": -20, "server": "sidecar",
                        "qdisc": "test qdisc", "solo_time_s": {"a": 0.002, "goodput_bps": 9.5e6},
                        "nominal_goodput_bps": 9.56e6, "offered_load_realised": 0.8, "srpt_top_fraction": 0.005,
                        "srpt_cutoffs_bytes": "1066,2630"},
            "policies": {"fair": m(0.1), "srpt": m(mean_srpt)}}


def test_uplink_srpt_record_replaces_its_section_and_appends_the_run(doc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uplink_srpt = bench_module("uplink_srpt")
    real = report.write_section
    monkeypatch.setattr(report, "write_section",
                        lambda name, text, **kw: real(name, text, doc, **kw))
    uplink_srpt._record(_uplink_run(0.025), ["--load", "0.8", "--record"])
    uplink_srpt._record(_uplink_run(0.031), ["--load", "0.8", "--seed", "2", "--record"])
    text = doc.read_text()
    assert text.count("<!-- uplink-srpt:begin -->") == 1
    assert text.count("### poisson wc98 load 0.8, 60.0 s, 100 requests") == 1  # the latest run only
    assert "| srpt | 0.031 | 0.31 |" in text and "| srpt | 0.025 |" not in text
    recs = _lines(doc.parent / "bench" / "results" / "uplink_srpt.jsonl")
    assert [r["figures"]["policies"]["srpt"]["mean_response_time"] for r in recs] == [0.025, 0.031]
    assert recs[1]["command"] == "python bench/uplink_srpt.py --load 0.8 --seed 2 --record"


def test_autogroup_nice_is_none_where_the_kernel_has_no_autogroups(monkeypatch: pytest.MonkeyPatch) -> None:
    # a CI runner's /proc/<pid>/autogroup was empty: the benches must record None, not crash
    real = Path.read_text

    canned = {"/proc/1/autogroup": "", "/proc/2/autogroup": "/autogroup-7 nice -20\n"}

    def fake(self: Path, *a: Any, **k: Any) -> str:
        return canned[str(self)] if str(self) in canned else real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", fake)
    assert report.autogroup_nice(1) is None
    assert report.autogroup_nice(2) == -20
    assert report.autogroup_nice(2**30) is None  # no such process
