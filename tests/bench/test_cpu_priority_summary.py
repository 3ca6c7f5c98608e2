"""bench/cpu_priority.py's ratio summaries: known answers (its doctest), and the property an
arithmetic mean of ratios lacks: exchanging the two sides of every pair inverts the figure."""

from __future__ import annotations

import doctest
import math
import random

import pytest
from support.bench import bench_module

cpu_priority = bench_module("cpu_priority")


def test_doctest() -> None:
    res = doctest.testmod(cpu_priority)
    assert res.attempted >= 1 and res.failed == 0


def _runs(rng: random.Random, spread: float, swap: bool = False) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {}
    for i in range(6):
        for kind in ("on", "ctl"):
            rs = [math.exp(rng.gauss(0.05 if kind == "on" else 0.0, spread)) for _ in range(8)]
            runs[f"{kind}{i}/off{i}"] = [{"p99_ratio": 1 / r if swap else r} for r in rs]
    return runs


def test_exchanging_the_sides_inverts_the_geometric_summary_and_not_the_arithmetic_mean() -> None:
    a = cpu_priority.ratio_summaries(_runs(random.Random(7), 0.4), ["p99_ratio"])
    b = cpu_priority.ratio_summaries(_runs(random.Random(7), 0.4, swap=True), ["p99_ratio"])
    assert a["p99_ratio"] * b["p99_ratio"] == pytest.approx(1.0, rel=1e-12)
    assert a["control_p99_ratio"] * b["control_p99_ratio"] == pytest.approx(1.0, rel=1e-12)
    lo, hi = a["p99_ratio_ci95"]
    assert lo < a["p99_ratio"] < hi and b["p99_ratio_ci95"][0] == pytest.approx(1 / hi)

    def arith(runs: dict[str, list[dict[str, float]]]) -> float:
        return sum(w["p99_ratio"] for k, rs in runs.items() if k.startswith("on") for w in rs) / 48

    # the arithmetic mean reads both directions above 1 (E[e^X] > 1 for a centred X)
    assert arith(_runs(random.Random(7), 0.4)) > 1.05 and arith(_runs(random.Random(7), 0.4, swap=True)) > 1.0
