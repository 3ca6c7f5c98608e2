"""Observation-restricted policy improvement with an exact acceptance test (:mod:`overtake.mdp.observed`, step 2).

One iteration: the weighted-Q step of :meth:`ObservationSpace.propose` in every class; it is
taken only if the exact gain is lower. If not, the changed classes with the largest first-order
gains (a quarter of them, a sixteenth, …, one), then single classes in that order. Each trial is
screened by its stationary gain alone (:meth:`ObservationSpace.stationary_gain`, exact,
warm-started from the current law): a trial clearly worse is rejected without solving for its
bias; the others are accepted on the full evaluation's gain (whose stationary solve, when
iterative, starts from the screen's law). A trial that changes the decision
rows of a few states only is evaluated in full at once, by a low-rank update of the current
factor (:meth:`ObservationSpace.low_rank`), which costs no more than the screen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .observation import ExactEvaluation, ObservationSpace, Proposal

__all__ = ["SCREEN_MARGIN", "Improvement", "distinct", "improve", "log_searches"]

IntArray = npt.NDArray[np.int64]
Progress = Callable[[str], None]

#: a trial whose stationary gain exceeds the current gain by this much (relative) is rejected
#: unevaluated: far above the stationary solve's error (residual 1e-12), far below any step's gain
SCREEN_MARGIN = 1e-8


@dataclass(eq=False)
class Improvement:
    """Result of :func:`improve`: the table, its exact evaluation and the recorded steps."""

    actions: IntArray
    evaluation: ExactEvaluation
    history: list[dict[str, Any]]
    converged: bool
    evaluations: int

    @property
    def steps(self) -> int:
        return sum(1 for h in self.history if h.get("accepted"))


def trials(osp: ObservationSpace, prop: Proposal, actions: IntArray, max_singles: int) -> list[tuple[str, IntArray]]:
    """The class subsets one iteration tries, in order: every changed class, the quarter, sixteenth,
    … with the largest first-order gains, the single best, then ``max_singles`` single classes."""
    diff = np.any(prop.actions != actions, axis=1)
    reached = np.flatnonzero(diff & (prop.mass > 0))
    if reached.size == 0:
        return []
    order = reached[np.argsort(prop.advantage[reached], kind="stable")]  # largest first-order gain first
    unreached = np.flatnonzero(diff & (prop.mass == 0))
    out: list[tuple[str, IntArray]] = [("all", np.concatenate([order, unreached]))]
    k = order.size // 4
    while k >= 1:
        out.append((f"top {k}", order[:k]))
        k //= 4
    if order.size > 1:
        out.append(("top 1", order[:1]))
    for j in order[1:1 + max_singles]:
        out.append((f"class {osp.classes[j].tolist()}", np.array([j])))
    return list({lab: (lab, sel) for lab, sel in out}.values())  # "top 1" at most once


def _first_better(osp: ObservationSpace, actions: IntArray, ev: ExactEvaluation, prop: Proposal,
                  tries: list[tuple[str, IntArray]]) -> tuple[str | None, IntArray, ExactEvaluation, int]:
    """The first trial whose exact gain is below ``ev``'s: (label, table, evaluation, trials made);
    label None and the current table where none is."""
    for n, (label, sel) in enumerate(tries, 1):
        B = actions.copy()
        B[sel] = prop.actions[sel]
        # screen: a trial whose stationary gain is clearly worse is rejected without solving for
        # its bias; the others are accepted or not on the full evaluation's gain. A trial the
        # current factor's low-rank update solves costs no more than its screen: evaluated at once
        law = None
        if not osp.low_rank(B, ev):
            g_screen, law = osp.stationary_gain(B, start=ev.post)
            if g_screen >= ev.gain + SCREEN_MARGIN * abs(ev.gain):
                continue
        # the current factor preconditions the trial's solves; the screen's law starts its stationary one
        evB = osp.evaluate(B, near=ev, law=law)
        if evB.gain < ev.gain - 1e-12 * abs(ev.gain):
            return label, B, evB, n
    return None, actions, ev, len(tries)


def improve(
    osp: ObservationSpace,
    actions: IntArray,
    *,
    start: str = "",
    max_iter: int = 200,
    max_singles: int = 4,
    max_evaluations: int = 150,
    min_progress: float = 1e-5,
    window: int = 10,
    evaluation: ExactEvaluation | None = None,
    progress: Progress | None = None,
) -> Improvement:
    """Observation-restricted policy improvement with an exact acceptance test (module docstring).

    Every accepted step lowers the exact gain on ``osp``'s truncated chain; ``history`` holds one
    entry per iteration: the gain and E[W] after it, the classes proposed, the subset accepted (or
    none) and the exact evaluations it took. The search stops when no trial lowers the gain, when
    ``window`` steps together lowered it by less than ``min_progress`` (relative: late steps move
    single rare classes by 1e-7 each, far below any reported accuracy), or after
    ``max_evaluations`` exact evaluations (``converged`` is then False).
    """
    A = osp.repair(actions)
    ev = evaluation or osp.evaluate(A)
    n_eval = 1 if evaluation is None else 0
    history: list[dict[str, Any]] = [{"iteration": 0, "start": start, "gain": ev.gain,
                                      "mean_response_time": ev.metrics.mean_response_time}]
    converged = False
    for it in range(1, max_iter + 1):
        prop = osp.propose(A, ev)
        tries = trials(osp, prop, A, max_singles)
        if not tries:
            converged = True
            history.append({"iteration": it, "proposed": 0, "accepted": None, "stop": "no class proposes a change"})
            break
        accepted, A, ev, tried = _first_better(osp, A, ev, prop, tries)
        n_eval += tried
        history.append(_entry(osp, it, prop, A, ev, tries, accepted, tried))
        if progress:
            progress(f"pi*: observation policy step {it}: {accepted or 'no step improves'}; g = {ev.gain:.8g}")
        stop = _stop(history, accepted, n_eval, ev.gain, it, max_evaluations, window, min_progress)
        if stop is not None:
            history[-1]["stop"] = stop
            converged = not stop.endswith("spent")
            break
    return Improvement(A, ev, history, converged, n_eval)


def _entry(osp: ObservationSpace, it: int, prop: Proposal, A: IntArray, ev: ExactEvaluation,
           tries: list[tuple[str, IntArray]], accepted: str | None, tried: int) -> dict[str, Any]:
    """One iteration's history entry."""
    order = tries[0][1][prop.mass[tries[0][1]] > 0]
    changed = (int(np.any(A != prop.actions, axis=1).sum()) if accepted is None else
               int(dict(tries)[accepted].size))
    return {"iteration": it, "proposed": int(order.size), "accepted": accepted, "changed": changed,
            "evaluations": tried, "gain": ev.gain, "mean_response_time": ev.metrics.mean_response_time,
            "first_order_gain": float(prop.advantage[order].sum() * osp.space.rate)}


def _stop(history: list[dict[str, Any]], accepted: str | None, n_eval: int, gain: float, it: int,
          max_evaluations: int, window: int, min_progress: float) -> str | None:
    """Why the search stops after iteration ``it`` (None: it goes on)."""
    if accepted is None:
        return "no step lowers the exact gain"
    if n_eval >= max_evaluations:
        return f"{max_evaluations} exact evaluations spent"
    if it >= window and history[-1 - window]["gain"] - gain < min_progress * abs(gain):
        return f"the last {window} steps lowered the gain by less than {min_progress:g} (relative)"
    return None


def distinct(tables: dict[str, IntArray]) -> dict[str, IntArray]:
    """``tables`` less those equal to an earlier one: a search from the same table is the same
    search (the lifted ``none`` optimum is often a lifted baseline, e.g. π(∞)'s), and each costs
    as much as the rest; the starts kept are those ranked before, so the answer is unchanged."""
    seen: set[bytes] = set()
    out: dict[str, IntArray] = {}
    for k, A in tables.items():
        if (key := A.tobytes()) not in seen:
            seen.add(key)
            out[k] = A
    return out


def log_searches(log: logging.Logger, phase_info: str, cap: int, osp: ObservationSpace,
                 runs: dict[str, Improvement], screened: int, seconds: float) -> None:
    """One debug line per local search of a solve cap: what ends long runs (the evaluation cap or
    the progress window) and how many exact evaluations each took."""
    log.debug("%s: solve cap %d (%d states, %d classes): %d tables screened, %d searches in %.2f s",
              phase_info, cap, osp.size, osp.n_classes, screened, len(runs), seconds)
    for k, r in runs.items():
        log.debug("%s:   from %s: %d evaluations, %d steps, g = %.10g; stop: %s", phase_info, k, r.evaluations,
                  r.steps, r.evaluation.gain, r.history[-1].get("stop", "max_iter"))
