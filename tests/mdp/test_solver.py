"""mdp.solve, the solver's one entry: its doctest, its errors, and that it is the solvers behind it."""

from __future__ import annotations

import doctest

import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

import overtake.mdp as mdp
from overtake.mdp import solver
from overtake.mdp.errors import ModelError
from overtake.mdp.observed import ObservedOptimum, solve_observed
from overtake.mdp.optimum import Optimum, solve_mdp
from overtake.mdp.priority_classes import ClassChoice, choose_classes
from overtake.mdp.statespace import Truncation

TWO_H2 = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 0.55, 5.45))


def test_the_docstring_example_runs() -> None:
    res = doctest.testmod(solver, optionflags=doctest.ELLIPSIS)
    assert res.attempted >= 5 and res.failed == 0


@pytest.mark.parametrize("phase_info", ["full", "start"])
def test_state_policies_are_the_mdp_optimum(phase_info: str) -> None:
    tr = Truncation(8, 3)
    got = mdp.solve(TWO_H2, phase_info=phase_info, truncation=tr, method="rvi")
    want = solve_mdp(TWO_H2, phase_info=phase_info, truncation=tr, method="rvi")  # type: ignore[arg-type]
    assert isinstance(got, Optimum)
    assert got.metrics == want.metrics and (got.policy.spawn == want.policy.spawn).all()
    assert got.solve.method == "rvi"


def test_counts_only_is_the_observation_policy() -> None:
    tr = Truncation(6, 2)
    got = mdp.solve(TWO_H2, phase_info="none", truncation=tr, method="pi")  # the method plays no part
    want = solve_observed(TWO_H2, phase_info="none", truncation=tr)
    assert isinstance(got, ObservedOptimum)
    assert got.metrics == want.metrics and got.source == want.source


def test_cpu_classes_are_the_class_choice() -> None:
    tr = Truncation(6, 2)
    got = mdp.solve(TWO_H2, cpu_priority="class", truncation=tr)
    want = choose_classes(TWO_H2, truncation=tr)
    assert isinstance(got, ClassChoice)
    assert got.levels == want.levels and got.candidates == want.candidates


def test_options_reach_the_solver_behind() -> None:
    model = tandem(0.5, exp_stage("a", 1.0), exp_stage("b", 1.0))
    opt = mdp.solve(model, start=Truncation(6, 2), tol=1e-2)
    assert (opt.trace[0]["max_requests"], opt.trace[0]["max_threads"]) == (6, 2)
    with pytest.raises(TypeError, match="none_optimum"):
        mdp.solve(model, truncation=Truncation(4, 2), none_optimum=None)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"phase_info": "phases"}, r"phase_info: expected one of full, start, none, route, got 'phases'"),
    ({"method": "newton"}, r"method: expected one of anderson, rvi, pi, got 'newton'"),
    ({"cpu_priority": "age"}, r"cpu_priority: only 'class' changes the solve"),
    ({"cpu_priority": "class", "phase_info": "start"}, r"cpu_priority class: classes by phase need the phases"),
])
def test_bad_arguments_name_the_field(kwargs: dict[str, str], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        mdp.solve(TWO_H2, truncation=Truncation(4, 2), **kwargs)  # type: ignore[call-overload]
