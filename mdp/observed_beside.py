"""The parts of an observation-policy solve (:mod:`overtake.mdp.observed`) that run in a second
process: a cap's local searches, each taken by whichever process is free first, the first
table's evaluation ladder, and the baselines the answer is checked against (while the next
table's ladder runs here). Each returns what the solve merges: plain data (an LU does not pickle).

A worker is started only where the work it takes can pay for its start (:func:`worth_a_worker`):
the fork, the parent's copy-on-write faults after it, the answer pickled back and the worker's
exit. Where the observation hides no phase (every stage exponential: one state per class) the
table is a full-information policy, its searches end in a step or two and its ladder's chains
solve at once, so a worker only adds its start; measured on Table 1's exponential cases from 1,001
to 10,626 states, the solve took longer with the worker than without at every size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import fields
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .evaluate import PolicyMetrics
from .model import TandemModel
from .observation import ExactEvaluation, ObservationSpace
from .observation_exact import SolverState
from .observed_chain import ChainLaw
from .observed_improve import improve
from .policy import Policy
from .rule_evaluation import Evaluation, evaluate_baseline

__all__ = ["Ladder", "Tickets", "baselines_beside", "baselines_joined", "limit_elsewhere", "search_elsewhere",
           "worth_a_worker"]

IntArray = npt.NDArray[np.int64]


def worth_a_worker(osp: ObservationSpace) -> bool:
    """Whether a cap's searches and its table's ladder may go to a second process (module docstring):
    only where the observation hides phases (more states than classes)."""
    return osp.size > osp.n_classes


class Ladder(Protocol):
    """What :func:`limit_elsewhere` uses of the solve (:class:`overtake.mdp.observed._Search`)."""

    progress: Callable[[str], None] | None
    trace: list[dict[str, Any]]
    laws: dict[int, ChainLaw]
    last: tuple[Policy, ChainLaw] | None

    def limit(self, pol: Policy, C: int, solve_cap: int,
              first: PolicyMetrics | None = None) -> tuple[PolicyMetrics, int]: ...


class Tickets:
    """Indices 0, …, n−1, each taken once by whichever process asks first: a byte each in a pipe
    whose writing end is closed (a read of one byte is atomic, and an emptied pipe reads as its end)."""

    def __init__(self, n: int) -> None:
        read, write = os.pipe()
        os.write(write, bytes(range(n)))
        os.close(write)
        self.fd: int | None = read

    def take(self) -> int | None:
        data = os.read(self.fd, 1) if self.fd is not None else b""
        return data[0] if data else None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def search_elsewhere(osp: ObservationSpace, state: SolverState, tickets: Tickets, ranked: list[str],
                      tables: dict[str, IntArray], evs: dict[str, ExactEvaluation],
                      ) -> tuple[dict[str, tuple[Any, ...]], list[str]]:
    """:meth:`_Search.searches` in a worker, for the searches it takes: per start the table, its
    evaluation's fields but the factor, the history, whether it converged and the evaluations
    made; and the progress lines."""
    lines: list[str] = []
    out: dict[str, tuple[Any, ...]] = {}
    while (j := tickets.take()) is not None:
        k = ranked[j]
        osp.exact.restore(state)
        r = improve(osp, tables[k], start=k, evaluation=evs[k], progress=lines.append)
        ev = {f.name: getattr(r.evaluation, f.name) for f in fields(r.evaluation) if f.name != "factor"}
        out[k] = (r.actions, ev, r.history, r.converged, r.evaluations)
    return out, lines


def limit_elsewhere(search: Ladder, pol: Policy, C: int, first: PolicyMetrics) -> tuple[
        PolicyMetrics, int, list[dict[str, Any]], dict[int, ChainLaw], ChainLaw | None, list[str]]:
    """:meth:`_Search.limit` in a worker: its answer, the trace entries and stationary laws it added
    (by request cap), the last law of ``pol`` and its progress lines, for :meth:`_Search.limit_beside`."""
    lines: list[str] = []
    search.progress = lines.append
    before = dict(search.laws)
    lim, Ce = search.limit(pol, C, C, first)
    laws = {c: law for c, law in search.laws.items() if before.get(c) is not law}
    last = search.last[1] if search.last is not None and search.last[0] is pol else None
    return lim, Ce, search.trace, laws, last, lines


def baselines_beside(beside: Callable[..., Any], model: TandemModel, names: list[str], tol: float,
                     evaluated: dict[str, Evaluation]) -> Any:
    """The evaluations of the baselines ``names`` not in ``evaluated`` started in a worker
    (``beside``): the answer needs them, and nothing of the search; None where none is missing.
    :func:`baselines_joined` waits for them."""
    missing = [n for n in names if n not in evaluated]
    return beside(_baselines, model, missing, tol) if missing else None


def baselines_joined(pending: Any, say: Callable[[str], None]) -> dict[str, Evaluation]:
    """The evaluations :func:`baselines_beside` started, their progress lines said here."""
    found, lines = pending.result()
    for line in lines:
        say(line)
    return dict(found)


def _baselines(model: TandemModel, names: list[str], tol: float) -> tuple[dict[str, Evaluation], list[str]]:
    lines: list[str] = []
    return {n: evaluate_baseline(model, n, tol=tol, progress=lines.append) for n in names}, lines
