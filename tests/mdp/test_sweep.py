"""Sweeps (mdp.sweep): grid expansion, and a real Dask LocalCluster giving mdp.compare's numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("dask.distributed")

from overtake.mdp.comparison import compare
from overtake.mdp.errors import ModelError
from overtake.mdp.model import Stage
from overtake.mdp.scenario import parse_scenario
from overtake.mdp.sweep import parse_grid, run_sweep

BASE = {
    "tolerance": 0.01,
    "truncation": {"max_requests": 8, "max_threads": 3},
    "stages": [
        {"name": "stage1", "service": {"exponential": {"mean": 1.0}}},
        {"name": "stage2", "service": {"hyperexponential": {"probs": [0.91, 0.09], "means": [0.55, 5.45]}}},
    ],
}


def test_grid_expands_to_the_product_with_two_moment_stages():
    pts = parse_grid({"base": BASE, "grid": {"load": [0.3, 0.5, 0.7], "stage1.scv": [0.5, 4.0]},
                      "policies": ["pi(2)"]})
    assert len(pts) == 6
    assert [p.params for p in pts[:2]] == [{"load": 0.3, "stage1.scv": 0.5}, {"load": 0.3, "stage1.scv": 4.0}]
    for p in pts:
        m = parse_scenario(p.scenario).build_model()
        s1 = m.stages[0]
        # the base mean is kept, the scv is the axis value (Tijms' two-moment PH)
        assert s1.mean() == pytest.approx(1.0, rel=1e-12)
        assert s1.second_moment() / s1.mean() ** 2 - 1 == pytest.approx(p.params["stage1.scv"], rel=1e-9)
        assert m.arrival_rate * m.mean_service() == pytest.approx(p.params["load"], rel=1e-12)
        assert isinstance(m.stages[1], Stage) and p.policies == ("pi(2)",)


@pytest.mark.parametrize("doc,msg", [
    ({"base": BASE, "grid": {"stage3.mean": [1]}}, "grid.stage3.mean: unknown axis"),
    ({"base": BASE, "grid": {"load": "high"}}, "grid.load: give a non-empty list of numbers"),
    ({"base": BASE, "grid": {"load": [0.5, 1.2]}}, "grid point 1 \\(load=1.2\\): load must be < 1"),
    ({"base": BASE, "grid": {"stage2.scv": [0.01]}}, "grid.stage2.scv = 0.01 needs more than 10"),
    ({"base": BASE, "grid": {"load": [0.5]}, "policies": ["pi(x)"]}, "is not a baseline name"),
    ({"base": BASE, "grid": {"load": [0.5]}, "extra": 1}, "extra: unknown key"),
    ({"grid": {"load": [0.5]}}, "base: required"),
])
def test_bad_grid_names_the_field(doc, msg):
    with pytest.raises(ModelError, match=msg):
        parse_grid(doc)


def test_local_cluster_gives_the_same_numbers_as_compare():
    pts = parse_grid({"base": BASE, "grid": {"load": [0.3, 0.5]}})
    df = run_sweep(pts, workers=2)
    assert df["error"].isna().all()
    for p in pts:
        sc = parse_scenario(p.scenario)
        direct = compare(sc.build_model(), tol=sc.tolerance, truncation=sc.fixed_truncation())
        got = df[df["point"] == p.index].set_index("policy")
        assert sorted(got.index) == sorted(direct["policies"])
        for name, m in direct["policies"].items():
            assert got.loc[name, "mean_response_time"] == pytest.approx(m["mean_response_time"], rel=1e-12)
            assert got.loc[name, "mean_threads"] == pytest.approx(m["mean_threads"], rel=1e-12)
            assert got.loc[name, "gain"] == pytest.approx(direct["gains"].get(name, 0.0), rel=1e-10, abs=1e-14)


def test_cli_sweep_writes_parquet_and_plot(tmp_path, capsys):
    import pandas as pd
    import yaml

    from overtake.api.cli import main

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"base": BASE, "grid": {"load": [0.3, 0.4]}}))
    out, png = tmp_path / "r.parquet", tmp_path / "g.png"
    assert main(["sweep", str(grid), "--out", str(out), "--plot", str(png), "--workers", "1", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["points"] == 2 and doc["failed_points"] == 0
    df = pd.read_parquet(out)
    assert len(df) == 2 * 5 and set(df["policy"]) == {"pi*", "pi(1)", "pi(4)", "pi(inf)", "pi(1,1)"}
    star = df[df["policy"] == "pi*"]
    assert np.all(star["gain"] == 0.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["sweep", str(grid), "--out", str(tmp_path / "r.xlsx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"overtake sweep: error: --out {tmp_path / 'r.xlsx'}: use a .csv or .parquet file name"]
