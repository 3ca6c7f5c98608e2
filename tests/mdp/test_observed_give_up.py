"""Iterative solves given up across a space's independent searches (observation_exact.ExactSolver):
once one search has missed ITER_GIVE_UP in a row, a search started afresh from the same solver
state factors at once, in this process and in a forked one, with the answers of a space that
factors every table. The misses are made by a budget of one BiCGSTAB iteration."""

from __future__ import annotations

import os

import numpy as np
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import observation_exact
from overtake.mdp.observation import ObservationSpace
from overtake.mdp.observed_tables import starting_tables
from overtake.mdp.statespace import Layout, Truncation

MODEL = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2
TR = Truncation(7)


def search(osp: ObservationSpace, tables: list[np.ndarray]) -> list[float]:
    """A search's trials, each near the last: their gains."""
    ev = osp.evaluate(tables[0])
    gains = []
    for T in tables[1:]:
        ev = osp.evaluate(T, near=ev)
        gains.append(ev.gain)
    return gains


def test_a_search_after_one_that_gave_up_factors_at_once(starved: list[bool]) -> None:
    layout = Layout.build(MODEL, "none")
    osp, ref = ObservationSpace(MODEL, TR, layout), ObservationSpace(MODEL, TR, layout)
    start = starting_tables(osp, ["pi(inf)", "pi(2)"], False, {})
    A, B = start["pi(inf)"], start["pi(2)"]
    state = osp.exact.state()
    first = search(osp, [A, B, A, B, A])
    assert starved == [False] * observation_exact.ITER_GIVE_UP and osp.exact.given_up
    starved.clear()
    osp.exact.restore(state)  # the next search from the same state: its own count starts at 0 ...
    assert osp.exact.iter_failed == 0
    second = search(osp, [B, A, B])
    assert starved == []  # ... but no iterative solve is tried
    want = search(ref, [A, B, A, B, A])
    np.testing.assert_allclose(first, want, rtol=1e-9)
    np.testing.assert_allclose(second, want[1:3], rtol=1e-9)


def test_a_forked_searchs_giving_up_is_seen_here(starved: list[bool]) -> None:
    layout = Layout.build(MODEL, "none")
    osp = ObservationSpace(MODEL, TR, layout)
    start = starting_tables(osp, ["pi(inf)", "pi(2)"], False, {})
    A, B = start["pi(inf)"], start["pi(2)"]
    assert not osp.exact.given_up
    pid = os.fork()
    if pid == 0:  # the worker: a search that gives up
        code = 1
        try:
            search(osp, [A, B, A, B, A])
            code = 0 if osp.exact.given_up else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert osp.exact.given_up and starved == []  # nothing tried here
    search(osp, [B, A])
    assert starved == []
