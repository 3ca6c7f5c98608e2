"""The solver's one entry: :func:`solve`, the best thread policy for a tandem model.

One function, as QuantEcon's ``DiscreteDP.solve(method=...)``: what the policy may see
(``phase_info``) and the algorithm (``method``) are arguments, and the answer is the result type of
the solver behind it.

* ``phase_info`` ``full`` (each waiting request's phase known) or ``start`` (a request's phase
  known once its thread starts): π* of the MDP, auto-truncated (:mod:`overtake.mdp.optimum`),
  an :class:`~overtake.mdp.optimum.Optimum`. ``method`` picks the average-cost solver on each
  truncated space (:mod:`overtake.mdp.average_cost`).
* ``none`` (counts per stage only) or ``route`` (counts per route, with ``routes``): the best
  observation policy (:mod:`overtake.mdp.observed`), an :class:`~overtake.mdp.observed_result.ObservedOptimum`.
  Every candidate is evaluated exactly, so ``method`` plays no part.
* ``cpu_priority="class"`` (``full`` only): two CPU classes by phase are part of the model; the
  spawn optimum is solved under each candidate class assignment and the best kept
  (:func:`overtake.mdp.priority_classes.choose_classes`), a
  :class:`~overtake.mdp.priority_classes.ClassChoice`.

Options of one solver only go in ``options``: ``start`` and ``rvi_tol`` for π*; ``start``,
``baselines``, ``max_states``, ``none_optimum`` and the others of
:func:`overtake.mdp.observed.solve_observed` for observation policies; ``weight`` for classes.

>>> import numpy as np
>>> from overtake.mdp import Stage, TandemModel, Truncation, solve
>>> def exponential(name):
...     return Stage(name, np.array([1.0]), np.array([[-1.0]]))
>>> model = TandemModel(0.25, (exponential("parse"), exponential("render")))
>>> opt = solve(model, truncation=Truncation(6, 2), method="pi")
>>> type(opt).__name__, opt.solve.method, opt.policy.phase_info
('Optimum', 'pi', 'full')
>>> counts = solve(model, phase_info="none", truncation=Truncation(6, 2))
>>> type(counts).__name__, counts.policy.phase_info
('ObservedOptimum', 'none')
>>> bool(opt.metrics.mean_response_time <= counts.metrics.mean_response_time * (1 + 1e-9))
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

from .errors import ModelError
from .optimum import Optimum, solve_mdp
from .statespace import PhaseInfo, Truncation

if TYPE_CHECKING:
    from .model import TandemModel
    from .observed import ObservedOptimum
    from .priority_classes import ClassChoice
    from .routes import RouteSplit

__all__ = ["METHODS", "PHASE_INFO", "solve"]

Progress = Callable[[str], None]
Method = Literal["anderson", "rvi", "pi"]

#: the average-cost solvers (:mod:`overtake.mdp.average_cost`)
METHODS: tuple[str, ...] = ("anderson", "rvi", "pi")
#: what a policy may see, from most to least
PHASE_INFO: tuple[str, ...] = ("full", "start", "none", "route")


@overload
def solve(
    model: TandemModel, *, phase_info: Literal["full", "start"] = ..., method: Method = ...,
    truncation: Truncation | None = ..., tol: float = ..., routes: RouteSplit | None = ...,
    cpu_priority: None = ..., progress: Progress | None = ..., **options: Any,
) -> Optimum: ...
@overload
def solve(
    model: TandemModel, *, phase_info: Literal["none", "route"], method: Method = ...,
    truncation: Truncation | None = ..., tol: float = ..., routes: RouteSplit | None = ...,
    cpu_priority: None = ..., progress: Progress | None = ..., **options: Any,
) -> ObservedOptimum: ...
@overload
def solve(
    model: TandemModel, *, phase_info: Literal["full"] = ..., method: Method = ...,
    truncation: Truncation | None = ..., tol: float = ..., routes: RouteSplit | None = ...,
    cpu_priority: Literal["class"], progress: Progress | None = ..., **options: Any,
) -> ClassChoice: ...
@overload
def solve(
    model: TandemModel, *, phase_info: PhaseInfo | str = ..., method: Method | str = ...,
    truncation: Truncation | None = ..., tol: float = ..., routes: RouteSplit | None = ...,
    cpu_priority: None = ..., progress: Progress | None = ..., **options: Any,
) -> Optimum | ObservedOptimum: ...
@overload
def solve(
    model: TandemModel, *, phase_info: PhaseInfo | str = ..., method: Method | str = ...,
    truncation: Truncation | None = ..., tol: float = ..., routes: RouteSplit | None = ...,
    cpu_priority: str | None = ..., progress: Progress | None = ..., **options: Any,
) -> Optimum | ObservedOptimum | ClassChoice: ...
def solve(
    model: TandemModel,
    *,
    phase_info: PhaseInfo | str = "full",
    method: Method | str = "anderson",
    truncation: Truncation | None = None,
    tol: float = 1e-3,
    routes: RouteSplit | None = None,
    cpu_priority: str | None = None,
    progress: Progress | None = None,
    max_states: int | None = None,
    **options: Any,
) -> Optimum | ObservedOptimum | ClassChoice:
    """The best policy for ``model`` given what it may see (module docstring).

    Parameters
    ----------
    phase_info
        ``full``, ``start``, ``none`` or ``route``.
    method
        ``anderson`` (relative value iteration with Anderson acceleration, the default), ``rvi``
        or ``pi`` (policy iteration).
    truncation
        A fixed truncation, solved once; default: auto-truncation to relative accuracy ``tol``.
    tol
        Relative accuracy of the reported E[W].
    routes
        The route split (``route`` only).
    cpu_priority
        None, or ``class``: CPU classes by phase (``full`` only).
    progress
        Called with one line per step.
    max_states
        A budget for the full-information solve's auto-truncation (:func:`overtake.mdp.optimum.solve_mdp`).

    Raises
    ------
    ModelError
        An unknown ``phase_info``, ``method`` or ``cpu_priority``, or CPU classes without phases.
    """
    _check_request(model, phase_info, method, cpu_priority)
    if cpu_priority is not None:
        from .priority_classes import choose_classes

        return choose_classes(model, truncation=truncation, tol=tol, method=method, progress=progress, **options)
    if phase_info in ("none", "route"):
        from .observed import solve_observed  # the heuristic's kernels (numba) only when used

        return solve_observed(model, phase_info=phase_info, routes=routes, truncation=truncation,
                              tol=tol, progress=progress, **options)
    return solve_mdp(model, phase_info=phase_info, truncation=truncation, tol=tol, method=method,  # type: ignore[arg-type]
                     progress=progress, max_states=max_states, **options)


def _check_request(model: TandemModel, phase_info: str, method: str, cpu_priority: str | None) -> None:
    """Refuse, before any solve, what no solver answers: an unknown ``phase_info``, ``method`` or
    ``cpu_priority``, CPU classes beside a lock or without the phases, and coupled stages under
    an observation policy (its solves draw each stage's start phase independently)."""
    if phase_info not in PHASE_INFO:
        raise ModelError(f"phase_info: expected one of {', '.join(PHASE_INFO)}, got {phase_info!r}")
    if method not in METHODS:
        raise ModelError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    if model.has_lock and cpu_priority is not None:
        raise ModelError(f"locks: CPU classes by phase (cpu_priority {cpu_priority!r}) are not modelled with a stage "
                         "with a lock; solve without them (age priority is predicted with the lock: "
                         "overtake solve --cpu-priority age)")
    if model.coupled and (phase_info in ("none", "route") or cpu_priority is not None):
        raise ModelError(f"routing: coupled stages are solved with phase_info full or start and no cpu_priority "
                         f"(the observation solves draw each stage's start phase independently); got phase_info "
                         f"{phase_info!r}, cpu_priority {cpu_priority!r}")
    if cpu_priority is not None:
        if cpu_priority != "class":
            raise ModelError(f"cpu_priority: only 'class' changes the solve (age priority is predicted for a "
                             f"solved policy), got {cpu_priority!r}")
        if phase_info != "full":
            raise ModelError(f"cpu_priority class: classes by phase need the phases; phase_info {phase_info!r} "
                             "does not see them")
