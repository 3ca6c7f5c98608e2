"""bench/value_of_information.py --merge: the section shows every case, each from the latest
recorded run that has it, on synthetic records (no solving).

Known answers: a case in this run is never taken from a record; a case in two records comes from
the later one; a record parsed from logs (``ew`` only) gets its best baseline and gains derived
from ``ew``; the section names the run of every case and says "no" when an invariant fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.bench import bench_module

report = bench_module("_report")
voi = bench_module("value_of_information")


def _ew(full: float, start: float, none: float, pi1: float, pi_inf: float, route: float | None = None) -> dict[str, float]:
    ew = {"full": full, "start": start, "none": none, "pi(1)": pi1, "pi(2)": max(pi1, pi_inf) + 0.1,
          "pi(4)": max(pi1, pi_inf) + 0.05, "pi(inf)": pi_inf, "pi(1,1)": max(pi1, pi_inf) + 1.0, "heuristic": full}
    if route is not None:
        ew["route"] = route
    return ew


OLD = {"date": "2026-11-24T01:58Z", "bench": "value_of_information", "command": "python bench/value_of_information.py --jobs 1",
       "machine": "2 cores", "section": "value-of-information",
       # as parsed from logs: ew only, no tol, no best baseline, no summaries
       "figures": {"cases": {"1": {"ew": _ew(4.25, 4.25, 4.25, 4.25, 5.0)},
                             "2": {"ew": _ew(4.385, 4.7729, 4.9203, 5.7124, 4.9775, route=4.6151)}}}}


def _run(case: int, ew: dict[str, float], date: str, **extra: Any) -> dict[str, Any]:
    base = {k: v for k, v in ew.items() if k.startswith("pi(")}
    best = min(base, key=lambda k: base[k])
    return {"case": case, "ew": ew, "seconds": {"full": 1.0}, "none": {"source": "improved"}, "best_baseline": best,
            "none_gain_over_best_baseline": (base[best] - ew["none"]) / ew["none"],
            "none_gain_over_pi_inf": (base["pi(inf)"] - ew["none"]) / ew["none"],
            "run": {"date": date, "command": f"python bench/value_of_information.py --cases {case}", "tol": 1e-3},
            **extra}


NEWER = {"date": "2026-11-26T15:40:00+00:00", "bench": "value_of_information",
         "command": "python bench/value_of_information.py --cases 2", "machine": "2 cores", "section": "value-of-information",
         "figures": {"tol": 1e-3, "cases": {"2": _run(2, _ew(4.385, 4.7729, 4.9, 5.7124, 4.9775, route=4.6),
                                                      "2026-11-26T15:40:00+00:00")}}}


def _doc(cases: dict[int, dict[str, Any]], date: str = "2026-11-26T16:00:00+00:00") -> dict[str, Any]:
    return {"bench": "value_of_information", "date": date, "machine": "2 cores, test", "load_average_end": 1.0,
            "command": "python bench/value_of_information.py --cases 3 --merge --record", "tol": 1e-3,
            "wall_seconds": 12.0, "cases": {str(c): r for c, r in cases.items()}}


@pytest.fixture
def runs(tmp_path: Path) -> list[dict[str, Any]]:
    for rec in (OLD, NEWER):  # through the results file, as --merge reads it
        report.append_run("value_of_information", rec, tmp_path)
    got: list[dict[str, Any]] = report.read_runs("value_of_information", tmp_path)
    return got


def test_merge_takes_the_latest_run_of_each_other_case(runs: list[dict[str, Any]]) -> None:
    this = {3: _run(3, _ew(4.2577, 4.6925, 4.8109, 5.7124, 4.9775, route=4.4143), "2026-11-26T16:00:00+00:00"),
            1: _run(1, _ew(4.0, 4.0, 4.0, 4.0, 4.5), "2026-11-26T16:00:00+00:00")}
    got = voi.merge(this, runs)
    assert sorted(got) == [1, 2, 3]  # cases no record has are left out, not invented
    assert got[1]["ew"]["full"] == 4.0 and got[3]["ew"]["none"] == 4.8109  # this run's cases win
    assert got[2]["ew"]["none"] == 4.9 and got[2]["run"]["date"] == NEWER["date"]  # the later record
    only_old = voi.merge({}, runs[:1])
    assert only_old[2]["run"] == {"date": OLD["date"], "command": OLD["command"], "tol": 1e-3}
    r1 = only_old[1]  # derived from ew alone
    assert r1["best_baseline"] == "pi(1)" and r1["none_gain_over_best_baseline"] == 0.0
    assert r1["none_gain_over_pi_inf"] == pytest.approx((5.0 - 4.25) / 4.25)
    r2 = only_old[2]
    assert r2["best_baseline"] == "pi(inf)"
    assert r2["none_gain_over_best_baseline"] == pytest.approx((4.9775 - 4.9203) / 4.9203)
    assert "route_skipped" not in r2 and "none" not in r2  # no field is made up beyond the derived ones


def test_section_names_each_cases_run_and_checks_the_invariants(runs: list[dict[str, Any]]) -> None:
    doc = _doc({3: _run(3, _ew(4.2577, 4.6925, 4.8109, 5.7124, 4.9775), "2026-11-26T16:00:00+00:00",
                        route_skipped=True)})
    text = voi.section(voi.with_merged(doc, runs))
    lines = text.splitlines()
    assert lines[0].startswith("## value-of-information:")
    assert "on all 3 cases: yes" in text
    assert "case 3: `python bench/value_of_information.py --cases 3 --merge --record`, 2026-11-26 16:00 UTC" in text
    assert "case 1: the run of 2026-11-24 01:58 UTC" in text and "case 2: the run of 2026-11-26 15:40 UTC" in text
    assert "beats every baseline by more than the tolerance in cases 2–3" in text and "not run in case 3 " in text
    header = next(ln for ln in lines if ln.startswith("| E[W]"))
    assert header.split("|")[2:5] == [" 1 ", " 2 ", " 3 "]
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines if ln.startswith("| ")}
    assert rows["none"] == ["4.2500", "4.9000", "4.8109"]
    assert rows["route"] == ["–", "4.6000", "not run"]
    assert rows["none vs best baseline"][0] == "tie (π(1))"
    assert rows["none vs best baseline"][1] == f"**{100 * (4.9775 - 4.9) / 4.9:+.2f} %** vs π(∞)"
    # an invariant broken in a merged case shows as "no"
    bad = {**NEWER, "figures": {"cases": {"2": {"ew": _ew(4.9, 4.7, 4.95, 5.7, 4.9775)}}}}
    assert "on all 3 cases: **no**" in voi.section(voi.with_merged(doc, [*runs, bad]))


def test_twelve_cases_fit_the_line_budget() -> None:
    doc = _doc({c: _run(c, _ew(4.0, 4.1, 4.2, 4.3, 4.4), "2026-11-26T16:00:00+00:00") for c in range(1, 13)})
    text = voi.section(doc)
    assert len(text.splitlines()) <= 14  # the write-up stays short with all twelve
    assert "cases 1–12:" in text and "on all 12 cases: yes" in text
