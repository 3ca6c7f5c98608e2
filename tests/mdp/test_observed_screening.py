"""The cheap steps of the observation-policy search against the exact ones they replace.

* a table's stationary gain (its law's mean cost, :meth:`ObservationSpace.stationary_gain`) is the
  gain of the full evaluation (bias and law from one factorization);
* an incomplete factor with GMRES gives the complete factor's gain, bias and laws;
* screening trial steps by their stationary gain takes the same steps as evaluating every trial
  in full, with fewer full evaluations;
* the breadth-first chain of an observation rule asks the rule once per distinct observation;
* Table 1 case 1 (exponential stages): the blind optimum's E[W] is the one the full evaluation of
  every trial found (no worse).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.api.scenario import load_scenario
from overtake.mdp import observation_exact, observed_improve
from overtake.mdp.observation import ObservationSpace
from overtake.mdp.observed import observed_baselines, solve_observed
from overtake.mdp.observed_chain import evaluate_observed
from overtake.mdp.observed_improve import improve
from overtake.mdp.observed_tables import starting_tables
from overtake.mdp.statespace import Layout, Truncation

ROOT = Path(__file__).resolve().parents[2]
FloatArray = npt.NDArray[np.float64]


def _case2(cap: int) -> ObservationSpace:
    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2
    return ObservationSpace(model, Truncation(cap), Layout.build(model, "none"))


def test_stationary_gain_is_the_full_evaluations_gain() -> None:
    osp = _case2(8)
    tables = starting_tables(osp, observed_baselines(2), True, {})
    assert len(tables) >= 5
    for A in tables.values():
        ev = osp.evaluate(A)
        g, post = osp.stationary_gain(A)
        assert g == pytest.approx(ev.gain, rel=1e-9)
        assert np.abs(post - ev.post).max() <= 1e-9


def test_incomplete_factor_gives_the_complete_factors_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)  # every factor of this small chain incomplete
    osp = _case2(10)
    for A in starting_tables(osp, ["pi(2)", "pi(inf)"], True, {}).values():
        ilu, lu = osp.evaluate(A), osp.evaluate(A, complete=True)
        assert not ilu.factor.complete and lu.factor.complete  # GMRES carried the incomplete factor
        assert ilu.gain == pytest.approx(lu.gain, rel=1e-9)
        for x, y in ((ilu.bias, lu.bias), (ilu.post, lu.post), (ilu.epochs, lu.epochs)):
            assert np.abs(x - y).max() <= 1e-9 * np.abs(y).max()


def test_the_iterative_law_started_from_the_screens_is_the_one_started_from_the_near_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial evaluated by BiCGSTAB with its stationary solve started from its own screened law
    (as the search does) has the gain, bias and laws of the one started from the near table's."""
    from overtake.mdp.factor import Factor

    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)  # every near evaluation iterative
    monkeypatch.setattr(observation_exact, "LOW_RANK", -1)
    monkeypatch.setattr(observation_exact, "REFRESH_ITERATIONS", 10**9)  # the second as well
    starts: list[FloatArray] = []
    iterate = Factor.iterate

    def spy(self, A, B, X0, **kw):  # type: ignore[no-untyped-def]
        if kw.get("trans"):
            starts.append(X0[:, 0].copy())
        return iterate(self, A, B, X0, **kw)

    monkeypatch.setattr(Factor, "iterate", spy)
    osp = _case2(10)
    A = starting_tables(osp, ["pi(2)"], False, {})["pi(2)"]
    ev = osp.evaluate(A)
    B = osp.propose(A, ev).actions  # the search's first trial: every class's proposed action
    assert np.any(B != A)
    _, law = osp.stationary_gain(B, start=ev.post)
    plain, screened = osp.evaluate(B, near=ev), osp.evaluate(B, near=ev, law=law)
    assert not plain.refactored and not screened.refactored  # both iterative
    assert len(starts) == 2 and np.allclose(starts[1], law[1:] / law[0], rtol=0, atol=0)
    assert not np.allclose(starts[0], starts[1])  # the near table's law is another start
    assert screened.gain == pytest.approx(plain.gain, rel=1e-10)
    for x, y in ((screened.bias, plain.bias), (screened.post, plain.post), (screened.epochs, plain.epochs)):
        assert np.abs(x - y).max() <= 1e-9 * np.abs(y).max()


def test_screened_search_takes_the_steps_of_the_full_one(monkeypatch: pytest.MonkeyPatch) -> None:
    osp = _case2(8)
    start = starting_tables(osp, ["pi(2)"], False, {})["pi(2)"]
    full_evals: list[int] = []
    evaluate = ObservationSpace.evaluate

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        full_evals.append(1)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(ObservationSpace, "evaluate", counted)
    screened = improve(osp, start, start="pi(2)")
    n_screened = len(full_evals)
    monkeypatch.setattr(observed_improve, "SCREEN_MARGIN", np.inf)  # no screen: every trial evaluated in full
    full_evals.clear()
    full = improve(osp, start, start="pi(2)")
    assert screened.steps >= 3  # it moved
    assert np.array_equal(screened.actions, full.actions)
    assert [h.get("accepted") for h in screened.history] == [h.get("accepted") for h in full.history]
    assert screened.evaluation.gain == pytest.approx(full.evaluation.gain, rel=1e-12)
    assert n_screened < len(full_evals)  # some trials were rejected on their stationary gain alone


def test_observed_chain_asks_the_rule_once_per_observation() -> None:
    osp = _case2(8)
    table = starting_tables(osp, ["pi(2)"], False, {})["pi(2)"]
    pol = osp.policy(table)
    asked: list[np.ndarray] = []

    def rule(obs: np.ndarray) -> np.ndarray:
        asked.append(obs)
        return pol.actions(obs)

    m = evaluate_observed(osp.model, osp.layout, rule, max_requests=8)
    assert all(np.unique(o, axis=0).shape[0] == o.shape[0] for o in asked)
    assert m.mean_response_time == pytest.approx(osp.evaluate(table).metrics.mean_response_time, rel=1e-9)


def test_table1_case1_blind_optimum_is_no_worse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The E[W] the search found when it evaluated every trial in full, factored every starting
    table and asked the rule at every transition (4.2499864767051925 on this case) is matched."""
    sc, model = load_scenario(ROOT / "examples" / "table1" / "case01.yaml")
    opt = solve_observed(model, tol=sc.tolerance)
    assert opt.metrics.mean_response_time <= 4.2499864767051925 * (1 + 1e-9)
    monkeypatch.setattr(observed_improve, "SCREEN_MARGIN", np.inf)
    assert solve_observed(model, tol=sc.tolerance).metrics.mean_response_time == pytest.approx(
        opt.metrics.mean_response_time, rel=1e-9)


def test_incremental_decision_matrix_equals_a_rebuild() -> None:
    """A trial's decision matrix, rebuilt only in the rows of its changed classes, is the one built
    from scratch (and so is its transition), whatever table came before it."""
    osp = _case2(10)
    tables = starting_tables(osp, ["pi(1)", "pi(2)", "pi(inf)"], True, {})
    rng = np.random.default_rng(7)
    seq = list(tables.values())
    for _ in range(6):  # single-class and many-class changes of the tables above
        A = seq[int(rng.integers(len(seq)))].copy()
        other = seq[int(rng.integers(len(seq)))]
        sel = rng.choice(osp.n_classes, size=int(rng.integers(1, osp.n_classes)), replace=False)
        A[sel] = other[sel]
        seq.append(A)
    for A in seq:
        R = osp.decision_matrix(A)
        P = osp.transition(A)
        fresh = ObservationSpace(osp.model, osp.space.trunc, osp.layout)
        assert abs(R - fresh.decision_matrix(A)).max() <= 1e-12
        assert abs(P - fresh.transition(A)).max() <= 1e-12
        assert np.allclose(np.asarray(R.sum(axis=1)).ravel(), 1.0, atol=1e-12)


def test_a_trial_that_evaluates_worse_is_never_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search moves only on the full evaluation's gain: when every trial's full evaluation
    reports a gain above the current one (its screen passes), no step is taken."""
    import dataclasses

    osp = _case2(8)
    start = starting_tables(osp, ["pi(2)"], False, {})["pi(2)"]
    assert improve(osp, start, start="pi(2)").steps >= 3  # honest evaluations move it
    evaluate = ObservationSpace.evaluate

    def worse(self, actions, *, near=None, complete=False, law=None):  # type: ignore[no-untyped-def]
        ev = evaluate(self, actions, near=near, complete=complete, law=law)
        return ev if near is None else dataclasses.replace(ev, gain=ev.gain + 1.0)

    monkeypatch.setattr(ObservationSpace, "evaluate", worse)
    monkeypatch.setattr(observed_improve, "SCREEN_MARGIN", np.inf)
    imp = improve(osp, start, start="pi(2)")
    assert imp.steps == 0
    assert np.array_equal(imp.actions, osp.repair(start))
