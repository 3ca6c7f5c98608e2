"""bench/mediawiki/class_model.py: the size-class model that picks the sizeclass arm's quantile.
Known answers of processor sharing and of the lock's FIFO queue, the weights' effect, and the
choice."""

from __future__ import annotations

import numpy as np
import pytest
from support.bench import bench_module

class_model = bench_module("mediawiki.class_model")

EPS = 1e-9  # a request that takes no time worth counting


def _poisson(rate: float, n: int, seed: int) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed).exponential(1 / rate, size=n))


def test_views_alone_share_the_core_as_processor_sharing() -> None:
    # M/G/1-PS: the mean response time is E[S] / (1 - rho) whatever the distribution (insensitivity)
    rng = np.random.default_rng(2)
    view = rng.choice([0.02, 0.3], size=50, p=[0.8, 0.2])  # mean 0.076
    rate = 0.6 / view.mean()
    n = 60_000
    art = rng.integers(0, 50, size=n)
    rt = class_model.simulate(_poisson(rate, n, 3), art, np.full(50, EPS), view)
    es = view[art].mean()
    assert rt[n // 20:].mean() == pytest.approx(es / (1 - rate * es), rel=0.06)


def test_previews_alone_queue_for_the_lock_first_come_first_served() -> None:
    # the lock makes previews an M/G/1 FIFO queue: Pollaczek-Khinchine
    rng = np.random.default_rng(4)
    prev = rng.choice([0.02, 0.2], size=40, p=[0.9, 0.1])
    rate = 0.5 / prev.mean()
    n = 60_000
    art = rng.integers(0, 40, size=n)
    rt = class_model.simulate(_poisson(rate, n, 5), art, prev, np.full(40, EPS))
    es, es2 = prev[art].mean(), (prev[art] ** 2).mean()
    rho = rate * es
    assert rt[n // 20:].mean() == pytest.approx(es + rate * es2 / (2 * (1 - rho)), rel=0.06)


def test_a_demoted_view_runs_at_its_weight_once_its_article_was_seen() -> None:
    # two views of 1 s at once; article 0's is demoted: it gets 15 / 1039 of the core
    arrival, art = np.array([0.0, 0.0]), np.array([0, 1])
    prev, view, low = np.full(2, EPS), np.ones(2), np.array([True, False])
    fair = class_model.simulate(arrival, art, prev, view, low=low)  # article 0 never seen: not demoted
    assert fair == pytest.approx([2.0, 2.0], abs=1e-6)
    rt = class_model.simulate(arrival, art, prev, view, low=low, learn=False)
    share = class_model.NICE0 / (class_model.NICE0 + class_model.NICE19)
    assert rt[1] == pytest.approx(1 / share, abs=1e-6)  # the normal view, slowed a little
    assert rt[0] == pytest.approx(2.0, abs=1e-6)  # work conserving: the last ends when all work is done
    # equal weights: the class changes nothing
    same = class_model.simulate(arrival, art, prev, view, low=low, learn=False, low_weight=class_model.NICE0)
    assert same == pytest.approx(fair, abs=1e-9)


def test_shortest_preview_first_beats_fifo_for_the_lock() -> None:
    rng = np.random.default_rng(6)
    prev = rng.lognormal(np.log(0.03), 1.5, size=100)
    rate = 0.7 / prev.mean()
    art = rng.integers(0, 100, size=20_000)
    arrival = _poisson(rate, 20_000, 7)
    fifo = class_model.simulate(arrival, art, prev, np.full(100, EPS))
    spt = class_model.simulate(arrival, art, prev, np.full(100, EPS), preview_order="spt")
    assert spt.mean() < 0.8 * fifo.mean()
    # both serve the same work: the last transaction ends at the same time
    assert (arrival + fifo).max() == pytest.approx((arrival + spt).max(), rel=1e-9)


def test_choose_reports_every_quantile_and_picks_the_least_mean() -> None:
    rng = np.random.default_rng(8)
    units = np.clip(np.rint(rng.lognormal(0.5, 2.0, size=120)), 1, 300)
    prev, view = 0.02 + 0.004 * units, 0.03 + 0.005 * units  # cost linear in the sections, as the wiki's
    rate = 0.6 / (prev + view).mean()
    out = class_model.choose(prev, view, rate, quantiles=(0.5, 0.9, 0.99), transactions=1500, seeds=(1, 2))
    assert set(out["arms"]) == {"none", "0.5", "0.9", "0.99"}
    means = {q: out["arms"][f"{q:g}"]["mean"] for q in (0.5, 0.9, 0.99)}
    assert out["chosen"] == min(means, key=means.__getitem__)
    for v in out["arms"].values():
        assert v["gain"] == pytest.approx(out["default"] / v["mean"] - 1)
    # releasing the shortest preview first already gains over the default on a heavy-tailed wiki
    assert out["arms"]["none"]["gain"] > 0


@pytest.mark.parametrize("kw, field", [({"rate": 0.0}, "rate"), ({"rate": 100.0}, "rate"),
                                       ({"quantiles": (1.2,)}, "quantiles"), ({"transactions": 10}, "transactions")])
def test_choose_refuses_bad_input_naming_the_field(kw: dict, field: str) -> None:
    args = {"rate": 1.0} | kw
    rate = args.pop("rate")
    with pytest.raises(ValueError, match=field):
        class_model.choose(np.full(5, 0.1), np.full(5, 0.1), rate, **args)
    with pytest.raises(ValueError, match="preview_order"):
        class_model.simulate(np.zeros(1), np.zeros(1, int), np.ones(1), np.ones(1), preview_order="lifo")


def test_the_response_ratio_sits_between_shortest_first_and_fifo() -> None:
    """On one lock (views free), the sidecar's order keeps most of shortest-first's mean, serves the
    same work, and its largest response is below shortest-first's (a long preview's ratio grows)."""
    rng = np.random.default_rng(6)
    prev = rng.lognormal(np.log(0.03), 1.5, size=100)
    rate = 0.8 / prev.mean()
    art = rng.integers(0, 100, size=20_000)
    arrival = _poisson(rate, 20_000, 7)
    got = {o: class_model.simulate(arrival, art, prev, np.full(100, EPS), preview_order=o)
           for o in ("fifo", "spt", "ratio")}
    assert got["spt"].mean() < got["ratio"].mean() < got["fifo"].mean()
    assert got["ratio"].mean() < 0.8 * got["fifo"].mean()
    assert got["ratio"].max() < got["spt"].max()
    assert (arrival + got["ratio"]).max() == pytest.approx((arrival + got["fifo"]).max(), rel=1e-9)


def test_readers_hold_a_commit_until_the_view_ends_and_the_busy_handler_tries() -> None:
    """Hand timeline: tx0's preview (10 ms) commits at once, its view (1 s) runs; tx1's preview
    (0.1 s) shares the core from 0.02 to 0.22, then its commit waits for tx0's view (ends 1.11)
    and tries at 0.22 + 1, 2, 5, ... ms, then every 100 ms: at 1.148; its view runs 10 ms alone.
    The trace model (sqlite_model, no start-up) gives the same timeline."""
    prev, view = np.array([0.01, 0.1]), np.array([1.0, 0.01])
    arrival, art = np.array([0.0, 0.02]), np.array([0, 1])
    assert class_model.simulate(arrival, art, prev, view, readers=True) == pytest.approx([1.11, 1.158 - 0.02], abs=1e-9)
    assert class_model.simulate(arrival, art, prev, view) == pytest.approx([1.12, 0.24 - 0.02], abs=1e-9)


def test_blocks_from_idle_are_shorter_than_the_stationary_run() -> None:
    """The bench's replay (blocks of 30 from an idle server) never sees a backlog older than its
    block: at a high load its mean is below the stationary one."""
    rng = np.random.default_rng(2)
    prev, view = rng.lognormal(np.log(0.05), 1.0, 40), rng.lognormal(np.log(0.07), 1.0, 40)
    rate = 0.85 / float(np.mean(prev + view))
    st = class_model.choose(prev, view, rate, quantiles=(0.9,), transactions=600, seeds=(1, 2))
    bl = class_model.choose(prev, view, rate, quantiles=(0.9,), transactions=600, seeds=(1, 2), block=30)
    assert bl["default"] < st["default"]
    one = class_model.choose(prev, view, rate, quantiles=(0.9,), transactions=600, seeds=(1, 2), block=600, warmup=0)
    assert one["default"] == pytest.approx(class_model.choose(prev, view, rate, quantiles=(0.9,), transactions=600,
                                                              seeds=(1, 2), warmup=0)["default"], rel=1e-12)
