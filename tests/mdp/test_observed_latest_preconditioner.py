"""The latest factorization as the preconditioner (ExactSolver.follow, solve_observed's
``latest_preconditioner``): every factorization preconditions the tables after it, a missed
iterative solve refactors without giving up on iterating, and every answer agrees with a space
that factors each table completely (1e-9 relative). The iterative path runs on a small chain
(DIRECT_STATES 0) so the tests stay short."""

from __future__ import annotations

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import observation_exact
from overtake.mdp.observation import ExactEvaluation, ObservationSpace
from overtake.mdp.observed import solve_observed
from overtake.mdp.observed_tables import starting_tables
from overtake.mdp.statespace import Layout, Truncation

MODEL = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2
TR = Truncation(7)


def _space(follow: bool) -> ObservationSpace:
    osp = ObservationSpace(MODEL, TR, Layout.build(MODEL, "none"))
    osp.exact.follow = follow
    return osp


def _tables(osp: ObservationSpace) -> list[np.ndarray]:
    start = starting_tables(osp, ["pi(inf)", "pi(2)", "pi(1)"], False, {})
    A, B, C = start["pi(inf)"], start["pi(2)"], start["pi(1)"]
    assert np.any(A != B) and np.any(B != C)
    return [A, B, C, A, B]


def _agrees(got: ExactEvaluation, want: ExactEvaluation) -> None:
    assert got.gain == pytest.approx(want.gain, rel=1e-9)
    assert got.metrics.mean_response_time == pytest.approx(want.metrics.mean_response_time, rel=1e-9)
    assert np.abs(got.post - want.post).max() <= 1e-9 * want.post.max()
    assert np.abs(got.bias - want.bias).max() <= 1e-9 * np.abs(want.bias).max()


def _search(osp: ObservationSpace, tables: list[np.ndarray]) -> list[ExactEvaluation]:
    ev = osp.evaluate(tables[0])
    out = [ev]
    for T in tables[1:]:
        ev = osp.evaluate(T, near=ev)
        out.append(ev)
    return out


def test_the_latest_factor_preconditions_and_the_answers_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)
    osp, ref = _space(True), _space(False)
    tables = _tables(osp)
    ev = osp.evaluate(tables[0])
    for T in tables[1:]:
        ev = osp.evaluate(T, near=ev)
        if ev.refactored:  # every factorization preconditions the next table, however dense
            assert osp.exact.preconditioner is ev.factor
    got = _search(osp, tables)
    assert all(not ev.factor.complete for ev in got)  # incomplete factors: the iterative path
    assert any(not ev.refactored for ev in got)  # some tables were iterated, not factored
    for ev, T in zip(got, tables, strict=True):
        _agrees(ev, ref.evaluate(T, complete=True))


def test_misses_refactor_without_giving_up(starved: list[bool]) -> None:
    """Every iterative solve on a budget of one iteration (so it misses): each miss refactors, its
    factor preconditions the next table, and the next table is still tried iteratively."""
    calls = starved
    osp, ref = _space(True), _space(False)
    tables = _tables(osp)
    evs = _search(osp, tables)
    assert len(calls) == len(tables) - 1 > observation_exact.ITER_GIVE_UP  # one try per table, never given up
    assert not any(calls) and not osp.exact.given_up
    assert all(ev.refactored for ev in evs) and osp.exact.preconditioner is evs[-1].factor
    for ev, T in zip(evs, tables, strict=True):
        _agrees(ev, ref.evaluate(T, complete=True))


def test_a_wrong_iterative_answer_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cross-check above can fail: a bias solve off by 1e-6 (relative), planted past the
    iteration's own residual test, is flagged."""
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)
    iterate = observation_exact.Factor.iterate

    def planted(self, A_, B_, X0, *, budget, trans=False):  # type: ignore[no-untyped-def]
        out = iterate(self, A_, B_, X0, budget=budget, trans=trans)
        return out if out is None or trans else out * (1 + 1e-6)

    monkeypatch.setattr(observation_exact.Factor, "iterate", planted)
    osp, ref = _space(True), _space(False)
    tables = _tables(osp)
    evs = _search(osp, tables)
    wrong = [(ev, T) for ev, T in zip(evs, tables, strict=True) if not ev.refactored]
    assert wrong
    for ev, T in wrong:
        with pytest.raises(AssertionError):
            _agrees(ev, ref.evaluate(T, complete=True))


def test_the_option_reaches_the_solves_spaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """solve_observed(latest_preconditioner=True) searches on spaces that follow the latest
    factor; on this small chain its E[W] is the default solve's (no tie is met here)."""
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)
    follows: list[bool] = []
    evaluate = ObservationSpace.evaluate

    def watched(self, *a, **k):  # type: ignore[no-untyped-def]
        follows.append(self.exact.follow)
        return evaluate(self, *a, **k)

    monkeypatch.setattr(ObservationSpace, "evaluate", watched)
    got = solve_observed(MODEL, truncation=TR, latest_preconditioner=True, heuristic=False)
    assert follows and all(follows)
    follows.clear()
    want = solve_observed(MODEL, truncation=TR, heuristic=False)
    assert follows and not any(follows)
    assert got.metrics.mean_response_time == pytest.approx(want.metrics.mean_response_time, rel=1e-9)
