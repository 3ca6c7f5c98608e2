"""bench/uplink_sweep.py: every ratio is a policy over FAIR of the *same* run, and the issue-6
targets at load 0.8 are counted per seed (synthetic runs with known answers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.bench import bench_module

uplink_sweep = bench_module("uplink_sweep")


def _m(mean: float, top: float, tput: float) -> dict[str, Any]:
    return {"mean_response_time": mean, "largest_1pct_mean_response_time": top,
            "throughput_bytes_per_s": tput, "mean_slowdown": 2.0, "mean_connections": 3.0,
            "errors": 0}  # fmt: skip


def _run(load: float, seed: int, fair: tuple[float, float, float],
         srpt: tuple[float, float, float]) -> dict[str, Any]:
    return {"testbed": {"load": load, "seed": seed, "offered_load_realised": load},
            "policies": {"fair": _m(*fair), "srpt": _m(*srpt)}}  # fmt: skip


def test_ratios_are_within_a_run_and_targets_count_seeds() -> None:
    runs = [
        _run(0.8, 1, (1.0, 2.0, 100.0), (0.25, 2.0, 100.0)),  # meets all three
        _run(0.8, 2, (2.0, 4.0, 100.0), (1.0, 5.0, 98.0)),  # mean 0.5, top 1.25, tput 0.98
        _run(0.5, 1, (0.1, 1.0, 50.0), (0.05, 1.0, 50.0)),
    ]
    rows = {(r["load"], r["policy"]): r for r in uplink_sweep.summarise(runs)}
    s = rows[(0.8, "srpt")]
    # the second seed's FAIR is twice as slow: a pooled ratio would say 1.25/3 = 0.42
    assert s["mean_ratio"] == pytest.approx([0.25, 0.5])
    assert s["top1_ratio"] == pytest.approx([1.0, 1.25])
    assert s["tput_ratio"] == pytest.approx([1.0, 0.98])
    assert rows[(0.8, "fair")]["mean_ratio"] == [1.0, 1.0]
    assert rows[(0.5, "srpt")]["seeds"] == [1]
    text = uplink_sweep.targets(list(rows.values()))
    # pooled: (2.0 + 5.0) / (2.0 + 4.0) = 1.17, not the mean of the seeds' ratios (1.125)
    assert uplink_sweep.pooled_top1(s) == pytest.approx(7.0 / 6.0)
    assert "srpt at load 0.8: mean RT <= 1/3 of FAIR's in 1/2 seeds, largest 1 % <= 1.1x in 1/2; " \
           "pooled over the seeds 1.17x, byte throughput within 1 % in 1/2" in text
    assert "0.5" not in text  # the targets are the load-0.8 ones
    # a seed run twice (saved runs pooled with --from) is counted as runs, not as seeds
    again = uplink_sweep.summarise([*runs, _run(0.8, 2, (2.0, 4.0, 100.0), (0.5, 4.0, 100.0))])
    s2 = next(r for r in again if r["load"] == 0.8 and r["policy"] == "srpt")
    assert "mean RT <= 1/3 of FAIR's in 2/3 runs (seeds 1,2,2), largest 1 % <= 1.1x in 2/3" in \
        uplink_sweep.targets([s2])
    table = uplink_sweep.table(list(rows.values()))
    assert "| 0.8 | srpt | 0.80 | 0.625 | 0.38 (0.25-0.50) |" in table


def test_span_of_one_seed_is_the_value() -> None:
    assert uplink_sweep.span([0.3]) == "0.30"
    assert uplink_sweep.span([0.3, 0.1, 0.2]) == "0.20 (0.10-0.30)"


def _saved(load: float, seed: int) -> dict[str, Any]:
    r = _run(load, seed, (1.0, 2.0, 100.0), (0.25, 2.0, 100.0))
    r["testbed"].update(duration_s=60.0, sizes="wc98", server="asyncio",
                      qdisc="htb on veth: 8 strict classes", loadavg_1min_at_start=0.3)
    return r


def test_from_reads_out_lines_and_json_lists(tmp_path: Path) -> None:
    lines, listed = tmp_path / "a.jsonl", tmp_path / "b.json"
    lines.write_text("\n".join(json.dumps(_saved(0.8, s)) for s in (1, 2)) + "\n")
    listed.write_text(json.dumps([_saved(0.5, 3)]))
    runs = uplink_sweep.load_runs([str(lines), str(listed)])
    assert [(r["testbed"]["load"], r["testbed"]["seed"]) for r in runs] == [(0.8, 1), (0.8, 2),
                                                                           (0.5, 3)]
    # the record of saved runs names the sweep that measures them again
    assert uplink_sweep.commands(runs) == [[
        "--loads", "0.5,0.8", "--seeds", "1,2,3", "--duration", "60", "--policies", "fair,srpt",
        "--sizes", "wc98", "--server", "asyncio"]]  # fmt: skip
    # runs with other policies were another sweep: one command each
    extra = _saved(0.8, 4)
    extra["policies"]["srrt"] = extra["policies"]["srpt"]
    cmds = uplink_sweep.commands([*runs, extra])
    assert [c[1] for c in cmds] == ["0.5,0.8", "0.8"]
    assert cmds[1][cmds[1].index("--policies") + 1] == "fair,srpt,srrt"


def test_from_names_the_file_and_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_saved(0.8, 1)) + "\nnot json\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl line 2: not JSON .*--out or --json"):
        uplink_sweep.load_runs([str(bad)])
    nofair = tmp_path / "nofair.jsonl"
    r = _saved(0.8, 1)
    del r["policies"]["fair"]
    nofair.write_text(json.dumps(r))
    with pytest.raises(SystemExit, match="run 0 has no fair policy"):
        uplink_sweep.load_runs([str(nofair)])
    with pytest.raises(SystemExit, match="cannot read"):
        uplink_sweep.load_runs([str(tmp_path / "missing")])


def test_from_records_into_the_named_section(tmp_path: Path, monkeypatch) -> None:
    saved = tmp_path / "runs.jsonl"
    saved.write_text(json.dumps(_saved(0.8, 1)) + "\n")
    got: dict[str, str] = {}
    monkeypatch.setattr(uplink_sweep, "write_section", lambda name, text: got.update({name: text}))
    assert uplink_sweep.main(["--from", str(saved), "--record", "--section", "uplink-sweep-60s"]) == 0
    text = got["uplink-sweep-60s"]
    assert text.startswith("## uplink-sweep-60s: FAIR vs SRPT over uplink load 0.8, 60 s")
    assert "--loads 0.8 --seeds 1 --duration 60 --policies fair,srpt --sizes wc98 --server asyncio`" in text
    assert f"recorded by `python bench/uplink_sweep.py --from {saved} --record" in text
    assert "srpt at load 0.8: mean RT <= 1/3 of FAIR's in 1/1 seeds" in text


def test_policy_modifiers_parse_and_name_their_fix() -> None:
    import uplink_srpt

    v = uplink_srpt.parse_variant("srpt/t0.001/w1/b3")
    assert (v.base, v.floor, v.top, v.writers, v.ordered) == ("srpt", 0.0, 0.001, 1, 3)
    assert uplink_srpt.parse_variant("srpt").ordered == 1 and uplink_srpt.parse_variant("fair").writers == 0
    with pytest.raises(ValueError, match=r"'srpt/b3': /b3 orders bands with /wK's writers; add /w1"):
        uplink_srpt.parse_variant("srpt/b3")
    with pytest.raises(ValueError, match=r"'b9': .*/bN a whole N in 1\.\.7"):
        uplink_srpt.parse_variant("srpt/w1/b9")
    rules = uplink_sweep.cutoff_rules(["fair", "srpt/w1", "srpt/w1/b3"])
    assert rules.endswith("; /b3 = each of the lowest 3 bands so") and "/w1 = at most 1 response" in rules


def test_each_fluid_twin_is_set_against_the_ps_twin_of_its_own_bytes() -> None:
    import uplink_srpt

    pol = {"mean_response_time": 1.0, "mean_slowdown": 1.0, "largest_1pct_mean_response_time": 2.0,
           "throughput_bytes_per_s": 1e6, "mean_connections": 1.0, "max_connections": 1, "errors": 0,
           "response_time_by_size_percentile": {"0-50": 0.1, "50-90": 0.2, "90-99": 0.3, "99-100": 2.0},
           "wire_bytes_per_request": 5900.0}  # fmt: skip
    ideal = {name + tail: {"mean_response_time": m * k, "largest_1pct_mean_response_time": 1.0}
             for tail, k in (("", 1.0), (" (wire)", 2.0), (" (FAIR's bytes)", 4.0))
             for name, m in (("ps", 0.5), ("srpt", 0.1))}  # fmt: skip
    out = {"testbed": {"wire_overhead_bytes_per_request": 540.4,
                       "fair_overhead_bytes_per_request": 460.0},
           "policies": {"fair": pol}, "ideal": ideal}  # fmt: skip
    rows = [r for r in uplink_srpt.render_table(out).splitlines() if r.startswith("| ideal")]
    # srpt / ps is 0.2 on every pair of bytes; a row set against another pair's PS would not be
    assert [r.split(" | ")[2] for r in rows] == ["1.00 (vs PS)", "0.20 (vs PS)"] * 3
    line = uplink_srpt.wire_line(out)[0]
    assert "540 bytes a request beyond size + 64" in line and "FAIR's run 460" in line
    assert line.endswith("fair 5900.")
