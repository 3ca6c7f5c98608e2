"""What the CPU-priority lever predicts for a solved policy (issue 20), for ``overtake solve --cpu-priority``.

The lever (:mod:`overtake.mdp.priority`) changes how the admitted threads share the CPU, so a
spawn policy's exact E[W] no longer holds; the tandem with priority levels has no exact analysis,
and the simulator (:func:`overtake.mdp.simulate.simulate`, checked against the M/G/1 multilevel-PS
formulas) gives the figures:

* ``age`` — demotion by attained CPU at the stage, one threshold for all stages (a server-wide
  ``OvertakePrioLevels``), chosen in the visit model
  (:func:`~overtake.mdp.priority.choose_tandem_thresholds`); predicted for the policy and for
  π(∞) (Apache's default with only the lever);
* ``class`` — known-phase short-first classes (:func:`~overtake.mdp.priority.class_priority`),
  which need the phases: policies solved for ``full`` information only. Where no phase moves to
  another (hyperexponential stages) a request's class is its current phase's, so class priority
  is weighted sharing by phase (:func:`class_model`, ``TandemModel.weights``) and the chain is
  exact: :func:`predict_lever` evaluates it exactly, and ``overtake solve --cpu-priority class``
  solves the spawn policy that is optimal with the classes in force.

The low level's weight is SCHED_IDLE's by the kernel's tables (3/1024; measured 1:332 on this
project's machine). The sidecar's ``classifier.mode: auto`` weighs these predictions against the
policies' exact ones (:mod:`overtake.controller.auto`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .errors import ModelError
from .model import TandemModel
from .policy import Policy
from .priority import (
    DEFAULT_LOW_WEIGHT,
    CpuPriority,
    age_priority,
    choose_tandem_thresholds,
    class_priority,
    short_first_levels,
)
from .simulate import simulate

__all__ = ["LEVER_KINDS", "LeverPrediction", "class_model", "phases_stay", "predict_lever"]

LEVER_KINDS = ("age", "class")


@dataclass(frozen=True)
class LeverPrediction:
    """E[W] (model time units) of a policy with the lever, and of π(∞) with it (age): simulated
    (``requests`` per seed), or exact (``requests`` 0, ``ci95`` 0)."""

    kind: str
    priority: CpuPriority
    mean_response_time: float
    ci95: float
    passthrough: float | None
    passthrough_ci95: float | None
    requests: int

    def to_meta(self) -> dict[str, Any]:
        """The policy file's ``meta["cpu_priority"][kind]`` entry (JSON: a threshold never crossed is null)."""
        d = self.priority.to_dict()
        d["thresholds"] = [[x if math.isfinite(x) else None for x in row] for row in d["thresholds"]]
        return {"kind": self.kind, "exact": self.requests == 0,
                "mean_response_time": self.mean_response_time, "ci95": self.ci95,
                "passthrough": self.passthrough, "passthrough_ci95": self.passthrough_ci95,
                "requests": self.requests, **d}


def phases_stay(model: TandemModel) -> bool:
    """True when no phase moves to another (every T diagonal: hyperexponential stages)."""
    return all(np.count_nonzero(s.T - np.diag(np.diag(s.T))) == 0 for s in model.stages)


def class_model(model: TandemModel, weight: float = DEFAULT_LOW_WEIGHT) -> TandemModel:
    """``model`` with short-first class priority as CPU weights by phase (1 for phases whose
    expected work is at most the stage's mean, ``weight`` for the others).

    Raises
    ------
    ModelError
        A phase moves to another: the module's class is the start phase's, no longer the
        current phase's, and weighted sharing by phase would be another policy.
    """
    if not phases_stay(model):
        raise ModelError("cpu priority class: exact only for stages whose phases do not move (hyperexponential "
                         "fits, --structure hyperexp); use the simulated prediction of predict_lever")
    w = tuple(1.0 if lv == 0 else float(weight) for s in model.stages for lv in short_first_levels(s))
    return replace(model, weights=w)


def _pooled(model: TandemModel, policy: Policy | str, lever: CpuPriority, requests: int, seeds: int,
            seed: int) -> tuple[float, float]:
    runs = [simulate(model, policy, requests=requests, seed=seed + k, cpu_priority=lever) for k in range(seeds)]
    mean = sum(r.mean_response_time for r in runs) / seeds
    return mean, math.sqrt(sum(r.ci95**2 for r in runs)) / seeds


def predict_lever(model: TandemModel, policy: Policy, kind: str, *, requests: int = 300_000, seeds: int = 2,
                  seed: int = 0) -> LeverPrediction:
    """Simulate ``policy`` (and, for ``age``, π(∞)) with the lever ``kind`` (module docstring).

    Raises
    ------
    ModelError
        An unknown ``kind``, or ``class`` for a policy that does not see the phases.
    """
    if kind not in LEVER_KINDS:
        raise ModelError(f"cpu priority: expected one of {', '.join(LEVER_KINDS)}, got {kind!r}")
    if requests < 10_000 or seeds < 1:
        raise ModelError(f"cpu priority prediction: requests >= 10000 and seeds >= 1, got {requests}, {seeds}")
    weights = [1.0, DEFAULT_LOW_WEIGHT]
    ps: float | None = None
    ps_ci: float | None = None
    if kind == "age":
        a = choose_tandem_thresholds(model, common=True).priority.thresholds[0][0]
        lever = age_priority(model, [a], weights=weights)
        ps, ps_ci = _pooled(model, "pi(inf)", lever, requests, seeds, seed)
    else:
        if policy.phase_info != "full":
            raise ModelError(f"cpu priority class: short-first classes need each request's phase; this policy "
                             f"is solved for phase_info {policy.phase_info!r}: use age, or solve with --phase-info full")
        lever = class_priority(model, weights=weights)
        if phases_stay(model):  # exact: weighted sharing by phase
            from .truncation import evaluate_rule

            base = replace(policy.model, weights=None) if policy.model.weights is not None else policy.model
            ev = evaluate_rule(class_model(base), policy.layout, policy.actions, max_requests=policy.max_requests,
                               max_threads=policy.max_threads)
            return LeverPrediction(kind, lever, ev.mean_response_time, 0.0, None, None, 0)
    w, ci = _pooled(model, policy, lever, requests, seeds, seed)
    return LeverPrediction(kind, lever, w, ci, ps, ps_ci, requests)
