"""The low-rank update of the observation-policy search (ObservationSpace.evaluate, Factor.update)
against the plain exact evaluation it replaces.

* a trial table that changes a few classes, solved by the Sherman–Morrison–Woodbury update of the
  current table's factor, has the gain, E[W], bias and stationary laws of a new factorization of
  its own system (to 1e-9), with and without route classes;
* a local search that updates takes the steps of one that factors every trial: the same accepted
  subsets, the same table, the same gains (to 1e-9);
* an update whose answer is wrong misses its residual check, and the trial is factored instead
  (the answer stays exact).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import observation_exact
from overtake.mdp.factor import Factor
from overtake.mdp.observation import ExactEvaluation, ObservationSpace
from overtake.mdp.observed_improve import improve, trials
from overtake.mdp.observed_tables import starting_tables
from overtake.mdp.routes import RouteSplit
from overtake.mdp.statespace import Layout, Truncation

FloatArray = npt.NDArray[np.float64]


def _model():  # type: ignore[no-untyped-def]
    return tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2


def _space(cap: int, routed: bool = False) -> ObservationSpace:
    model = _model()
    if routed:  # two routes on the H2 stage, 'light' (99 % short) and 'heavy' (10 % short)
        a = model.stages[-1].alpha[0]
        p = (a - 0.1) / (0.99 - 0.1)
        split = RouteSplit.build(model, [None, [("light", p, [0.99, 0.01]), ("heavy", 1 - p, [0.1, 0.9])]])
        return ObservationSpace(model, Truncation(cap), split.layout(model))
    return ObservationSpace(model, Truncation(cap), Layout.build(model, "none"))


def _same(a: ExactEvaluation, b: ExactEvaluation) -> None:
    assert a.gain == pytest.approx(b.gain, rel=1e-9)
    assert a.metrics.mean_response_time == pytest.approx(b.metrics.mean_response_time, rel=1e-9)
    for x, y in ((a.bias, b.bias), (a.post, b.post), (a.epochs, b.epochs)):
        assert np.abs(x - y).max() <= 1e-9 * np.abs(y).max()


@pytest.mark.parametrize(("cap", "routed"), [(8, False), (6, True)])
def test_updated_trial_is_the_factored_trial(cap: int, routed: bool) -> None:
    osp = _space(cap, routed)
    name = "pi(2)" + (" (lightest route first)" if routed else "")
    A = starting_tables(osp, ["pi(2)"], False, {})[name]
    ev = osp.evaluate(A)
    assert ev.refactored and ev.factor.complete
    prop = osp.propose(A, ev)
    updated = 0
    for _, sel in trials(osp, prop, A, 6):
        B = A.copy()
        B[sel] = prop.actions[sel]
        if not osp.low_rank(B, ev):
            continue
        fast = osp.evaluate(B, near=ev)
        plain = _space(cap, routed).evaluate(B)
        assert not fast.refactored and fast.factor is ev.factor  # the update, not a new LU
        assert fast.gain != pytest.approx(ev.gain, rel=1e-12)  # the trial moved the gain: a real test
        _same(fast, plain)
        updated += 1
    assert updated >= 3


def test_search_with_updates_takes_the_steps_of_the_factored_one(monkeypatch: pytest.MonkeyPatch) -> None:
    start = starting_tables(_space(8), ["pi(2)"], False, {})["pi(2)"]
    updates: list[bool] = []
    update = Factor.update

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = update(self, *args, **kwargs)
        updates.append(out is not None)
        return out

    monkeypatch.setattr(Factor, "update", counted)
    fast = improve(_space(8), start, start="pi(2)")
    assert len(updates) >= 5 and all(updates)
    monkeypatch.setattr(observation_exact, "LOW_RANK", -1)  # never an update: every trial factored
    updates.clear()
    plain = improve(_space(8), start, start="pi(2)")
    assert not updates
    assert fast.steps >= 3
    assert np.array_equal(fast.actions, plain.actions)
    assert [h.get("accepted") for h in fast.history] == [h.get("accepted") for h in plain.history]
    for a, b in zip(fast.history, plain.history, strict=True):
        if "gain" in b:
            assert a["gain"] == pytest.approx(b["gain"], rel=1e-9)
            assert a["mean_response_time"] == pytest.approx(b["mean_response_time"], rel=1e-9)


def test_a_wrong_update_is_caught_by_its_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    osp = _space(8)
    A = starting_tables(osp, ["pi(2)"], False, {})["pi(2)"]
    ev = osp.evaluate(A)
    prop = osp.propose(A, ev)
    label, sel = next((lab, s) for lab, s in trials(osp, prop, A, 6) if lab.startswith("class"))
    B = A.copy()
    B[sel] = prop.actions[sel]
    assert osp.low_rank(B, ev)
    update = Factor.update

    def skewed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = update(self, *args, **kwargs)
        assert out is not None
        sol, solT = out
        return sol * (1 + 1e-8), solT  # the bias solves a little off

    monkeypatch.setattr(Factor, "update", skewed)
    ev_b = osp.evaluate(B, near=ev)
    assert ev_b.refactored  # the residual check refused the update
    _same(ev_b, _space(8).evaluate(B))


def test_warm_started_ladder_law_is_the_cold_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """An evaluation cap's stationary solve started from a similar table's law on that cap (the
    solve caps' ladders, :mod:`overtake.mdp.observed`) meets the cold solve's answer, in fewer
    Gauss–Seidel sweeps."""
    from overtake.mdp import _kernels
    from overtake.mdp.observed_chain import observed_law
    from overtake.mdp.observed_tables import stage_rule

    model = _model()
    layout = Layout.build(model, "none")
    sweeps: list[int] = []
    gauss_seidel = _kernels.gauss_seidel

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        sweeps.append(1)
        return gauss_seidel(*args, **kwargs)

    monkeypatch.setattr(_kernels, "gauss_seidel", counted)
    pi2, pi4 = stage_rule(model, "pi(2)"), stage_rule(model, "pi(4)")
    _, law2 = observed_law(model, layout, pi2, max_requests=30)
    sweeps.clear()
    cold, _ = observed_law(model, layout, pi4, max_requests=30)
    n_cold = len(sweeps)
    sweeps.clear()
    warm, law4 = observed_law(model, layout, pi4, max_requests=30, warm=law2)
    assert n_cold > 5 and 0 < len(sweeps) < n_cold
    assert warm.mean_response_time == pytest.approx(cold.mean_response_time, rel=1e-9)
    assert warm.blocking_probability == pytest.approx(cold.blocking_probability, rel=1e-6)
    assert law4.keys.size > law2.keys.size // 2 and np.all(np.diff(law4.keys) > 0)


@pytest.mark.parametrize(("cap", "routed"), [(8, False), (6, True)])
def test_update_reuses_solved_columns_with_the_same_answer(cap: int, routed: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The trials of a search share the factor's solved columns (A⁻¹ P_chg(·, z) per changed
    state z, A⁻ᵀ ΔR(z, ·)ᵀ per state and new action): each is solved once, and every trial's
    evaluation is the one the factor's solves without the kept columns give (to 1e-10)."""
    osp = _space(cap, routed)
    name = "pi(2)" + (" (lightest route first)" if routed else "")
    A = starting_tables(osp, ["pi(2)"], False, {})[name]
    ev = osp.evaluate(A)
    prop = osp.propose(A, ev)
    solved: list[int] = []
    asked: list[int] = []
    columns = Factor._columns

    def counted(self, B, keys, *, trans):  # type: ignore[no-untyped-def]
        asked.append(len(keys))
        solved.append(sum(1 for k in keys if k not in self._solved[1 if trans else 0]))
        return columns(self, B, keys, trans=trans)

    monkeypatch.setattr(Factor, "_columns", counted)
    tables = []
    for _, sel in trials(osp, prop, A, 6):
        B = A.copy()
        B[sel] = prop.actions[sel]
        if osp.low_rank(B, ev):
            tables.append(B)
    fast = [osp.evaluate(B, near=ev) for B in tables]
    assert len(tables) >= 3 and all(not f.refactored for f in fast)
    assert 0 < sum(solved) < sum(asked)  # the later trials reuse the earlier ones' columns
    update = Factor.update
    monkeypatch.setattr(Factor, "update", lambda self, U, Vt, u0, keys=None: update(self, U, Vt, u0))
    for B, f in zip(tables, fast, strict=True):
        plain = osp.evaluate(B, near=ev)
        assert not plain.refactored
        assert f.gain == pytest.approx(plain.gain, rel=1e-10)
        assert f.metrics.mean_response_time == pytest.approx(plain.metrics.mean_response_time, rel=1e-10)
        assert np.abs(f.bias - plain.bias).max() <= 1e-10 * np.abs(plain.bias).max()
        assert np.abs(f.post - plain.post).max() <= 1e-10 * np.abs(plain.post).max()
