"""The state budget (mdp/budget.py): estimates from the shape agree with the solver's own, and
the auto-truncation ladder stops at the budget instead of building past it."""

from __future__ import annotations

import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.fitting import families
from overtake.mdp import solve as solve_optimal
from overtake.mdp.budget import StateBudgetError, check_budget, max_uniform_order, shape_states
from overtake.mdp.errors import TruncationError
from overtake.mdp.model import Stage
from overtake.mdp.optimum import auto_start, estimate_states
from overtake.mdp.statespace import count_states


def _erlang_stage(name: str, k: int) -> Stage:
    ph = families.erlang(k, float(k))
    return Stage(name, ph.alpha, ph.T)


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("order", [1, 2, 3])
def test_shape_estimate_is_the_solvers_estimate(order: int, cores: int) -> None:
    model = tandem(0.6, _erlang_stage("a", order), _erlang_stage("b", order), cores=cores)
    assert shape_states(2, order, cores) == estimate_states(model)
    assert shape_states(2, order, cores, "start") == estimate_states(model, phase_info="start")


def test_the_default_budget_affords_order_3_on_two_stages_and_not_4() -> None:
    assert max_uniform_order(2, 1, 4_000_000) == 3
    assert max_uniform_order(2, 2, 4_000_000) == 3
    assert max_uniform_order(2, 1, 1_000) == 0


def test_check_budget_names_estimate_budget_and_fix() -> None:
    model = tandem(0.6, _erlang_stage("a", 5), _erlang_stage("b", 5))
    with pytest.raises(StateBudgetError) as exc:
        check_budget(model, max_states=4_000_000)
    msg = str(exc.value)
    assert f"{estimate_states(model):,} states" in msg and "--max-states 4,000,000" in msg
    assert "--order 3 or fewer" in msg and "\n" not in msg
    small = tandem(0.6, _erlang_stage("a", 2), _erlang_stage("b", 2))
    assert check_budget(small, max_states=4_000_000) == estimate_states(small)


def test_ladder_stops_at_the_budget_and_says_so() -> None:
    model = tandem(0.6, exp_stage("a", 1.0), h2_stage("b", 0.91, 0.55, 5.45))
    start = auto_start(model)
    budget = count_states(model, start)  # the first solve fits; one more thread or cap does not
    said: list[str] = []
    with pytest.raises(TruncationError, match=r"over --max-states"):
        solve_optimal(model, max_states=budget, progress=said.append)
    assert any("not probed" in s and "--max-states" in s for s in said)
