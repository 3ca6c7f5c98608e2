"""The proposal's walk over action vectors (observation_proposal._plan), made once per space and
replayed for every bias: its weighted Q̄ per class and action agree with a brute-force product of
the spawn operators over every feasible action vector, and a plan missing a step is caught."""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp.observation import ObservationSpace
from overtake.mdp.observed_tables import starting_tables
from overtake.mdp.routes import RouteSplit
from overtake.mdp.statespace import Layout, Truncation

MODEL = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2


def _brute(osp: ObservationSpace, actions: np.ndarray, bias: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least weighted Q̄ per class over its feasible action vectors, and the current action's."""
    fz, ops, class_of = osp.feasibility, osp.decisions.spawn_operators, osp.decisions.class_of
    best = np.full(osp.n_classes, np.inf)
    cur = np.full(osp.n_classes, np.nan)
    for a in product(*(range(int(m) + 1) for m in fz.waiting.max(axis=0))):
        ok = fz.feasible(np.array(a))
        if not ok.any():
            continue
        v = bias
        for q, t in enumerate(a):
            for _ in range(t):
                v = ops[q] @ v
        s = np.bincount(class_of, weights=weight * v, minlength=osp.n_classes)
        best = np.where(ok, np.minimum(best, s), best)
        mine = np.all(actions == np.array(a), axis=1)
        cur[mine] = s[mine]
    return best, cur


@pytest.mark.parametrize("layout", ["none", "route"])
def test_the_walk_visits_every_feasible_action_vector(layout: str) -> None:
    lay = Layout.build(MODEL, "none")
    if layout == "route":  # two routes on the H2 stage, averaging to its branch probability
        a = MODEL.stages[-1].alpha[0]
        p = (a - 0.1) / (0.99 - 0.1)
        lay = RouteSplit.build(MODEL, [None, [("light", p, [0.99, 0.01]), ("heavy", 1 - p, [0.1, 0.9])]]).layout(MODEL)
    osp = ObservationSpace(MODEL, Truncation(5), lay)
    A = next(iter(starting_tables(osp, ["pi(2)"], False, {}).values()))
    ev = osp.evaluate(A)
    prop = osp.propose(A, ev)
    plan = osp.feasibility.walk_plan
    assert plan is not None
    mu = ev.epochs
    class_of = osp.decisions.class_of
    size = np.bincount(class_of, minlength=osp.n_classes)
    weight = np.where(prop.mass[class_of] > 0, mu, 1.0 / size[class_of])
    best, cur = _brute(osp, A, ev.bias, weight)
    tol = 1e-10 * (np.abs(ev.bias).max() + 1.0) * np.bincount(class_of, weights=weight, minlength=osp.n_classes)
    moved = ~(cur <= best + tol)
    np.testing.assert_allclose(prop.advantage[moved], (best - cur)[moved], rtol=1e-12, atol=0.0)
    assert np.all(prop.advantage[~moved] == 0.0) and np.any(moved)
    again = osp.propose(A, ev)
    assert osp.feasibility.walk_plan is plan  # made once, replayed
    np.testing.assert_array_equal(again.actions, prop.actions)
    np.testing.assert_array_equal(again.advantage, prop.advantage)
    # a plan without the action vector some class moves to is caught by the brute force above
    # (one no class takes now: the walk must still find every class's current action)
    j = next(int(j) for j in np.flatnonzero(moved) if not np.any(np.all(A == prop.actions[j], axis=1)))
    osp.feasibility.walk_plan = [st for st in plan if st[2] is None or np.any(st[2][2] != prop.actions[j])]
    short = osp.propose(A, ev)
    assert short.advantage[j] != pytest.approx((best - cur)[j], rel=1e-12, abs=0.0)
