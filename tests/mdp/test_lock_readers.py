"""A lock's readers (``TandemModel(readers=...)``, SQLite's SHARED lock): the simulator's pending commit."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.mdp import Stage, TandemModel
from overtake.mdp.errors import ModelError
from overtake.mdp.rule_evaluation import evaluate_baseline
from overtake.mdp.simulation import simulate

PREVIEW = Stage("preview", np.array([0.8, 0.2]), np.diag([-40.0, -4.0]))
VIEW = Stage("view", np.array([1.0]), np.array([[-15.0]]))


def _model(**kw: object) -> TandemModel:
    return TandemModel(6.0, (PREVIEW, VIEW), locks=(1, None), **kw)  # type: ignore[arg-type]


def test_no_readers_is_todays_lock_bit_for_bit() -> None:
    """Readers on no stage take none of the new branches: the same draws, the same figures."""
    a = simulate(_model(), "pi(inf)", requests=20_000, seed=5)
    b = simulate(_model(readers=(False, False)), "pi(inf)", requests=20_000, seed=5)
    assert (a.mean_response_time, a.events, a.percentiles) == (b.mean_response_time, b.events, b.percentiles)


def test_no_readers_matches_the_exact_chain_within_the_interval() -> None:
    exact = evaluate_baseline(_model(), "pi(inf)", tol=1e-4).metrics.mean_response_time
    sim = simulate(_model(readers=(False, False)), "pi(inf)", requests=200_000, seed=1)
    assert abs(sim.mean_response_time - exact) < 2.5 * sim.ci95


def test_readers_conserve_flow_and_slow_commits_only_with_the_busy_handler() -> None:
    """Without sleeps the pending commit keeps the processor busy (readers run): Little's law
    still holds; the busy handler's sleeps idle the processor, so the mean rises above it."""
    plain = simulate(_model(), "pi(inf)", requests=200_000, seed=2)
    rd = simulate(_model(readers=(False, True)), "pi(inf)", requests=200_000, seed=2)
    slept = simulate(_model(readers=(False, True), commit_retry=(0.01, 0.05)), "pi(inf)", requests=200_000, seed=2)
    for r in (rd, slept):
        assert abs(r.little_residual) < 0.03
    # the preview stage's sojourn now includes the wait for readers
    assert rd.stages[0].mean_sojourn > plain.stages[0].mean_sojourn
    assert slept.mean_response_time > rd.mean_response_time + 2 * (slept.ci95 + rd.ci95)


def test_a_lone_transaction_never_waits_for_itself() -> None:
    """At a vanishing load no reader overlaps a commit: the mean is E[S1] + E[S2] with or without readers."""
    m = TandemModel(0.01, (PREVIEW, VIEW), locks=(1, None), readers=(False, True), commit_retry=(0.1,))
    r = simulate(m, "pi(inf)", requests=20_000, seed=3)
    assert r.mean_response_time == pytest.approx(PREVIEW.mean() + VIEW.mean(), rel=0.03)


@pytest.mark.parametrize(("kw", "field"), [
    (dict(readers=(False, True)), "readers, commit_retry"),  # no lock
    (dict(locks=(1, None), readers=(True, False)), "readers[0]"),
    (dict(locks=(1, None), readers=(False,)), "readers:"),
    (dict(locks=(1, None), commit_retry=(0.01,)), "commit_retry: a commit waits"),
    (dict(locks=(1, None), readers=(False, True), commit_retry=(0.0,)), "commit_retry: a non-empty"),
    (dict(locks=(2, None), readers=(False, True)), "capacity 1"),
])
def test_bad_readers_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ModelError, match=field.replace("[", r"\[").replace("]", r"\]")):
        TandemModel(1.0, (PREVIEW, VIEW), **kw)  # type: ignore[arg-type]


def test_the_exact_chain_refuses_readers() -> None:
    with pytest.raises(ModelError, match="readers: the exact chains"):
        evaluate_baseline(_model(readers=(False, True)), "pi(inf)")


def test_views_held_by_a_cap_block_behind_a_pending_commit_and_flow_is_conserved() -> None:
    """pi(1,2): a view waiting for a view thread can start while a commit is pending; it blocks
    (a thread, no CPU) and starts at the commit. Little's law holds; the view stage never has
    more threads than its cap."""
    r = simulate(_model(readers=(False, True), commit_retry=(0.01,)), "pi(1,2)", requests=200_000, seed=4)
    assert abs(r.little_residual) < 0.02
    assert r.stages[1].mean_threads <= 2.0
    base = simulate(_model(), "pi(1,2)", requests=200_000, seed=4)
    assert r.stages[0].mean_sojourn > base.stages[0].mean_sojourn
