"""Exact metrics of a fixed decision rule, and of the baselines on caps that settle E[W].

:func:`evaluate_rule` builds the chain a rule induces on one request cap and solves its stationary
law; :func:`evaluate_baseline` evaluates a baseline on the growing caps of :mod:`overtake.mdp.caps`.
π(∞) under processor sharing needs no chain: :func:`ps_metrics` is its closed form.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .baselines import Baseline
from .caps import settle
from .chain import Chain, build_chain
from .evaluate import PolicyMetrics, chain_law, metrics, start_vector_pays, stationary_distribution
from .model import TandemModel
from .statespace import Layout, Ranker

__all__ = [
    "Evaluation", "WarmStarts", "evaluate_baseline", "evaluate_rule", "grow_requests", "ps_chain_states", "ps_metrics",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Progress = Callable[[str], None]


class WarmStarts:
    """Stationary laws of chains already evaluated, by request cap: starting vectors for the next ones.

    Auto-truncation evaluates one policy on caps C, 1.5·C, … and a re-solved, nearly equal policy
    on the same caps; each law is close to one already computed (the same cap, else the nearest
    below), so the iterative stationary solve starts there and needs fewer rounds to meet the same
    residual test (:func:`overtake.mdp.evaluate.stationary_distribution`).
    """

    def __init__(self) -> None:
        self._by_cap: dict[int, tuple[IntArray, FloatArray]] = {}

    def record(self, cap: int, rows: IntArray, pi: FloatArray) -> None:
        self._by_cap[cap] = (rows, pi)

    def copy(self) -> WarmStarts:
        """Another record of the same laws (the arrays shared: a law is never changed once recorded)."""
        out = WarmStarts()
        out._by_cap = dict(self._by_cap)
        return out

    def recorded(self, cap: int) -> tuple[IntArray, FloatArray]:
        """The law recorded for ``cap``: its states' rows and their probabilities."""
        return self._by_cap[cap]

    def guess(self, cap: int, rows: IntArray) -> FloatArray | None:
        """The recorded law nearest to ``cap`` (equal, else the largest below, else the smallest above),
        mapped onto ``rows`` by state (0 where a state was not in it); None when nothing is recorded."""
        if not self._by_cap:
            return None
        below = [c for c in self._by_cap if c <= cap]
        old_rows, old_pi = self._by_cap[max(below) if below else min(self._by_cap)]
        keep = old_rows.sum(axis=1) <= cap
        ranker = Ranker(rows.shape[1], cap)
        old_keys = ranker.rank(old_rows[keep])
        order = np.argsort(old_keys)
        sorted_keys = old_keys[order]
        keys = ranker.rank(rows)
        pos = np.minimum(np.searchsorted(sorted_keys, keys), sorted_keys.size - 1)
        hit = sorted_keys[pos] == keys
        out: FloatArray = np.where(hit, old_pi[keep][order][pos], 0.0)
        return out

    def law(self, cap: int, rows: IntArray, P: sp.csr_matrix | Chain, queue_stage: IntArray,
            model: TandemModel) -> PolicyMetrics:
        """Metrics of the chain ``P`` (a matrix, or a chain built from the empty system) on ``rows``
        (cap ``cap``), started from the nearest recorded law."""
        x0 = self.guess(cap, rows) if start_vector_pays(rows.shape[0]) else None
        reach, pi = chain_law(P, x0) if isinstance(P, Chain) else stationary_distribution(P, x0=x0)
        self.record(cap, rows[reach], pi)
        return metrics(model, rows[reach], queue_stage, pi, cap)


def evaluate_rule(
    model: TandemModel, layout: Layout, rule: Callable[..., Any], *, max_requests: int, max_threads: int | None,
    warm: WarmStarts | None = None,
) -> PolicyMetrics:
    """Exact metrics of the chain ``rule`` induces on ``max_requests``; ``warm``: starting vectors, updated."""
    chain = build_chain(model, layout, rule, max_requests=max_requests, max_threads=max_threads)
    if warm is not None:
        return warm.law(max_requests, chain.rows, chain, layout.queue_stage, model)
    reach, pi = chain_law(chain)
    return metrics(model, chain.rows[reach], layout.queue_stage, pi, max_requests)


def grow_requests(
    evaluate: Callable[[int], PolicyMetrics], start: int, tol: float, name: str,
    progress: Progress | None = None, max_cap: int = 2000, error: Callable[[str], Exception] = RuntimeError,
) -> tuple[PolicyMetrics, list[dict[str, Any]]]:
    """Evaluate at caps C, 1.5C, … until E[W] moves by less than ``tol``; the last, with each cap's
    trace entry. Raises ``error`` when E[W] still moves at ``max_cap``."""
    first = evaluate(start)
    trace: list[dict[str, Any]] = [
        {"max_requests": start, "mean_response_time": first.mean_response_time, "states": first.states}]

    def step(cap: int, m: PolicyMetrics, change: float) -> None:
        trace.append({"max_requests": cap, "mean_response_time": m.mean_response_time, "states": m.states,
                      "relative_change": change})
        if progress:
            progress(f"{name}: cap {cap}: E[W] = {m.mean_response_time:.6g} (change {change:.2e})")

    out = settle(evaluate, start, tol=tol, first=first, max_cap=max_cap, step=step)
    if not out.settled:
        raise error(f"{name}: E[W] still changes at max_requests = {out.cap}; the load is too close to 1")
    return out.metrics, trace


@dataclass
class Evaluation:
    """Metrics of one policy with the truncations tried on the way."""

    name: str
    metrics: PolicyMetrics
    trace: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def evaluate_baseline(
    model: TandemModel, name: str, *, tol: float = 1e-3, start: int = 20, progress: Progress | None = None
) -> Evaluation:
    """Exact metrics of a baseline π(k), π(k1,…,kN) or π(∞) with auto-truncation."""
    t0 = time.perf_counter()
    b = Baseline.parse(name, model.n_stages)
    layout = Layout.build(model, "start")
    rule = b.rule(layout.queue_stage, model.coord_stage())
    kmax = b.max_threads
    model.check_stable(kmax)
    warm = WarmStarts()

    def ev(C: int) -> PolicyMetrics:
        if kmax is None and model.weights is None and not model.has_lock:  # π(∞) under PS: a symmetric queue
            return ps_metrics(model, C)
        return evaluate_rule(model, layout, rule, max_requests=C, max_threads=kmax, warm=warm)

    m, trace = grow_requests(ev, start, tol, b.name, progress)
    return Evaluation(b.name, m, trace, time.perf_counter() - t0)


def ps_metrics(model: TandemModel, max_requests: int) -> PolicyMetrics:
    """Exact metrics of π(∞) with at most ``max_requests`` requests, in O(C), no chain built.

    Under π(∞) every request holds a thread from arrival to departure, so the tandem is a
    symmetric queue of total rate c(n) (Kelly, *Reversibility and Stochastic Networks*, §3.3):
    p(n) ∝ Π_{k≤n} λ·ΣE[S_i]/c(k) for n ≤ C (blocking included), insensitive to the phases, and
    given n each request is in stage i with probability E[S_i]/ΣE[S]. Every field equals the
    chain's (:func:`evaluate_rule` on π(∞)'s rule), which holds C(C + D, D) states.
    """
    C = max_requests
    means = np.array([st.mean() for st in model.stages])
    work = model.arrival_rate * means.sum()
    n = np.arange(C + 1)
    log_p = np.concatenate([[0.0], np.cumsum(np.log(work / model.capacity(n[1:])))])
    p = np.exp(log_p - log_p.max())
    p /= p.sum()
    blocking = float(p[-1])
    lam_eff = model.arrival_rate * (1.0 - blocking)
    EN = float(n @ p)
    return PolicyMetrics(
        mean_response_time=EN / lam_eff, mean_in_system=EN, mean_threads=EN, blocking_probability=blocking,
        arrival_rate=model.arrival_rate, stage_sojourn=tuple(float(x) for x in EN * means / means.sum() / lam_eff),
        thread_distribution=tuple(float(x) for x in p), states=math.comb(C + model.n_coords, model.n_coords),
        max_requests=C,
    )


def ps_chain_states(model: TandemModel, *, tol: float = 1e-3, start: int = 20, max_cap: int = 2000) -> int:
    """States of the π(∞) baseline's chain on the cap :func:`evaluate_baseline` settles on, unbuilt.

    The caps are walked on :func:`ps_metrics`, as the baseline's evaluation walks them; the chain
    on the last holds every thread vector of D phases with sum ≤ C: binom(C + D, D) states.
    """
    return settle(lambda C: ps_metrics(model, C), start, tol=tol, max_cap=max_cap).metrics.states
