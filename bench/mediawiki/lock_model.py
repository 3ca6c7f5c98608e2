"""The wiki's model with its database lock: what Overtake's model predicts once previews serialise.

MediaWiki on SQLite runs every POST in an IMMEDIATE transaction, so a preview holds the database
write lock from start to end: the preview stage is a stage with a lock of capacity 1
(:mod:`overtake.mdp.lock`). A preview started while another holds the lock waits inside its PHP
worker (a prefork child, or one of php-fpm's ``pm.max_children``), holding it, using no CPU.
Views read in DEFERRED transactions (SQLite's SHARED lock), which the preview's reservation does
not block; but under the rollback journal a preview's commit takes the EXCLUSIVE lock, so it
waits, with SQLite's busy-handler sleeps, until no view reads (the bench's strace:
bench/mediawiki/sqlite_model.py): ``journal="delete"`` adds that default, simulated with the
views as the lock's readers (``TandemModel(readers=...)``); under the write-ahead log a commit
waits for no reader. With the bench's object caches in APCu no request writes any other database.

:func:`predict` takes the bench's recorded fits (``overtake fit`` of the idle preview and view
times), the trace's arrival rate and the PHP stack, and returns the model's mean response time per
transaction for

* ``default``: Apache's default, every request started at once up to the stack's worker limit
  (prefork's ``MaxRequestWorkers`` does not bind at this load; php-fpm's 5 children do), exact;
* ``passthrough+age``: the same admission with mod_overtake_prio's age priority at the solved
  threshold (SCHED_IDLE beyond it), previews exempt (the product never demotes a request that
  may hold the lock: POST is an exempt method), simulated: the chain has no exact form with age
  levels; ``passthrough+age_inverted`` the same without the exemption: a demoted preview still
  holds the lock, so the previews blocked behind it wait on a thread that runs at the idle
  weight (the priority inversion the bench measured);
* ``blind``: the best policy over counts (``phase_info`` none, what the sidecar runs for real
  clients, :mod:`overtake.mdp.observed`) with the lock, under the stack's worker limit, exact;
* ``optimum``: π* of the MDP with the lock, phases known at a thread's start (``start``): it
  never starts a preview while another holds the lock, so writers wait in the sidecar, not in a
  worker;

and, for comparison, the same figures without the lock (the pure processor-sharing tandem).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from overtake.mdp import Stage, TandemModel, solve
from overtake.mdp.observed import solve_observed
from overtake.mdp.priority import age_priority, exempt_stages, locked_stages
from overtake.mdp.rule_evaluation import evaluate_baseline
from overtake.mdp.simulation import simulate

from .class_model import BUSY_DELAYS

__all__ = ["WORKERS", "predict", "serialises", "stack_model"]

#: PHP workers a stack runs at most: prefork's MaxRequestWorkers, php-fpm's pm.max_children
WORKERS = {"prefork": 150, "fpm": 5}


def stack_model(fits: Mapping[str, Mapping[str, Any]], arrival_rate: float, *, lock: bool = True,
                readers: bool = False) -> TandemModel:
    """The tandem preview → view of the recorded fits (seconds), the preview stage locked (capacity 1);
    ``readers``: the rollback journal, views reading under the lock, so a preview's commit waits
    for them with SQLite's busy-handler sleeps (``TandemModel(readers=...)``, simulator only)."""
    stages = tuple(Stage(name, np.asarray(fits[name]["alpha"], dtype=float), np.asarray(fits[name]["T"], dtype=float))
                   for name in ("preview", "view"))
    if readers and lock:
        return TandemModel(float(arrival_rate), stages, locks=(1, None), readers=(False, True), commit_retry=BUSY_DELAYS)
    return TandemModel(float(arrival_rate), stages, locks=(1, None) if lock else None)


def serialises(probe: float, k: int) -> bool:
    """Whether the serialisation probe (``k`` identical requests at once, their mean completion
    over the last one's) says the requests ran one at a time: (k + 1)/(2k) then, 1 under processor
    sharing; a value in the lower quarter between the two counts as serial (the bench's previews
    give 0.67–0.69 for k = 4, its views 0.80–0.97)."""
    serial = (k + 1) / (2 * k)
    return probe <= serial + 0.25 * (1 - serial)


def _baseline(php: str) -> str:
    return "pi(inf)" if php == "prefork" else f"pi({WORKERS[php]})"


def predict(fits: Mapping[str, Mapping[str, Any]], arrival_rate: float, php: str, *, threshold_s: float | None = None,
            requests: int = 200_000, seed: int = 7, tol: float = 2e-3, without_lock: bool = True,
            journal: str | None = None) -> dict[str, Any]:
    """Mean response time (s) per transaction the model predicts for the arms (module docstring).

    ``threshold_s``: the age threshold of mod_overtake_prio (None: no ``passthrough+age``).
    Returns ``{"lock": {...}, "no_lock": {...}}`` (``no_lock`` only with ``without_lock``) with
    ``default``, ``blind``, ``optimum`` (and its thread cap) and, with a threshold,
    ``passthrough+age`` and its 95 % half-width (with the lock also ``passthrough+age_inverted``).
    ``journal`` ``delete`` (the rollback journal) adds, with the lock, ``default_readers`` and its
    half-width: the default simulated with the views reading under the lock (:func:`stack_model`).
    """
    if php not in WORKERS:
        raise ValueError(f"php: one of {', '.join(WORKERS)}, got {php!r}")
    out: dict[str, Any] = {}
    for key, lock in (("lock", True), ("no_lock", False))[: 2 if without_lock else 1]:
        model = stack_model(fits, arrival_rate, lock=lock)
        base = evaluate_baseline(model, _baseline(php), tol=tol).metrics
        cap = None if php == "prefork" else WORKERS[php]
        opt = solve(model, phase_info="start", tol=tol, max_states=400_000)
        blind = solve_observed(model, phase_info="none", tol=tol, max_threads=cap)
        fig: dict[str, Any] = {"default": base.mean_response_time, "blind": blind.metrics.mean_response_time,
                               "optimum": opt.metrics.mean_response_time, "optimum_threads": opt.truncation.k_max}
        if threshold_s is not None:
            prio = age_priority(model, [threshold_s])
            arms = {"passthrough+age": exempt_stages(prio, locked_stages(model))}
            if lock:
                arms["passthrough+age_inverted"] = prio
            for arm, levels in arms.items():
                sim = simulate(model, _baseline(php), requests=requests, seed=seed, cpu_priority=levels)
                fig[arm] = sim.mean_response_time
                fig[f"{arm}_ci95"] = sim.ci95
        if lock and journal == "delete":
            sim = simulate(stack_model(fits, arrival_rate, readers=True), _baseline(php), requests=requests, seed=seed)
            fig["default_readers"], fig["default_readers_ci95"] = sim.mean_response_time, sim.ci95
        out[key] = fig
    return out
