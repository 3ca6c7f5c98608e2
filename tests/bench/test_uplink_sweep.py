"""bench/uplink_sweep.py: every ratio is a policy over FAIR of the *same* run, and the issue-6
targets at load 0.8 are counted per seed (synthetic runs with known answers)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import uplink_sweep  # noqa: E402


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
    assert "srpt at load 0.8: mean RT <= 1/3 of FAIR's in 1/2 seeds, largest 1 % <= 1.1x in 1/2, " \
           "byte throughput within 1 % in 1/2" in text
    assert "0.5" not in text  # the targets are the load-0.8 ones
    table = uplink_sweep.table(list(rows.values()))
    assert "| 0.8 | srpt | 0.80 | 0.625 | 0.38 (0.25-0.50) |" in table


def test_span_of_one_seed_is_the_value() -> None:
    assert uplink_sweep._span([0.3]) == "0.30"
    assert uplink_sweep._span([0.3, 0.1, 0.2]) == "0.20 (0.10-0.30)"
