"""What CPU priority does to a solved policy's E[W], for ``overtake solve --cpu-priority``.

CPU priority (:mod:`overtake.mdp.priority`) changes how the admitted threads share the CPU, so a
spawn policy's exact E[W] no longer holds; the tandem with priority levels has no exact analysis,
and the simulator (:func:`overtake.mdp.simulation.simulate`, checked against the M/G/1
multilevel-PS formulas of :mod:`overtake.mdp.mlps`) gives the figures:

* ``age`` — demotion by attained CPU at the stage, one threshold for all stages (a server-wide
  ``OvertakePrioLevels``), chosen in the visit model
  (:func:`~overtake.mdp.thresholds.choose_tandem_thresholds`: the exact multilevel-PS analysis,
  no simulation); predicted for the policy and for π(∞) (Apache's default with CPU priority
  alone), each simulated only until its confidence interval is :data:`DEFAULT_REL_CI` of it.
  A stage with a lock (:mod:`overtake.mdp.lock`) is exempt: the module never demotes a request
  that may hold a lock others wait for (the stages file's ``cpu_exempt``), so its holders run at
  level 0, one at a time at lock 1, beside the other stages' young requests
  (:func:`~overtake.mdp.priority.exempt_stages`). The simulator runs the lock and the levels
  together; the policy file records the exempt stages;
* ``class`` — known-phase short-first classes (:func:`~overtake.mdp.priority.class_priority`),
  which need the phases: policies solved for ``full`` information only. Where no phase moves
  (hyperexponential stages) the chain with the classes is exact (:mod:`overtake.mdp.priority_classes`)
  and :func:`predict_priority` evaluates it exactly.

The low level's weight is SCHED_IDLE's by the kernel's tables (3/1024). The sidecar's
``classifier.mode: auto`` weighs these predictions against the policies' exact ones
(:mod:`overtake.controller.sidecar.auto`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .errors import ModelError
from .model import TandemModel
from .policy import Policy
from .priority import DEFAULT_LOW_WEIGHT, CpuPriority, age_priority, class_priority, exempt_stages
from .priority_classes import class_model, model_levels, phases_stay
from .rule_evaluation import evaluate_rule
from .simulation import simulate

if TYPE_CHECKING:
    from .thresholds import TandemChoice

__all__ = ["PRIORITY_KINDS", "AgePassthrough", "PriorityPrediction", "age_passthrough", "predict_priority"]

PRIORITY_KINDS = ("age", "class")
#: ``beside(fn, *args)`` runs ``fn(*args)`` in another process; ``.result()`` of what it returns waits
#: for it, ``.cancel()`` drops it (:func:`overtake.api.beside.start`)
Beside = Callable[..., Any]

#: A prediction's 95 % half-width as a fraction of it: the simulation stops there. The choices it
#: informs (a policy with the priority against π(∞) with it, and against the exact E[W] without)
#: differ by several per cent where the priority matters at all.
DEFAULT_REL_CI = 0.02


@dataclass(frozen=True)
class PriorityPrediction:
    """E[W] (model time units) of a policy with CPU priority, and of π(∞) with it (age): simulated
    (``requests`` per seed, ``seeds`` runs pooled; π(∞)'s ``passthrough_seeds``), or exact
    (``requests`` 0, ``ci95`` 0).
    ``visit_model``: age only, the visit model's E[W] of π(∞) at the chosen thresholds (strict
    priority), the figure the thresholds were chosen on."""

    kind: str
    priority: CpuPriority
    mean_response_time: float
    ci95: float
    passthrough: float | None
    passthrough_ci95: float | None
    requests: int
    seeds: int = 0
    visit_model: float | None = None
    #: names of the stages whose requests are never demoted (age: the stages with a lock)
    exempt: tuple[str, ...] = ()
    passthrough_seeds: int = 0

    def to_meta(self) -> dict[str, Any]:
        """The policy file's ``meta["cpu_priority"][kind]`` entry (JSON: a threshold never crossed is null)."""
        d = self.priority.to_dict()
        d["thresholds"] = [[x if math.isfinite(x) else None for x in row] for row in d["thresholds"]]
        return {"kind": self.kind, "exact": self.requests == 0,
                "mean_response_time": self.mean_response_time, "ci95": self.ci95,
                "passthrough": self.passthrough, "passthrough_ci95": self.passthrough_ci95,
                "requests": self.requests, "seeds": self.seeds, "passthrough_seeds": self.passthrough_seeds,
                "visit_model": self.visit_model,
                "exempt_stages": list(self.exempt), **d}


def _run(model: TandemModel, policy: Policy | str, priority: CpuPriority, requests: int,
         seed: int) -> tuple[float, float]:
    r = simulate(model, policy, requests=requests, seed=seed, cpu_priority=priority)
    return r.mean_response_time, r.ci95


def _pooled(model: TandemModel, policy: Policy | str, priority: CpuPriority, requests: int, seeds: int,
            seed: int, rel_ci: float, beside: Beside | None = None) -> tuple[float, float, int]:
    """Independent runs of ``requests`` each (seeds ``seed``, ``seed + 1``, …), pooled, until the
    pooled 95 % half-width is at most ``rel_ci`` of the mean or ``seeds`` runs are done (``rel_ci``
    0: all of them). Returns the mean, its half-width and the runs used.

    A run's CI is by batch means, so a single run already carries one; the runs are independent,
    so the pooled half-width is the root sum of squares over the number of runs.

    ``beside(fn, *args)`` (:func:`overtake.api.beside.start`): each run's successor runs in another
    process meanwhile; the stopping test still takes the runs one by one in seed order, so the
    answer is the one without it (a successor past the stop is dropped).
    """
    runs: list[tuple[float, float]] = []

    def pooled() -> tuple[float, float, int]:
        n = len(runs)
        return sum(m for m, _ in runs) / n, math.sqrt(sum(h * h for _, h in runs)) / n, n

    def enough(run: tuple[float, float]) -> bool:
        runs.append(run)
        mean, half, _ = pooled()
        return half <= rel_ci * mean

    while len(runs) < seeds:
        k = len(runs)
        ahead = beside(_run, model, policy, priority, requests, seed + k + 1) if (
            beside is not None and k + 1 < seeds) else None
        if enough(_run(model, policy, priority, requests, seed + k)):
            if ahead is not None:
                ahead.cancel()
            break
        if ahead is not None and enough(ahead.result()):
            break
    return pooled()


@dataclass(frozen=True)
class AgePassthrough:
    """The part of an age prediction that does not depend on the policy: the thresholds (visit
    model) and π(∞)'s simulated E[W] with them, and the simulation settings it was made with."""

    choice: TandemChoice
    mean: float
    ci95: float
    runs: int
    settings: tuple[int, int, int, float]  # requests, seeds, seed, rel_ci


def age_passthrough(model: TandemModel, *, requests: int = 100_000, seeds: int = 6, seed: int = 0,
                    rel_ci: float = DEFAULT_REL_CI) -> AgePassthrough:
    """The age thresholds (:func:`~overtake.mdp.thresholds.choose_tandem_thresholds`, common to the
    stages, the locked stages exempt) and π(∞) simulated with them as :func:`predict_priority` does.

    Needs no policy: ``overtake solve`` runs it on a second core while the policy is solved.
    """
    # the exact analysis (scipy's FFT and optimiser) imported here: ``overtake solve`` runs this in
    # its worker, so the process that solves the policy does not pay for the imports
    from .thresholds import choose_tandem_thresholds

    _check_settings(requests, seeds, rel_ci)
    choice = choose_tandem_thresholds(model, common=True)
    priority = age_priority(model, [choice.priority.thresholds[0][0]], weights=[1.0, DEFAULT_LOW_WEIGHT])
    ps, ps_ci, runs = _pooled(model, "pi(inf)", exempt_stages(priority, choice.exempt), requests, seeds, seed, rel_ci)
    return AgePassthrough(choice, ps, ps_ci, runs, (requests, seeds, seed, rel_ci))


def _check_settings(requests: int, seeds: int, rel_ci: float) -> None:
    if requests < 10_000 or seeds < 1:
        raise ModelError(f"cpu priority prediction: requests >= 10000 and seeds >= 1, got {requests}, {seeds}")
    if not 0.0 <= rel_ci < 1.0:
        raise ModelError(f"cpu priority prediction: rel_ci is a fraction of E[W] in [0, 1), got {rel_ci}")


def predict_priority(model: TandemModel, policy: Policy, kind: str, *, requests: int = 100_000, seeds: int = 6,
                     seed: int = 0, rel_ci: float = DEFAULT_REL_CI,
                     passthrough: AgePassthrough | None = None, beside: Beside | None = None) -> PriorityPrediction:
    """Simulate ``policy`` (and, for ``age``, π(∞)) with CPU priority ``kind`` (module docstring).

    Each figure is simulated in runs of ``requests`` (seeds ``seed``, ``seed + 1``, …) until its
    95 % half-width is at most ``rel_ci`` of it, ``seeds`` runs at most (``rel_ci`` 0: always
    ``seeds``); the prediction records the runs the policy's figure used. ``passthrough``: the
    policy-free part of an age prediction (:func:`age_passthrough`), already computed for this
    model with these settings. ``beside``: each run's successor simulated in another process
    meanwhile (:func:`_pooled`), the same figures.

    Raises
    ------
    ModelError
        An unknown ``kind``, or ``class`` for a policy that does not see the phases.
    """
    if kind not in PRIORITY_KINDS:
        raise ModelError(f"cpu priority: expected one of {', '.join(PRIORITY_KINDS)}, got {kind!r}")
    _check_settings(requests, seeds, rel_ci)
    weights = [1.0, DEFAULT_LOW_WEIGHT]
    ps: float | None = None
    ps_ci: float | None = None
    ps_runs = 0
    visit: float | None = None
    exempt: tuple[int, ...] = ()
    if kind == "age":
        if passthrough is None:
            passthrough = age_passthrough(model, requests=requests, seeds=seeds, seed=seed, rel_ci=rel_ci)
        elif passthrough.settings != (requests, seeds, seed, rel_ci):
            raise ModelError(f"cpu priority prediction: the passthrough was simulated with (requests, seeds, seed, "
                             f"rel_ci) {passthrough.settings}, this prediction asks for {(requests, seeds, seed, rel_ci)}")
        choice = passthrough.choice
        a, visit, exempt = choice.priority.thresholds[0][0], choice.mean_response_time, choice.exempt
        priority = age_priority(model, [a], weights=weights)
        ps, ps_ci, ps_runs = passthrough.mean, passthrough.ci95, passthrough.runs
    else:
        if policy.phase_info != "full":
            raise ModelError(f"cpu priority class: short-first classes need each request's phase; this policy "
                             f"is solved for phase_info {policy.phase_info!r}: use age, or solve with --phase-info full")
        levels = model_levels(policy.model)  # solved with its classes (choose_classes), else short-first
        priority = class_priority(model, weights=weights, start_levels=levels)
        if phases_stay(model):  # exact: weighted sharing by phase
            base = replace(policy.model, weights=None) if policy.model.weights is not None else policy.model
            ev = evaluate_rule(class_model(base, levels=levels), policy.layout, policy.actions,
                               max_requests=policy.max_requests, max_threads=policy.max_threads)
            return PriorityPrediction(kind, priority, ev.mean_response_time, 0.0, None, None, 0)
    w, ci, runs = _pooled(model, policy, exempt_stages(priority, exempt), requests, seeds, seed, rel_ci, beside)
    return PriorityPrediction(kind, priority, w, ci, ps, ps_ci, requests, runs, visit,
                              tuple(model.stages[i].name for i in exempt), ps_runs)
