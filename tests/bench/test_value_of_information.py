"""bench/value_of_information.py: its invariants on Table 1, not its timing.

Known answers: more information never hurts (E W(full) <= E W(start) <= E W(none)), the best
count-only policy is never worse than a baseline it contains (mdp/observed.py), the reported gain
is the formula it names, and every route split mixes back to the stage's phase distribution α."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.bench import bench_module

from overtake.api.scenario import load_scenario

_voi = bench_module("value_of_information")
route_split, run_case = _voi.route_split, _voi.run_case

ROOT = Path(__file__).resolve().parents[2]


def test_case1_information_order_and_gain() -> None:
    r = run_case(1, 1e-3)
    ew, rel = r["ew"], 2e-3  # each E[W] is exact to relative tol 1e-3 on its truncation
    assert ew["full"] <= ew["start"] * (1 + rel) and ew["start"] <= ew["none"] * (1 + rel)
    base = {k: v for k, v in ew.items() if k.startswith("pi(")}
    assert {"pi(1)", "pi(2)", "pi(inf)"} <= base.keys()
    assert ew["none"] <= min(base.values()) * (1 + rel)
    assert ew["full"] <= ew["heuristic"] * (1 + rel)
    best = r["best_baseline"]
    assert base[best] == min(base.values())
    assert r["none_gain_over_pi_inf"] == pytest.approx((base["pi(inf)"] - ew["none"]) / ew["none"])
    assert "route" not in ew  # case 1 has exponential stages only: no route to see


@pytest.mark.parametrize("case", range(1, 13))
def test_route_split_mixes_to_alpha(case: int) -> None:
    _, model = load_scenario(ROOT / "examples" / "table1" / f"case{case:02d}.yaml")
    split = route_split(model)
    if all(st.phases == 1 for st in model.stages):
        assert split is None
        return
    assert split is not None
    for st, routes in zip(model.stages, split.to_dict(), strict=True):
        w = np.array([r["weight"] for r in routes])
        a = np.array([r["alpha"] for r in routes])
        assert np.all(w > 0) and w.sum() == pytest.approx(1.0)
        assert w @ a == pytest.approx(np.asarray(st.alpha, dtype=float))
