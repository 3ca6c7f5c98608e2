"""bench/mediawiki/sqlite_model.py: the wiki under SQLite's rollback-journal locks, trace-driven."""

from __future__ import annotations

import numpy as np
import pytest
from support.bench import bench_module

sqlite_model = bench_module("mediawiki.sqlite_model")
class_model = bench_module("mediawiki.class_model")


def _trace(n: int, rate: float, articles: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1 / rate, size=n)), rng.integers(0, articles, size=n)


def test_simple_locking_is_the_class_models_capacity_one_lock() -> None:
    """Two implementations of the same model: no start-up, no readers, handover first come first served."""
    rng = np.random.default_rng(3)
    prev, view = rng.lognormal(np.log(0.05), 1.0, 50), rng.lognormal(np.log(0.07), 1.0, 50)
    arrival, art = _trace(3000, 0.7 / float(np.mean(prev + view)), 50, 4)
    got = sqlite_model.simulate(arrival, art, prev, view, simple=True)
    want = class_model.simulate(arrival, art, prev, view)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    low = view > np.quantile(view, 0.9)
    assert sqlite_model.simulate(arrival, art, prev, view, simple=True, low=low) == pytest.approx(
        class_model.simulate(arrival, art, prev, view, low=low), rel=1e-9, abs=1e-12)


def test_a_transaction_alone_takes_its_demand() -> None:
    prev, view = np.array([0.05, 0.2]), np.array([0.08, 0.3])
    rt = sqlite_model.simulate(np.array([0.0, 10.0]), np.array([1, 0]), prev, view, startup=(0.03, 0.04), demand=1.1)
    assert rt == pytest.approx([1.1 * 0.5, 1.1 * 0.13], rel=1e-12)


def test_a_commit_waits_for_the_running_reader_and_the_busy_handler() -> None:
    """tx0's view (1 s) holds SHARED; tx1's preview locks at 0.02, runs 0.1 s of CPU beside the view
    (until 0.22), then waits to commit until the view ends (1.11) and the busy handler tries again:
    from 0.22 after 1, 2, 5, ... ms, then every 100 ms, so at 1.148; its view then runs 10 ms alone."""
    prev, view = np.array([0.01, 0.1]), np.array([1.0, 0.01])
    arrival, art = np.array([0.0, 0.02]), np.array([0, 1])
    full = sqlite_model.simulate(arrival, art, prev, view)
    assert full == pytest.approx([1.11, 1.158 - 0.02], abs=1e-9)
    simple = sqlite_model.simulate(arrival, art, prev, view, simple=True)
    # without readers blocking: tx1 commits at 0.22 and its view shares the core with tx0's until 0.24
    assert simple == pytest.approx([1.12, 0.24 - 0.02], abs=1e-9)


def test_in_wal_mode_a_commit_waits_for_no_reader_but_writers_still_take_turns() -> None:
    """The same two transactions in write-ahead-log mode: tx1 commits at 0.22 beside the running
    view (as without readers), and a second preview that wants the write lock meanwhile polls."""
    prev, view = np.array([0.01, 0.1]), np.array([1.0, 0.01])
    arrival, art = np.array([0.0, 0.02]), np.array([0, 1])
    assert sqlite_model.simulate(arrival, art, prev, view, wal=True) == pytest.approx([1.12, 0.22], abs=1e-9)
    # two previews of 0.1 s at 0 and 0.01: the first runs alone (a blocked one uses no CPU) and commits
    # at 0.1; the second tried at 0.01 and again after 1, 2, 5, 10, 15, 20, 25, 25 ms (at 0.088, then
    # 0.113): it takes the lock at 0.113, runs 0.1 s and its view 1 ms
    prev2, view2 = np.array([0.1, 0.1]), np.array([0.001, 0.001])
    rt = sqlite_model.simulate(np.array([0.0, 0.01]), np.array([0, 1]), prev2, view2, wal=True)
    assert rt == pytest.approx([0.101, 0.113 + 0.1 + 0.001 - 0.01], abs=1e-9)


def test_the_sidecar_gate_changes_nothing_when_previews_cost_the_same() -> None:
    """Equal previews: the response ratio is oldest first, and a preview blocked in PHP uses no CPU."""
    prev, view = np.full(20, 0.05), np.random.default_rng(5).lognormal(np.log(0.07), 1.0, 20)
    arrival, art = _trace(2000, 0.6 / float(np.mean(prev + view)), 20, 6)
    a = sqlite_model.simulate(arrival, art, prev, view, simple=True)
    b = sqlite_model.simulate(arrival, art, prev, view, simple=True, gate=True)
    assert a == pytest.approx(b, rel=1e-9, abs=1e-12)


def test_php_workers_queue_first_come_first_served() -> None:
    """One worker: tx1's preview waits for tx0's preview; tx0's view then queues behind it."""
    prev, view = np.array([0.1, 0.1]), np.array([0.2, 0.2])
    rt = sqlite_model.simulate(np.array([0.0, 0.05]), np.array([0, 1]), prev, view, workers=1, simple=True)
    # 0-0.1 tx0 preview; 0.1-0.2 tx1 preview; 0.2-0.4 tx0 view; 0.4-0.6 tx1 view
    assert rt == pytest.approx([0.4, 0.55], abs=1e-12)


@pytest.mark.parametrize(("kw", "field"), [({"demand": 0.0}, "demand"), ({"workers": 0}, "workers")])
def test_bad_input_names_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        sqlite_model.simulate(np.array([0.0]), np.array([0]), np.array([0.1]), np.array([0.1]), **kw)


def test_the_products_readers_match_the_trace_model() -> None:
    """Two implementations of a commit waiting for readers with the busy handler's sleeps: the
    product's simulator (``TandemModel(readers=..., commit_retry=BUSY_DELAYS)``) and this trace
    model, exponential costs per transaction (30 and 70 ms), no start-up. The readers add about a
    fifth to the mean here, more than the tolerance: a simulator ignoring them fails. (The trace
    model also polls for the writers' lock, which the product hands over at once: little here.)"""
    from overtake.mdp import Stage, TandemModel
    from overtake.mdp.simulation import simulate

    mp, mv, lam, n = 0.03, 0.07, 7.0, 60_000
    rng = np.random.default_rng(1)
    arrival = np.cumsum(rng.exponential(1 / lam, n))
    prev, view = rng.exponential(mp, n), rng.exponential(mv, n)
    stages = tuple(Stage(s, np.array([1.0]), np.array([[-1 / m]])) for s, m in (("preview", mp), ("view", mv)))
    got = {}
    for wal in (False, True):
        rt = sqlite_model.simulate(arrival, np.arange(n), prev, view, wal=wal)[n // 10:]
        bm = rt[: rt.size // 20 * 20].reshape(20, -1).mean(axis=1)
        half = 2.1 * float(bm.std(ddof=1)) / np.sqrt(20)
        kw = {} if wal else {"readers": (False, True), "commit_retry": sqlite_model.BUSY_DELAYS}
        sim = simulate(TandemModel(lam, stages, locks=(1, None), **kw), "pi(inf)", requests=400_000, seed=2)
        assert abs(float(rt.mean()) - sim.mean_response_time) < 2 * (half + sim.ci95)
        got[wal] = sim.mean_response_time
    assert got[False] > 1.15 * got[True]
