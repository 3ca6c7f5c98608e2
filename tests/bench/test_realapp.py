"""bench/realapp.py, the real-application bench: its page recipe, trace, statistics and output
document, checked without MediaWiki; and one end-to-end run on a tiny trace where MediaWiki is
installed (the packages are the bench's own set-up, never installed by a test)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps
from support.bench import bench_module

from overtake.controller.harness.scratch import scratch_dir
from overtake.controller.sidecar.stages import load_stages

realapp = bench_module("realapp")
pages, product, server, split, stats, wiki, workload = (
    bench_module(f"mediawiki.{m}") for m in ("pages", "product", "server", "split", "stats", "wiki", "workload"))

# --------------------------------------------------------------------------- the page recipe


def test_recipe_is_deterministic_for_a_seed() -> None:
    r = pages.Recipe(articles=40, seed=11)
    a, b = pages.wiki_pages(r), pages.wiki_pages(pages.Recipe(articles=40, seed=11))
    assert a == b
    other = pages.wiki_pages(pages.Recipe(articles=40, seed=12))
    assert sum(a[t] != other[t] for t in a) >= 35  # another seed, other articles
    assert pages.fingerprint(r) == pages.fingerprint(pages.Recipe(articles=40, seed=11))
    assert pages.fingerprint(r) != pages.fingerprint(pages.Recipe(articles=40, seed=12))
    # the first articles' section counts do not depend on how many articles there are
    assert np.array_equal(pages.draw_units(pages.Recipe(articles=10, seed=11))[1], pages.draw_units(r)[1][:10])


def test_an_article_has_as_many_template_sections_as_its_units() -> None:
    r = pages.Recipe(articles=30, seed=3)
    _, units = pages.draw_units(r)
    for i, (title, text) in enumerate(pages.wiki_pages(r).items()):
        assert title == pages.article_title(i)
        assert text.count("{{" + pages.TABLE_TEMPLATE + "|") == units[i]
        assert text.count("\n== Section ") == units[i]
    table = pages.templates()[pages.TABLE_TEMPLATE]
    assert table.count("{{" + pages.ROW_TEMPLATE + "|") == pages.ROWS


def test_section_counts_are_lognormal_and_heavy_tailed() -> None:
    # uncapped, the draws are lognormal(mu, sigma): their logarithms pass a normality test
    r = pages.Recipe(articles=4000, seed=7, mu=0.5, sigma=2.0, cap=10**9)
    x, units = pages.draw_units(r)
    assert sps.kstest(np.log(x), "norm", args=(0.5, 2.0)).pvalue > 0.01
    assert np.array_equal(units, np.clip(np.rint(x), 1, r.cap))
    # the known tail share: the largest tenth of a lognormal(., 2) holds 1 - Phi(z_0.9 - 2) = 76 %
    top = np.sort(x)[-len(x) // 10:].sum() / x.sum()
    assert abs(top - (1 - sps.norm.cdf(sps.norm.ppf(0.9) - 2.0))) < 0.06
    # the default recipe (capped at 300): median 2, most of the work in a few articles
    _, u = pages.draw_units(pages.Recipe())
    assert np.median(u) == 2 and u.max() <= 300
    assert np.sort(u)[-30:].sum() / u.sum() > 0.6
    assert u.var() / u.mean() ** 2 > 2  # far more variable than exponential


def test_recipe_refuses_bad_fields() -> None:
    for kw, field in (({"articles": 0}, "recipe.articles"), ({"sigma": 0.0}, "recipe.sigma"), ({"cap": 0}, "recipe.cap")):
        with pytest.raises(ValueError, match=field):
            pages.Recipe(**kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the trace


def test_trace_arrival_rate_and_load_match_the_target() -> None:
    rng = np.random.default_rng(5)
    preview = rng.lognormal(np.log(0.05), 1.0, size=300)
    view = preview * 1.2 + 0.03
    rate = workload.arrival_rate(0.6, preview, view)
    assert rate == pytest.approx(0.6 / np.mean(preview + view))
    n = 20000
    tr = workload.make_trace(n, rate, 300, seed=9)
    assert np.all(np.diff(tr["arrival"]) > 0) and tr["article"].min() >= 0 and tr["article"].max() < 300
    # Poisson: n / T estimates the rate with relative standard error 1 / sqrt(n)
    assert abs(n / tr["arrival"][-1] / rate - 1) < 4 / np.sqrt(n)
    # the offered load: rate x mean cost of the drawn articles, within its sampling error
    cost = (preview + view)[tr["article"]]
    assert abs(rate * cost.mean() - 0.6) < 4 * rate * cost.std() / np.sqrt(n)
    # the same seed gives the same trace, another seed another one
    again = workload.make_trace(n, rate, 300, seed=9)
    assert np.array_equal(again["arrival"], tr["arrival"]) and np.array_equal(again["article"], tr["article"])
    assert not np.array_equal(workload.make_trace(n, rate, 300, seed=10)["article"], tr["article"])


def test_arrival_rate_refuses_a_load_outside_0_1() -> None:
    with pytest.raises(ValueError, match="load"):
        workload.arrival_rate(1.0, np.ones(3), np.ones(3))


# --------------------------------------------------------------------------- statistics


def _independent_gain(arm: np.ndarray, default: np.ndarray) -> tuple[float, float]:
    """The paired gain written out again: pairs both completed, 5 % warm-up, 20 batches."""
    pairs = [(a, d) for a, d in zip(arm, default) if not (np.isnan(a) or np.isnan(d))]
    pairs = pairs[int(0.05 * len(pairs)):]
    a = np.array([p[0] for p in pairs])
    d = np.array([p[1] for p in pairs])
    n, b = len(pairs), 20
    sizes = [n // b + (1 if k < n % b else 0) for k in range(b)]
    edges = np.concatenate([[0], np.cumsum(sizes)])
    means = np.array([np.mean(d[edges[k]:edges[k + 1]] - a[edges[k]:edges[k + 1]]) for k in range(b)])
    half = sps.t.ppf(0.975, b - 1) * means.std(ddof=1) / np.sqrt(b)
    return (d.mean() - a.mean()) / a.mean(), half / a.mean()


def test_paired_gain_matches_an_independent_computation() -> None:
    rng = np.random.default_rng(3)
    default = rng.lognormal(-2, 1, size=997)
    arm = default * rng.uniform(0.6, 1.1, size=997)
    default[rng.choice(997, 40, replace=False)] = np.nan  # failures on either side
    arm[rng.choice(997, 25, replace=False)] = np.nan
    g, ci = stats.paired_gain(arm, default)
    g2, ci2 = _independent_gain(arm, default)
    assert g == pytest.approx(g2, rel=1e-12)
    assert ci == pytest.approx(ci2, rel=2e-3)  # the helper's t quantile is 2.093 to 4 digits
    assert g > 0 and 0 < ci < g


def test_paired_gain_known_answer_for_a_constant_saving() -> None:
    default = np.random.default_rng(1).uniform(0.1, 0.5, size=400)
    arm = default - 0.05  # every transaction 50 ms faster: the differences have no spread
    g, ci = stats.paired_gain(arm, default)
    steady = arm[int(0.05 * 400):]
    assert g == pytest.approx(0.05 / steady.mean())
    assert ci == pytest.approx(0.0, abs=1e-12)
    assert np.isnan(stats.paired_gain(arm[:30], default[:30])[0])  # too few pairs for 20 batches


# --------------------------------------------------------------------------- blocks (A B, B A, ...)


def test_blocks_cover_the_trace_in_near_equal_consecutive_pieces() -> None:
    assert stats.blocks(400, 60) == [(0, 67), (67, 133), (133, 200), (200, 267), (267, 333), (333, 400)]
    assert stats.blocks(50, 60) == [(0, 50)]  # fewer than one block's worth: one block
    b = stats.blocks(997, 60)
    assert b[0][0] == 0 and b[-1][1] == 997 and all(x[1] == y[0] for x, y in zip(b, b[1:]))
    assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1
    with pytest.raises(ValueError, match="size"):
        stats.blocks(100, 0)


def test_block_order_alternates_and_every_arm_sits_in_the_middle_on_average() -> None:
    arms = ["default", "overtake", "age"]
    assert [stats.block_order(arms[:2], 0, j) for j in range(4)] == [
        ["default", "overtake"], ["overtake", "default"], ["default", "overtake"], ["overtake", "default"]]
    assert stats.block_order(arms[:2], 1, 0) == ["overtake", "default"]  # the run rotates the start
    for run in range(3):
        pos = {a: [stats.block_order(arms, run, j).index(a) for j in range(2)] for a in arms}
        assert all(np.mean(p) == 1.0 for p in pos.values()), pos


def _drifting_replay(order: list[list[str]], base: np.ndarray, bounds: list[tuple[int, int]],
                     drift: float) -> dict[str, np.ndarray]:
    """Both arms equally fast, the machine slowing linearly: the replay slot s (blocks and arms in
    the given order) runs at 1 + drift * s."""
    out = {a: np.full(base.size, np.nan) for a in order[0]}
    slot = 0
    for (lo, hi), arms in zip(bounds, order, strict=True):
        for a in arms:
            out[a][lo:hi] = base[lo:hi] * (1 + drift * slot)
            slot += 1
    return out


def test_alternating_blocks_cancel_a_linear_drift_that_runs_one_after_the_other_do_not() -> None:
    bounds = stats.blocks(480, 60)
    base = np.tile(np.random.default_rng(5).lognormal(-1, 1, size=60), 8)  # blocks alike
    arms = ["default", "overtake"]
    abba = _drifting_replay([stats.block_order(arms, 0, j) for j in range(8)], base, bounds, 0.02)
    g = stats.block_gain(abba["overtake"], abba["default"], bounds)
    assert g["gain"] == pytest.approx(0.0, abs=1e-12)
    # the same drift with the arms one after the other (the whole trace under default first)
    seq = {"default": base * (1 + 0.02 * np.repeat(np.arange(8), 60)),
           "overtake": base * (1 + 0.02 * np.repeat(np.arange(8, 16), 60))}
    assert stats.block_gain(seq["overtake"], seq["default"], bounds)["gain"] < -0.1


def test_block_gain_known_answers() -> None:
    rng = np.random.default_rng(1)
    default = rng.uniform(0.1, 0.5, size=300)
    bounds = stats.blocks(300, 60)
    g = stats.block_gain(default / 1.25, default, bounds)  # every transaction 1.25 times faster
    assert g["gain"] == pytest.approx(0.25) and g["ci95"] == pytest.approx(0.0, abs=1e-12)
    assert g["per_block"] == pytest.approx([0.25] * 5) and g["blocks"] == 5
    arm = default.copy()
    arm[:60] = np.nan  # a block lost under the arm: its pairs are left out, on both sides
    arm[60:] /= 1.25
    assert stats.block_gain(arm, default, bounds)["gain"] == pytest.approx(0.25)
    one = stats.block_gain(default / 2, default, [(0, 300)])
    assert one["gain"] == pytest.approx(1.0) and np.isnan(one["ci95"])  # no spread from one block
    assert np.isnan(stats.block_gain(default[:30], default[:30], [(0, 15), (15, 30)])["gain"])


def test_block_gain_ci_covers_the_true_gain_about_95_percent_of_the_time() -> None:
    """Each block's speed drawn at random (drift that does not cancel), per-transaction noise: the
    half-width covers the true gain in 90-99 % of 400 seeds (t with blocks - 1 degrees of freedom)."""
    bounds = stats.blocks(480, 60)
    hits = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        base = rng.lognormal(-1, 1, size=480)
        speed = {a: np.repeat(rng.lognormal(0, 0.1, size=8), 60) for a in ("default", "arm")}
        default = base * speed["default"] * rng.lognormal(0, 0.2, size=480)
        arm = base / 1.2 * speed["arm"] * rng.lognormal(0, 0.2, size=480)
        g = stats.block_gain(arm, default, bounds)
        true = 1.2 * np.exp(0.0) - 1  # the noise is symmetric in log: same mean factor on both sides
        hits += abs(g["gain"] - true) <= g["ci95"]
    assert 0.90 * 400 <= hits <= 0.99 * 400, hits


def test_arm_summary_counts_failures_and_leaves_them_out_of_the_times() -> None:
    rt = np.array([np.nan] + [0.1] * 98 + [1.0])
    outcomes = ["reset"] + ["ok"] * 99
    s = stats.arm_summary(rt, outcomes)
    assert s["failures"] == 1 and s["failure_kinds"] == {"reset": 1} and s["transactions"] == 100
    steady = rt[1:][int(0.05 * 99):]
    assert s["mean"] == pytest.approx(steady.mean()) and s["p99"] == pytest.approx(np.percentile(steady, 99))


def test_slowdowns_split_previews_by_overlap() -> None:
    # previews 0 and 1 overlap; preview 2 starts after both ended and preview 3 exactly when 2
    # ends (touching is no overlap); the view overlaps them but is no preview
    begin = np.array([0.0, 0.5, 3.0, 0.2, 4.0])
    dur = np.array([1.0, 1.0, 1.0, 2.0, 0.5])
    idle = np.array([0.5, 0.5, 1.0, 1.0, 0.25])
    s = stats.slowdowns(begin, dur, idle, np.array([True, True, True, False, True]))
    assert s["preview"] == pytest.approx((2 + 2 + 1 + 2) / 4) and s["view"] == pytest.approx(2.0)
    assert s["preview_overlapped"] == pytest.approx(2.0) and s["preview_alone"] == pytest.approx(1.5)
    assert (s["previews_overlapped"], s["previews"]) == (2, 4)


def test_calibration_pass_spread() -> None:
    # two articles, three passes; the second article's view disturbed once (10 s instead of 1 s)
    x = np.array([[[1.0, 2.0], [1.0, 1.0]], [[1.1, 2.0], [1.0, 10.0]], [[0.9, 2.0], [1.0, 1.0]]])
    assert np.median(x, axis=0)[1, 1] == 1.0  # the median of the passes ignores the disturbance
    s = realapp.pass_spread(x)
    assert s is not None
    assert s["preview"] == pytest.approx(np.median([0.2 / 1.0, 0.0]))
    assert s["view"] == pytest.approx(np.median([0.0, 9.0 / 1.0]))
    assert realapp.pass_spread(x[:1]) is None


# --------------------------------------------------------------------------- the document


def _fake_rts(n: int = 200) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    rng = np.random.default_rng(2)
    base = rng.lognormal(-2, 1, size=n)
    rts = {"default": base, "overtake": base * 0.9, "modqos": np.where(rng.random(n) < 0.1, np.nan, base * 0.8)}
    outs = {k: ["ok" if np.isfinite(x) else "preview_http_500" for x in v] for k, v in rts.items()}
    return rts, {k: stats.arm_summary(v, outs[k]) for k, v in rts.items()}


def test_run_document_has_the_contract_shape(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    rts, arms = _fake_rts()
    bounds = stats.blocks(200, 50)
    run = realapp.summarise_run(rts, arms, ["default", "overtake", "modqos"], bounds)
    assert run["gain"] == pytest.approx(1 / 0.9 - 1) and run["gain_ci95"] == pytest.approx(0.0, abs=1e-12)
    assert run["gains"]["overtake"]["ci95_transactions"] == pytest.approx(
        stats.paired_gain(rts["overtake"], rts["default"])[1])
    assert set(run["gains"]) == {"overtake", "modqos"} and run["arms"]["modqos"]["failures"] > 0
    doc = {"runs": [run | {"seed": 1, "order": ["default"], "offered_load": 0.6}], "nan": float("nan")}
    monkeypatch.setattr(realapp, "run", lambda args: doc)
    monkeypatch.setattr(realapp.signal, "signal", lambda *a: None)  # leave pytest's SIGTERM alone
    assert realapp.main(["--php", "prefork", "--runs", "1", "--json", "--no-write"]) == 0
    out = json.loads(capsys.readouterr().out)  # stdout is the JSON document alone
    assert out["nan"] is None  # JSON has no NaN
    (r,) = out["runs"]
    for name in ("default", "overtake"):
        assert {"mean", "p99", "failures"} <= set(r["arms"][name])
        assert isinstance(r["arms"][name]["mean"], float) and isinstance(r["arms"][name]["failures"], int)
    assert isinstance(r["gain"], float) and isinstance(r["gain_ci95"], float)
    assert r["gains"]["modqos"]["ci95"] > 0


def test_p99_ratio_known_answers() -> None:
    rts, _ = _fake_rts()
    bounds = stats.blocks(200, 20)
    # an arm that is the default scaled: every resample has the same ratio, so the interval is a point
    for scale in (1.0, 0.9, 1.25):
        r = stats.p99_ratio(rts["default"] * scale, rts["default"], bounds)
        assert r["ratio"] == pytest.approx(scale) and r["ci95"] == pytest.approx([scale, scale])
    # the point estimate is the ratio of the arms' own p99s (both after the same warm-up)
    noisy = rts["default"] * np.random.default_rng(5).lognormal(0, 0.3, 200)
    r = stats.p99_ratio(noisy, rts["default"], bounds)
    both = ["ok"] * 200
    assert r["ratio"] == pytest.approx(stats.arm_summary(noisy, both)["p99"] / stats.arm_summary(rts["default"], both)["p99"])
    assert r["ci95"][0] < r["ratio"] < r["ci95"][1]
    assert stats.p99_ratio(noisy, rts["default"], [(0, 200)])["ratio"] is None  # one block: no interval


def test_run_document_carries_the_p99_ratio() -> None:
    rts, arms = _fake_rts()
    run = realapp.summarise_run(rts, arms, ["default", "overtake", "modqos"], stats.blocks(200, 50))
    assert run["gains"]["overtake"]["p99_ratio"] == pytest.approx(0.9)
    assert run["gains"]["overtake"]["p99_ratio_ci95"] == pytest.approx([0.9, 0.9])


def test_trace_model_demand_is_over_the_traces_own_articles() -> None:
    """An arm whose CPU per transaction equals its trace's idle time has demand 1, whatever the
    trace's mix: a trace heavier than the wiki's average must not count its big articles twice."""
    rng = np.random.default_rng(3)
    ip = 0.016 + rng.lognormal(-4, 1.2, 40)
    iv = ip + 0.01
    cal = {"preview_s": ip.tolist(), "view_s": iv.tolist(), "preview": {"intercept_s": 0.015},
           "view": {"intercept_s": 0.025}}
    n, rate = 60, 3.0
    for seed in (1, 2, 3):
        trace = workload.make_trace(n, rate, len(ip), seed)
        cpu = float(np.sum((ip + iv)[trace["article"]]))
        run = {"seed": seed, "blocks": [[0, 30], [30, 60]],
               "arms": {"default": {"cpu_s": {"apache": cpu}, "transactions": n, "mean": 0.1},
                        "overtake": {"cpu_s": {"apache": cpu}, "transactions": n, "mean": 0.1}}}
        out = realapp.trace_prediction(run, cal, rate=rate, transactions=n, php="prefork", preview_lock=1,
                                       class_quantile=None)
        assert out["default"]["demand"] == pytest.approx(1.0)
        assert "predicted_at_default_demand" not in out["default"]
        # the same CPU as the default's: the prediction at the default's demand is the arm's own
        assert out["overtake"]["predicted_at_default_demand"] == out["overtake"]["predicted"]
        assert out["default"]["predicted"] > 0.9 * float(np.mean((ip + iv)[trace["article"]]))


def test_reanalyse_names_the_recorded_dates_when_the_prefix_matches_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(realapp, "read_runs", lambda bench: [{"date": "2026-01-01T00:00:00Z", "figures": {}}])
    with pytest.raises(SystemExit, match="2026-01-01T00:00:00Z"):
        realapp.reanalyse("1999")


def test_without_overtake_the_gain_is_null() -> None:
    rts, arms = _fake_rts()
    run = realapp.summarise_run({"default": rts["default"]}, {"default": arms["default"]}, ["default"],
                                stats.blocks(200, 50))
    assert run["gain"] is None and run["gain_ci95"] is None and run["gains"] == {}


def test_bad_arguments_are_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in ((["--arms", "default,nope"], "--arms"), (["--load", "1.2"], "--load"),
                       (["--runs", "0"], "--runs"), (["--transactions", "10"], "--transactions"),
                       (["--block", "10"], "--block"), (["--transactions", "100", "--block", "60"], "--transactions"),
                       (["--class-quantile", "1"], "--class-quantile"), (["--minutes", "0"], "--minutes")):
        with pytest.raises(SystemExit):
            realapp.parse_args(argv)
        assert flag in capsys.readouterr().err


def test_stages_file_is_valid_for_the_sidecar(tmp_path: Path) -> None:
    f = tmp_path / "stages.yaml"
    f.write_text(product.stages_yaml(120, 2 << 20))
    table = load_stages(f)
    assert table.names == ("preview", "view") and table.next_stage == (1, None)
    assert table.config.classifier.mode == "auto" and table.config.limits.max_body_bytes == 2 << 20
    # a preview is a POST to the API's parse action, a view a short URL; anything else passes through
    assert table.route("POST", "/api.php", "action=parse&format=json")[0] == 0  # type: ignore[index]
    assert table.route("POST", "/api.php", "action=edit") is None
    assert table.lock(0) == 1 and table.cpu_exempt(0, "POST") and table.keyed(0)
    assert table.route("GET", "/wiki/Bench_article_0001")[0] == 1  # type: ignore[index]
    assert table.route("GET", "/api.php") is None and table.route("GET", "/load.php") is None


def test_stages_file_with_a_view_cap_keys_views_on_the_transaction_link(tmp_path: Path) -> None:
    f = tmp_path / "stages.yaml"
    f.write_text(product.stages_yaml(120, 2 << 20, view_lock=2))
    table = load_stages(f)
    assert table.lock(0) == 1 and table.lock(1) == 2 and table.linked[1] and table.keyed(1)
    route = table.route("GET", "/wiki/Bench_article_0001")
    assert route is not None and route[0] == 1
    # the view's key is its preview's: views of previews alike are predicted alike
    assert table.learned_key(route[1], "GET", "/wiki/Bench_article_0001", "", None, "POST preview 23") == \
        "<POST preview 23"
    f.write_text(product.stages_yaml(120, 2 << 20))  # without the cap: views unkeyed and unlocked
    plain = load_stages(f)
    assert plain.lock(1) is None and not plain.linked[1]


def test_stages_file_for_the_size_class_keys_views_on_the_link_without_a_cap(tmp_path: Path) -> None:
    f = tmp_path / "stages.yaml"
    f.write_text(product.stages_yaml(120, 2 << 20, size_class=True))
    table = load_stages(f)
    assert table.linked[1] and table.keyed(1) and table.lock(1) is None and table.lock(0) == 1


def test_stages_file_carries_the_size_class_quantile_the_model_chose(tmp_path: Path) -> None:
    f = tmp_path / "stages.yaml"
    f.write_text(product.stages_yaml(120, 2 << 20, size_class=True, class_quantile=0.97))
    table = load_stages(f)
    assert table.class_threshold(1) == (None, 0.97)
    f.write_text(product.stages_yaml(120, 2 << 20, size_class=True))  # the sidecar's default
    assert load_stages(f).class_threshold(1) == (None, 0.9)


def test_size_class_choice_sets_the_arm_quantile_from_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    units = np.clip(np.rint(rng.lognormal(0.5, 2.0, size=60)), 1, 300)
    b = realapp.Bench(realapp.parse_args(["--arms", "default,sizeclass"]), Path("/nonexistent"), [], units,
                      idle_preview=0.02 + 0.004 * units, idle_view=0.03 + 0.005 * units)
    calls = []

    replays = []

    def choose(p: np.ndarray, v: np.ndarray, rate: float, *, quantiles: tuple[float, ...], **kw: object) -> dict:
        (replays if kw.get("block") else calls).append((quantiles, kw))
        arms = {f"{q:g}": {"mean": 1 + abs(q - 0.8) + (0.5 if kw.get("block") else 0.0), "gain": 0.0}
                for q in quantiles}
        return {"default": 2.0, "arms": arms, "chosen": 0.8}

    monkeypatch.setattr(realapp.class_model, "choose", choose)
    out = realapp.size_class_choice(b, 1.0)
    assert b.class_quantile == 0.8 and out["quantile"] == 0.8 and out["source"] == "model"
    assert calls[-1][0] == realapp.class_model.QUANTILES
    # the replay as the bench measures: its blocks from idle, the rollback journal's readers
    assert replays[-1][1]["block"] == b.args.block and replays[-1][1]["readers"] is (b.args.journal != "wal")
    b.args.class_quantile = 0.75  # fixed by the flag: evaluated too, and used
    out = realapp.size_class_choice(b, 1.0)
    assert b.class_quantile == 0.75 and out["source"] == "--class-quantile" and 0.75 in calls[-1][0]
    got = realapp.predicted_vs_measured(None, {"sizeclass": {"mean": 1.0}}, out)
    assert got["sizeclass"]["predicted"] == pytest.approx(1.55)
    assert got["sizeclass"]["model"] == "size class 0.75 replayed"
    got = realapp.predicted_vs_measured({"lock": {"default": 1.0}}, {"default": {"mean": 1.6}}, out)
    assert got["default"]["predicted"] == 1.0 and got["default"]["predicted_replayed"] == 2.0
    assert got["default"]["error_replayed"] == pytest.approx(0.25)


def test_trace_length_fills_the_minutes_in_whole_blocks() -> None:
    # 2 transactions/s for 20 minutes over 3 arms: 800 per arm, 27 blocks of 30 (810)
    assert realapp.trace_length(2.0, 20, 3, 30) == 810
    assert realapp.trace_length(2.0, 20, 6, 30) == 390  # six arms: half as many
    assert realapp.trace_length(0.01, 1, 3, 30) == 60  # never fewer than two blocks
    assert realapp.trace_length(0.01, 1, 3, 20) == 60  # nor fewer than 50 transactions
    args = realapp.parse_args([])
    assert args.transactions is None and args.block == 30 and args.minutes == 20
    assert realapp.parse_args(["--transactions", "120", "--block", "40"]).transactions == 120


def test_a_calibration_of_other_settings_is_not_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = realapp.parse_args(["--data-dir", str(tmp_path), "--reuse-calibration"])
    b = realapp.Bench(args, tmp_path, [], np.ones(3))
    measured = []
    monkeypatch.setattr(realapp, "calibrate", lambda bench: measured.append(1) or {"preview_s": [1.0]})
    (tmp_path / "calibration-prefork.json").write_text(json.dumps({"fingerprint": "f", "settings": "old", "date": "d"}))
    cal = realapp.calibration(b, {"fingerprint": "f", "settings": "new"})
    assert measured == [1] and cal["settings"] == "new"
    cal = realapp.calibration(b, {"fingerprint": "f", "settings": "new"})  # the one just saved
    assert measured == [1] and cal["reused"]


def test_the_size_class_arm_runs_under_both_stacks(tmp_path: Path) -> None:
    assert "sizeclass" in realapp.parse_args(["--php", "prefork"]).arms
    assert realapp.parse_args(["--php", "fpm", "--arms", "default,sizeclass"]).arms == ["default", "sizeclass"]
    # the sidecar sends the class header under php-fpm too, where no Apache module priority is set
    spec = realapp.ARM_SPECS
    assert realapp.sidecar_priority(spec["sizeclass"], None) == "class"
    # the guide's deployment lets the sidecar choose, under both stacks
    assert realapp.sidecar_priority(spec["overtake"], None) == "auto"
    assert realapp.sidecar_priority(spec["overtake"], realapp.CpuPriority(levels=(0.05,), nice=(19,))) == "auto"
    assert realapp.sidecar_priority(spec["overtake_age"], None) is None  # fpm: the extension's own age timer
    cp = realapp.CpuPriority(levels=(0.05,), nice=("idle",))
    assert realapp.sidecar_priority(spec["overtake_age"], cp) == "age"
    # php-fpm's workers start the class at nice 19, with no age threshold
    ini = server.php_class_settings(tmp_path / "overtake_prio.so", tmp_path / "stats")
    assert ini["overtake_prio.class_header"] == "1" and ini["overtake_prio.threshold_ms"] == "0"
    assert ini["overtake_prio.nice"] == "19" and ini["overtake_prio.idle"] == "0"
    with pytest.raises(ValueError, match="nice"):
        server.php_class_settings(tmp_path / "x.so", tmp_path / "stats", nice=0)


def test_access_log_lines_parse(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "access.log").write_text(
        '127.0.0.1 1764230000123456 "POST /api.php?action=parse&format=json HTTP/1.1" 200 5120 D=41234 pid=77 rid=r0-3-p\n'
        '127.0.0.1 1764230000200000 "GET /wiki/Bench_article_0001 HTTP/1.1" 500 - D=99 pid=78 rid=-\n'
        '127.0.0.1 17642300003')  # being written: left out
    a, b = server.read_access(tmp_path)
    assert (a.method, a.path, a.status, a.duration_us, a.pid, a.rid) == ("POST", "/api.php", 200, 41234, 77, "r0-3-p")
    assert (b.path, b.status, b.rid) == ("/wiki/Bench_article_0001", 500, None)


def test_access_log_lines_with_the_request_time_split(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "access.log").write_text(
        '127.0.0.1 1764230000123456 "POST /api.php?action=parse HTTP/1.1" 200 5120 D=41234 pid=77 rid=r0-3-p'
        ' owall=40000 ocpu=12000 owait=3000 oblocked=25000\n'
        '127.0.0.1 1764230000200000 "GET /wiki/A HTTP/1.1" 200 99 D=99 pid=78 rid=r0-3-v owall=- ocpu=- owait=- oblocked=-\n')
    a, b = server.read_access(tmp_path)
    assert a.times == (40000, 12000, 3000, 25000) and a.duration_us == 41234
    assert b.times is None and b.rid == "r0-3-v"


def test_time_split_known_answer() -> None:
    """Two transactions, a small article's and a large one's: each component is the difference the
    module docstring names, per stage and size."""
    line = server.AccessLine
    log = [line(0, "POST", "/api.php", 200, 50_000, 1, "r0-0-p", (45_000, 10_000, 5_000, 30_000)),
           line(0, "GET", "/wiki/A", 200, 20_000, 1, "r0-0-v", (19_000, 15_000, 4_000, 0)),
           line(0, "POST", "/api.php", 200, 200_000, 2, "r0-1-p", None),
           line(0, "GET", "/x", 200, 1, 2, None, None)]  # not the bench's: left out
    got = workload.Replayed(np.zeros(2), ["ok", "ok"], np.array([[0.08, 0.021], [0.3, np.nan]]))
    out = split.time_split(log, got, np.array([0, 1]), np.array([1, 9, 2]))
    assert set(out) == {"preview_small", "view_small", "preview_large"}
    p = out["preview_small"]
    assert p["client"] == pytest.approx(0.08) and p["outside_apache"] == pytest.approx(0.03)
    assert p["apache_other"] == pytest.approx(0.005) and p["blocked"] == pytest.approx(0.03)
    assert p["run_queue"] == pytest.approx(0.005) and p["cpu"] == pytest.approx(0.01)
    assert out["view_small"]["outside_apache"] == pytest.approx(0.001) and out["view_small"]["cpu"] == pytest.approx(0.015)
    big = out["preview_large"]
    assert big["outside_apache"] == pytest.approx(0.1) and big["cpu"] is None and big["n_split"] == 0


def test_predicted_against_measured() -> None:
    locked = {"lock": {"default": 0.5, "passthrough+age": 0.45, "blind": 0.48}}
    arms = {"default": {"mean": 0.4}, "overtake_age": {"mean": 0.5}, "overtake": {"mean": 0.4},
            "sizeclass": {"mean": 0.3}}
    got = realapp.predicted_vs_measured(locked, arms)
    assert got["default"]["error"] == pytest.approx(0.25) and got["overtake_age"]["error"] == pytest.approx(-0.1)
    assert got["overtake_age"]["model"] == "passthrough+age" and "age" not in got
    assert "overtake" not in got and "sizeclass" not in got  # no size-class model given
    assert realapp.predicted_vs_measured(None, arms) == {}
    # the size class's arms from its model: sizeclass at the model's quantile, overtake at the guide's
    sized = {"quantile": 0.98, "arms": {"0.95": {"mean": 0.42}, "0.98": {"mean": 0.33}}}
    got = realapp.predicted_vs_measured(None, arms, sized)
    assert got["overtake"]["model"] == "size class 0.95" and got["overtake"]["error"] == pytest.approx(0.05)
    assert got["sizeclass"]["model"] == "size class 0.98" and got["sizeclass"]["error"] == pytest.approx(0.1)


# --------------------------------------------------------------------------- the wiki's set-up


def test_the_wiki_is_rebuilt_when_its_settings_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wiki, "_mediawiki_version", lambda: "1.39.test")
    recipe = pages.Recipe(articles=10)
    stamp = wiki.wanted_stamp(recipe)
    assert stamp["settings"] == wiki.settings_digest()
    monkeypatch.setattr(wiki, "SETTINGS", wiki.SETTINGS + "$wgMainCacheType = CACHE_NONE;\n")
    assert wiki.wanted_stamp(recipe)["settings"] != stamp["settings"]


def test_no_request_writes_the_sqlite_object_cache() -> None:
    # MediaWiki without an object cache rewrites its message cache into wikicache.sqlite on every
    # request; the bench's settings keep the object caches in APCu and the parser cache off
    text = wiki.SETTINGS
    assert "$wgMainCacheType = CACHE_ACCEL;" in text and "$wgMessageCacheType = CACHE_ACCEL;" in text
    assert "$wgParserCacheType = CACHE_NONE;" in text and "$wgJobRunRate = 0;" in text
    assert wiki.REQUIRED["php-apcu"].name == "apcu.so"


def test_db_written_names_the_databases_whose_files_changed(tmp_path: Path) -> None:
    (tmp_path / "db").mkdir()
    for name in ("wiki.sqlite", "wikicache.sqlite"):
        (tmp_path / "db" / name).write_bytes(b"x")
    before = wiki.db_state(tmp_path)
    assert wiki.written_since(tmp_path, before) == []
    os.utime(tmp_path / "db" / "wikicache.sqlite", ns=(1, before["wikicache.sqlite"] + 1000))
    (tmp_path / "db" / "new.sqlite").write_bytes(b"y")
    assert wiki.written_since(tmp_path, before) == ["new.sqlite", "wikicache.sqlite"]


# --------------------------------------------------------------------------- end to end


def _skip_reason() -> str | None:
    # opt-in: MediaWiki comes from the bench's own set-up, not from `make test`, so whether this
    # runs must not depend on what an earlier session left installed on the machine
    if os.environ.get("OVERTAKE_REALAPP_E2E") != "1":
        return "set OVERTAKE_REALAPP_E2E=1 to run the real-application bench end to end (its set-up installs MediaWiki)"
    if wiki.missing_packages():
        return f"MediaWiki's packages are not installed ({' '.join(wiki.missing_packages())}): sh {wiki.PACKAGES_SCRIPT}"
    if os.geteuid() != 0:
        return "needs root (www-data workers, autogroup priority)"
    if len(os.sched_getaffinity(0)) < 2:
        return "needs two cores (the server's and the client's)"
    return None


def _main(argv: list[str]) -> int:
    """``realapp.main(argv)`` with a scratch ``--data-dir`` (www-data reads the wiki's settings below
    it), removed afterwards, and the process's SIGTERM handler restored."""
    data = scratch_dir("realapp-test-")
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        return realapp.main([*argv, "--data-dir", str(data)])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the set-up of a scratch wiki, a calibration, the solves and five stacks
@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_end_to_end_on_a_tiny_trace(apache_available: None, capsys: pytest.CaptureFixture[str]) -> None:
    cores = os.sched_getaffinity(0)
    rc = _main(["--php", "prefork", "--runs", "1", "--transactions", "60", "--block", "30", "--articles", "10",
                "--json", "--no-write", "--halt-poll-us", "0"])
    assert os.sched_getaffinity(0) == cores
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    (run,) = doc["runs"]
    assert set(run["arms"]) == set(realapp.ARMS)
    for name in ("default", "overtake", "age", "sidecar"):
        a = run["arms"][name]
        assert a["failures"] == 0 and a["transactions"] == 60, (name, a)
        assert 0 < a["mean"] <= a["p99"]
    # a transaction is at least its idle preview and view
    cal = doc["calibration"]
    assert run["arms"]["default"]["mean"] > cal["preview"]["min"] + cal["view"]["min"]
    assert run["gain"] is not None and run["gain_ci95"] is not None
    # two blocks, every arm in both, the order reversed in the second; each block's CPU recorded
    assert run["blocks"] == [[0, 30], [30, 60]] and run["block_orders"][1] == run["block_orders"][0][::-1]
    for name in realapp.ARMS:
        assert len(run["arms"][name]["cpu_blocks"]) == 2 and run["arms"][name]["cpu_blocks"][0]["apache"] > 0
    # the request-time split reached the log of an arm without mod_overtake_prio's priority too
    assert sum(g["n_split"] for g in run["arms"]["default"]["time_split"].values()) > 0
    assert run["arms"]["overtake"]["prio"]["threshold_s"] == doc["model"]["threshold_s"] > 0
    assert "auto" in json.dumps(run["arms"]["overtake"]["sidecar_policy"])
    probe = cal["serialisation_probe"]
    assert 0.5 < probe["preview"] <= 1 and 0.5 < probe["view"] <= 1
    # no request wrote to SQLite (the object caches are in APCu; a preview's transaction changes nothing)
    assert doc["db_written"] == []
    # the size-class arm ran at the quantile the model chose, shown with every quantile's prediction
    sized = doc["model"]["size_class"]
    assert sized["source"] == "model" and f"{sized['quantile']:g}" in sized["arms"]
    assert "sizeclass" in run["predicted"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_end_to_end_size_class_under_fpm(apache_available: None, capsys: pytest.CaptureFixture[str]) -> None:
    rc = _main(["--php", "fpm", "--runs", "1", "--transactions", "120", "--block", "30", "--articles", "10",
                "--arms", "default,sizeclass", "--class-quantile", "0.5", "--json", "--no-write", "--halt-poll-us", "0"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    (run,) = doc["runs"]
    arm = run["arms"]["sizeclass"]
    assert arm["failures"] == 0 and doc["model"]["size_class"]["quantile"] == 0.5
    # the demotion reached php-fpm's workers once 50 views were predicted (the sidecar's MIN_PREDICTIONS):
    # the extension started the larger half low, counted in /-/metrics
    assert arm["php_prio"]["class_low"] > 0 and arm["php_prio"]["restore_errors"] == 0
    assert arm["sidecar_metrics"]["overtake_php_class_low_requests_total"] == arm["php_prio"]["class_low"]
    assert doc["db_written"] == []


def test_php_prio_settings_load_the_extension_at_the_solved_threshold(tmp_path: Path) -> None:
    ini = server.php_prio_settings(tmp_path / "overtake_prio.so", 0.0426, tmp_path / "stats")
    assert ini["overtake_prio.threshold_ms"] == "43" and ini["overtake_prio.idle"] == "1"
    assert ini["extension"].endswith("overtake_prio.so")
    with pytest.raises(ValueError, match="threshold_s"):
        server.php_prio_settings(tmp_path / "x.so", 0.0, tmp_path / "stats")


# --------------------------------------------------------------------------- the model with the lock

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "realapp.jsonl"


def _recorded(php: str, date: str) -> dict:
    for line in RESULTS.read_text().splitlines():
        doc = json.loads(line)
        if doc["figures"]["php"] == php and doc["date"].startswith(date):
            return doc["figures"]
    raise AssertionError(f"no recorded {php} run of {date}")


def test_lock_prediction_only_where_previews_serialise() -> None:
    lock_model = bench_module("mediawiki.lock_model")
    assert lock_model.serialises(0.69, 4) and lock_model.serialises(0.625, 4)
    assert not lock_model.serialises(0.80, 4) and not lock_model.serialises(1.0, 4)
    fig = _recorded("fpm", "2026-11-27T10:48")
    cal = {**fig["calibration"], "serialisation_probe": {**fig["calibration"]["serialisation_probe"], "preview": 0.95}}
    assert realapp.lock_prediction(cal, fig["model"], fig["arrival_rate"], "fpm") is None


def test_lock_prediction_of_a_recorded_fpm_run() -> None:
    """The recorded fpm run of 10:48 (php-fpm's 5 children): with the lock the model's default is
    above the processor-sharing prediction recorded with the run and within 15 % of the measured
    mean; the optimum with the lock is no worse than the default."""
    fig = _recorded("fpm", "2026-11-27T10:48")
    model = {**fig["model"], "threshold_s": None}  # no age simulation: the exact figures only
    got = realapp.lock_prediction(fig["calibration"], model, fig["arrival_rate"], "fpm")
    assert got is not None
    lock = got["lock"]
    measured = fig["across_runs"]["default"]["mean"]["mean"]
    assert lock["default"] > 1.1 * fig["model"]["predicted"]["pi(inf)"]
    assert abs(lock["default"] - measured) <= 0.15 * measured
    assert lock["optimum"] <= lock["default"]
    assert lock["optimum"] <= lock["blind"] * (1 + 2e-3) and lock["blind"] <= lock["default"] * (1 + 2e-3)
    assert got["no_lock"]["default"] < lock["default"]


def test_journal_mode_sets_the_wiki_database_and_puts_it_back(tmp_path: Path) -> None:
    import sqlite3

    (tmp_path / "db").mkdir()
    db = tmp_path / "db" / "wiki.sqlite"
    sqlite3.connect(db).execute("CREATE TABLE t (x)").connection.close()

    def mode() -> str:
        con = sqlite3.connect(db)
        try:
            return str(con.execute("PRAGMA journal_mode").fetchone()[0])
        finally:
            con.close()

    with wiki.journal_mode(tmp_path, "wal") as before:
        assert before == "delete" and mode() == "wal"
    assert mode() == "delete"
    with pytest.raises(KeyError), wiki.journal_mode(tmp_path, "wal"):
        assert mode() == "wal"
        raise KeyError("a failed run")
    assert mode() == "delete"  # put back after a failure too
    with pytest.raises(ValueError, match="journal"), wiki.journal_mode(tmp_path, "memory"):
        pass


def test_the_product_model_is_compared_with_the_mean_of_the_runs() -> None:
    # one prediction for every run (a stationary model sees no trace) against the runs' mean
    runs = [{"predicted": {"default": {"model": "default", "predicted": 0.4, "measured": m, "error": 0.4 / m - 1,
                                       "predicted_replayed": 0.3, "error_replayed": 0.3 / m - 1},
                           "overtake": {"model": "size class 0.95", "predicted": 0.3, "measured": m / 2,
                                        "error": 0.6 / m - 1}}} for m in (0.3, 0.5, 0.4)]
    out = realapp.predicted_vs_runs(runs)
    assert out["default"]["measured_mean"] == pytest.approx(0.4) and out["default"]["error"] == pytest.approx(0.0)
    assert out["default"]["error_replayed"] == pytest.approx(-0.25)
    assert out["overtake"]["error"] == pytest.approx(0.5) and "error_replayed" not in out["overtake"]
    assert realapp.predicted_vs_runs([{"arms": {}}]) == {}


def test_the_arms_cpu_under_load_is_over_the_idle_time_of_their_own_transactions() -> None:
    # every article 50 + 50 ms idle: 12 s of CPU over 100 transactions is 1.2 times the idle time
    cal = {"preview_s": [0.05] * 30, "view_s": [0.05] * 30}
    runs = [{"seed": k, "arms": {"default": {"transactions": 100, "cpu_s": {"apache": 10.0, "php": c}},
                                 "overtake": {"transactions": 0, "cpu_s": {}}}} for k, c in ((1, 2.0), (2, 4.0))]
    doc = {"calibration": cal, "arrival_rate": 5.0, "transactions": 100, "runs": runs}
    out = realapp.arm_demands(doc)
    assert out == {"default": pytest.approx((1.2 + 1.4) / 2)}  # an arm without transactions has none
    runs[0]["predicted"] = {"default": {"model": "default", "predicted": 0.3, "measured": 0.4, "error": -0.25}}
    both = realapp.predicted_vs_runs([runs[0]], {"default": 0.36}, out)["default"]
    assert both["error_at_load"] == pytest.approx(-0.1) and both["demand"] == pytest.approx(1.3)
