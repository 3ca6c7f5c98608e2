"""Work handed to a second process by the solve (``solve_mdp``'s ``beside``) and by the age
prediction (its runs in pairs) gives the answer of one process, bit for bit: the same policy,
metrics and trace, the same pooled figures and run count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.api.beside import start
from overtake.mdp import Truncation, solve
from overtake.mdp.model import TandemModel
from overtake.mdp.optimum import solve_mdp
from overtake.mdp.priority_prediction import predict_priority


class _Late:
    """The call made only when its result is asked for: after the caller's own work."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._call = (fn, args)
        self.cancelled = False

    def result(self) -> Any:
        fn, args = self._call
        return fn(*args)

    def cancel(self) -> None:
        self.cancelled = True


class _Eager(_Late):
    """The call made at once: before the caller's own work."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        super().__init__(fn, *args)
        self._value = fn(*args)

    def result(self) -> Any:
        return self._value


@pytest.fixture(scope="module")
def model() -> TandemModel:
    # chains of a few thousand states: the stationary laws the ladder records start later solves
    return tandem(0.6, exp_stage("a", 1.0), h2_stage("b", 0.91, 0.55, 5.45))


@pytest.fixture(scope="module")
def alone(model: TandemModel) -> tuple[Any, list[str]]:
    lines: list[str] = []
    return solve_mdp(model, tol=1e-3, progress=lines.append), lines


@pytest.mark.parametrize("beside", [_Late, _Eager, start], ids=["late", "eager", "forked"])
def test_the_ladder_beside_the_next_solve_gives_the_same_optimum(model, alone, beside) -> None:  # type: ignore[no-untyped-def]
    plain, plain_lines = alone
    lines: list[str] = []
    other = solve_mdp(model, tol=1e-3, progress=lines.append, beside=beside)
    assert any(e.get("check") == "evaluation cap" for e in plain.trace)  # the ladder ran
    assert max(e["states"] for e in plain.trace if "states" in e) > 1_500  # laws start later solves
    assert other.trace == plain.trace  # the same entries in the same order, every float equal
    assert other.metrics == plain.metrics and other.truncation == plain.truncation
    assert np.array_equal(other.policy.spawn, plain.policy.spawn) and other.policy.digest() == plain.policy.digest()
    assert sorted(lines) == sorted(plain_lines)  # every progress line, the ladder's replayed here


def test_a_fixed_truncation_needs_no_worker(model) -> None:  # type: ignore[no-untyped-def]
    def refuse(*_: Any) -> None:
        raise AssertionError("a fixed truncation is solved once: nothing to run beside it")

    opt = solve(model, truncation=Truncation(8, 3), beside=refuse)
    assert opt.metrics == solve(model, truncation=Truncation(8, 3)).metrics


@pytest.mark.parametrize("rel_ci", [0.0, 0.9, "two"])
def test_the_runs_in_pairs_pool_as_one_after_another(model, rel_ci) -> None:  # type: ignore[no-untyped-def]
    """Runs in pairs stop where runs one by one stop (an odd count included: the pair's second run
    dropped) with the same pooled mean and half-width."""
    pol = solve(model, truncation=Truncation(8, 3)).policy
    n = 10_000
    if rel_ci == "two":  # between one run's relative half-width and two runs': stops after the second
        one = predict_priority(model, pol, "age", requests=n, seeds=1)
        both = predict_priority(model, pol, "age", requests=n, seeds=2, rel_ci=0.0)
        assert both.ci95 / both.mean_response_time < one.ci95 / one.mean_response_time
        rel_ci = (both.ci95 / both.mean_response_time) * (1 + 1e-9)
    seq = predict_priority(model, pol, "age", requests=n, seeds=5, rel_ci=rel_ci)
    made: list[_Late] = []

    def late(fn: Callable[..., Any], *args: Any) -> _Late:
        made.append(_Late(fn, *args))
        return made[-1]

    for beside in (late, start):
        par = predict_priority(model, pol, "age", requests=n, seeds=5, rel_ci=rel_ci, beside=beside)
        assert (par.mean_response_time, par.ci95, par.seeds) == (seq.mean_response_time, seq.ci95, seq.seeds)
        assert (par.passthrough, par.passthrough_ci95, par.passthrough_seeds) == (
            seq.passthrough, seq.passthrough_ci95, seq.passthrough_seeds)
    # an odd number of runs leaves the last pair's second unused: it is dropped, not waited for
    assert any(p.cancelled for p in made) == (seq.seeds % 2 == 1 and seq.seeds < 5)


def test_the_candidate_is_the_first_re_solved_policy_and_changes_nothing(model, alone) -> None:  # type: ignore[no-untyped-def]
    plain, _ = alone
    seen: list[Any] = []
    opt = solve_mdp(model, tol=1e-3, candidate=lambda pol, res: seen.append((pol, res)))
    assert len(seen) == 1
    pol, res = seen[0]
    first = next(e for e in plain.trace if e.get("check") == "solve cap")
    assert pol.max_requests == first["max_requests"] and res.space.cap == first["max_requests"]
    assert opt.trace == plain.trace and opt.metrics == plain.metrics
    # the answer is that object exactly when the first re-solve was kept and the search stopped there
    kept = sum(e.get("check") == "solve cap" for e in plain.trace) == 1 and \
        plain.truncation.max_requests == first["max_requests"]
    assert (opt.policy is pol) == kept



def _observed(model: TandemModel, **kw: Any) -> Any:
    from overtake.mdp.observed import solve_observed

    # a small first solve cap: three searches on it, two on the next, ladders to tens of thousands of states
    return solve_observed(model, tol=1e-3, start=5, **kw)


@pytest.fixture(scope="module")
def observed_model() -> TandemModel:
    return tandem(0.5, exp_stage("a", 1.0), h2_stage("b", 0.91, 0.55, 5.45))


@pytest.fixture(scope="module")
def observed_alone(observed_model: TandemModel) -> tuple[Any, list[str]]:
    lines: list[str] = []
    return _observed(observed_model, progress=lines.append), lines


@pytest.mark.parametrize("beside", [_Late, _Eager, start], ids=["late", "eager", "forked"])
def test_observed_work_beside_gives_the_same_table(observed_model, observed_alone, beside) -> None:  # type: ignore[no-untyped-def]
    """An observation policy's first ladder and the later half of each cap's searches in another
    process: the same table, metrics, trace and search history as in one process (the ladder's
    laws warm-start the next table's, the searches each start from the same solver state)."""
    plain, plain_lines = observed_alone
    lines: list[str] = []
    other = _observed(observed_model, progress=lines.append, beside=beside)
    assert sum(e.get("check") == "evaluation cap" for e in plain.trace) >= 2  # the ladder ran
    assert max(e["states"] for e in plain.trace if "states" in e) > 10_000  # laws start later solves
    assert any(e.get("check") == "solve cap" for e in plain.trace)  # and the next cap was searched
    assert [len(e["improved_gains"]) for e in plain.trace if "improved_gains" in e] == [3, 2]
    assert other.trace == plain.trace and other.solve.history == plain.solve.history
    assert other.metrics == plain.metrics and other.source == plain.source
    assert other.policy.digest() == plain.policy.digest()
    assert sorted(lines) == sorted(plain_lines)


def test_a_search_a_dead_worker_took_runs_here(observed_model, observed_alone) -> None:  # type: ignore[no-untyped-def]
    """A worker that takes a search and dies before answering (its handle reruns the call here,
    when no search is left to take) loses nothing: the search it took runs here."""
    plain, _ = observed_alone
    took: list[int | None] = []

    class _Lost(_Late):
        def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
            super().__init__(fn, *args)
            if fn.__name__ == "search_elsewhere":
                took.append(args[2].take())  # the worker's first ticket, then it dies

    other = _observed(observed_model, beside=_Lost)
    assert took == [0, 0]  # one search lost on each solve cap
    assert other.trace == plain.trace and other.solve.history == plain.solve.history
    assert other.policy.digest() == plain.policy.digest()


def test_an_observation_that_hides_no_phase_starts_no_worker() -> None:
    """Exponential stages: the ``none`` observation is the whole state (one state per class), its
    searches and ladders are too short to pay for a worker, so none is started; the answer is the
    one-process answer. With a hidden phase (the module's model) the worker is still used."""
    from overtake.mdp.observation import ObservationSpace
    from overtake.mdp.observed_beside import worth_a_worker
    from overtake.mdp.statespace import Layout

    model = tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 1.0))

    def refuse(*_: Any) -> None:
        raise AssertionError("no phase hidden: nothing to run beside the solve")

    other = _observed(model, beside=refuse)
    plain = _observed(model)
    assert any(e.get("check") == "evaluation cap" for e in plain.trace)  # a ladder ran, here
    # so did the searches (a start equal to an earlier-ranked one is searched once)
    assert [len(e["improved_gains"]) for e in plain.trace if "improved_gains" in e] == [2, 1]
    assert other.trace == plain.trace and other.policy.digest() == plain.policy.digest()
    osp = ObservationSpace(model, Truncation(5), Layout.build(model, "none"))
    assert osp.size == osp.n_classes and not worth_a_worker(osp)
    hidden = tandem(0.5, exp_stage("a", 1.0), h2_stage("b", 0.91, 0.55, 5.45))
    osp = ObservationSpace(hidden, Truncation(5), Layout.build(hidden, "none"))
    assert osp.size > osp.n_classes and worth_a_worker(osp)


def test_the_baselines_run_beside_with_the_same_candidates(observed_model, observed_alone) -> None:  # type: ignore[no-untyped-def]
    """The baselines the answer is checked against are evaluated in a worker while the next
    table's ladder runs here: the same candidates and evaluations as in one process."""
    plain, plain_lines = observed_alone
    calls: list[str] = []

    class _Counted(_Late):
        def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
            calls.append(fn.__name__)
            super().__init__(fn, *args)

    lines: list[str] = []
    other = _observed(observed_model, progress=lines.append, beside=_Counted)
    assert calls.count("_baselines") == 1
    assert other.candidates == plain.candidates and set(other.baselines) == set(plain.baselines) == set(
        plain.candidates) - {"improved"}
    assert all(other.baselines[k].metrics == plain.baselines[k].metrics for k in plain.baselines)
    assert sorted(lines) == sorted(plain_lines) and any(line.startswith("pi(1):") for line in lines)


def test_the_baselines_worker_adds_none_beside_the_others() -> None:
    """The baselines' worker is waited for before another worker starts (a later cap's searches),
    so that it never runs beside another worker."""
    under_way: list[str] = []
    clashes: list[str] = []

    class _Tracked(_Eager):
        def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
            if "_baselines" in under_way:
                clashes.append(fn.__name__)
            under_way.append(fn.__name__)
            self._name = fn.__name__
            super().__init__(fn, *args)

        def result(self) -> Any:
            if self._name in under_way:
                under_way.remove(self._name)
            return super().result()

    from overtake.mdp.observed import solve_observed

    # a tight tolerance: a third solve cap is searched after the baselines' worker has started
    light = tandem(0.2, exp_stage("a", 1.0), h2_stage("b", 0.91, 0.55, 5.45))
    opt = solve_observed(light, tol=1e-4, start=3, beside=_Tracked)
    assert sum("improved_gains" in e for e in opt.trace) >= 3 and "_baselines" not in under_way
    assert clashes == []
