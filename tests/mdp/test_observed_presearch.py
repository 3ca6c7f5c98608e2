"""A large first solve cap is searched from a smaller cap's improved table (the pre-search).

* the smaller cap is the largest whose chain has at most a share of the first cap's states, and
  its entry is marked in the trace;
* the first cap's search starts from that table (lifted by the policy's projection), and exact
  acceptance keeps its answer at or below that start's exact gain;
* none below the state threshold, nor without ``presearch`` (the default).
"""

from __future__ import annotations

import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import observed
from overtake.mdp.observed import solve_observed
from overtake.mdp.routes import RouteSplit
from overtake.mdp.statespace import Truncation, count_states


def _model_and_split():  # type: ignore[no-untyped-def]
    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))
    a = model.stages[-1].alpha[0]
    p = (a - 0.1) / (0.99 - 0.1)
    split = RouteSplit.build(model, [None, [("light", p, [0.99, 0.01]), ("heavy", 1 - p, [0.1, 0.9])]])
    return model, split


def test_a_large_first_cap_starts_from_a_smaller_caps_table(monkeypatch: pytest.MonkeyPatch) -> None:
    model, split = _model_and_split()
    layout = split.layout(model)
    first = 5
    size = count_states(model, Truncation(first, first), layout)
    monkeypatch.setattr(observed, "PRESEARCH_STATES", size)  # this cap is "large"
    opt = solve_observed(model, phase_info="route", routes=split, start=first, tol=1e-2, presearch=True)
    solves = [t for t in opt.trace if "improved_gains" in t]
    pre, at = solves[0], solves[1]
    want = max(c for c in range(2, first) if observed.PRESEARCH_SHARE * count_states(model, Truncation(c, c), layout) <= size)
    assert pre.get("presearch") is True and pre["max_requests"] == want
    assert at["max_requests"] == first and "presearch" not in at
    assert list(at["improved_gains"]) == ["previous cap"]  # the starts were searched on the smaller cap
    # every accepted step lowers the exact gain: the search ends at or below its start
    assert at["improved_gains"]["previous cap"] <= at["starting_gains"]["previous cap"] * (1 + 1e-12)
    assert at["gain"] == min(at["improved_gains"].values())
    assert sum(1 for t in opt.trace if t.get("presearch")) == 1  # only the first cap is pre-searched


@pytest.mark.parametrize("presearch", [False, True])
def test_no_presearch_unless_asked_and_large(monkeypatch: pytest.MonkeyPatch, presearch: bool) -> None:
    model, split = _model_and_split()
    size = count_states(model, Truncation(5, 5), split.layout(model))
    # asked for, but below the threshold; or the threshold met, but not asked for
    monkeypatch.setattr(observed, "PRESEARCH_STATES", size + 1 if presearch else size)
    opt = solve_observed(model, phase_info="route", routes=split, start=5, tol=1e-2, presearch=presearch)
    solves = [t for t in opt.trace if "improved_gains" in t]
    assert solves[0]["max_requests"] == 5 and not any(t.get("presearch") for t in opt.trace)
    assert len(solves[0]["improved_gains"]) > 1  # the first cap searched from several starts
