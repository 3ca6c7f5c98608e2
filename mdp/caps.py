"""Request caps that grow until E[W] settles.

A truncated chain blocks arrivals at its request cap C, so the E[W] it reports depends on C. No
E[W] is reported before it stops depending on it: the policy is evaluated exactly on the caps
C, 1.5·C, … of the *evaluation ladder* (each at least two above the one before) until one step
moves E[W] by less than a relative ``tol`` (:func:`settle`). The baselines, the heuristic, π*
and the observation policies all settle this way. The solves of π* and of observation policies
also grow their *solve* cap, by 1.25 a step (:func:`next_solve_cap`), while the re-solved
policy's settled E[W] still moves by ``tol``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from .errors import TruncationError

__all__ = [
    "EVALUATION_GROWTH", "SOLVE_GROWTH", "Settled", "ladder_cap", "next_cap", "next_evaluation_cap",
    "next_solve_cap", "relative_change", "settle",
]

#: growth factor of the evaluation ladder
EVALUATION_GROWTH = 1.5
#: growth factor of the solve cap
SOLVE_GROWTH = 1.25


class HasResponseTime(Protocol):
    @property
    def mean_response_time(self) -> float: ...


M = TypeVar("M", bound=HasResponseTime)


def next_cap(cap: int, factor: float) -> int:
    """The cap after ``cap``: ``factor`` times larger, at least two more."""
    return max(cap + 2, math.ceil(factor * cap))


def next_evaluation_cap(cap: int) -> int:
    """The evaluation ladder's cap after ``cap``: 1.5× larger (at least +2)."""
    return next_cap(cap, EVALUATION_GROWTH)


def next_solve_cap(cap: int) -> int:
    """The solve cap tried after ``cap``: 1.25× larger (at least +2)."""
    return next_cap(cap, SOLVE_GROWTH)


def ladder_cap(first: int, below: int, at_most: int, factor: float = EVALUATION_GROWTH) -> int:
    """The last cap of the ladder ``first``, next, … whose successor is below ``below`` and at most
    ``at_most`` (``first`` when its successor is not): where a larger solve cap's policy starts
    settling, so that it meets the previous policy's ladder on equal caps."""
    cap = first
    while (nxt := next_cap(cap, factor)) < below and nxt <= at_most:
        cap = nxt
    return cap


def relative_change(new: float, old: float) -> float:
    return abs(new - old) / max(abs(old), 1e-300)


@dataclass(frozen=True)
class Settled(Generic[M]):
    """Where :func:`settle` stopped.

    ``metrics`` are the last evaluation, on ``cap``. ``stop`` is ``"settled"`` (the last step moved
    E[W] by less than ``tol``), ``"max_cap"`` (the next cap, ``refused``, is beyond ``max_cap``)
    or ``"budget"`` (``evaluate`` declined ``refused``: its chain is beyond a state budget).
    """

    metrics: M
    cap: int
    stop: Literal["settled", "max_cap", "budget"]
    refused: int | None = None

    @property
    def settled(self) -> bool:
        return self.stop == "settled"


def settle(
    evaluate: Callable[[int], M | None],
    start: int,
    *,
    tol: float,
    factor: float = EVALUATION_GROWTH,
    first: M | None = None,
    max_cap: int | None = None,
    step: Callable[[int, M, float], None] | None = None,
) -> Settled[M]:
    """Evaluate on ``start``, then on each next cap, until E[W] moves by less than ``tol`` (relative).

    ``evaluate(cap)`` returns the metrics on ``cap``, or None where the chain is beyond a state
    budget. ``first`` is the evaluation on ``start`` when the caller has it already. ``step(cap,
    metrics, change)`` is called after each further evaluation (trace entries, progress lines).
    The loop stops at the first cap beyond ``max_cap`` without evaluating it; with no ``max_cap``
    it runs until E[W] settles.
    """
    cap = start
    prev = evaluate(cap) if first is None else first
    if prev is None:
        raise TruncationError(f"the chain on the first evaluation cap, {start} requests, is beyond the state budget")
    while True:
        nxt = next_cap(cap, factor)
        if max_cap is not None and nxt > max_cap:
            return Settled(prev, cap, "max_cap", nxt)
        cur = evaluate(nxt)
        if cur is None:
            return Settled(prev, cap, "budget", nxt)
        change = relative_change(cur.mean_response_time, prev.mean_response_time)
        if step is not None:
            step(nxt, cur, change)
        if change < tol:
            return Settled(cur, nxt, "settled")
        cap, prev = nxt, cur
