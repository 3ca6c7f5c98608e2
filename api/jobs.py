"""Solve and fit jobs run in worker processes, with progress and results in the store.

Solves and EM fits are CPU-bound and hold the GIL, so they run in a bounded
:class:`~concurrent.futures.ProcessPoolExecutor` (``spawn`` start method: no fork of a threaded
server) and the API stays responsive. A worker reads its job from the store, marks it running,
writes progress lines as the solver reports them, and stores the result — or the failure reason —
itself; the API process only submits ids and watches for a crashed pool.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .db import INTERRUPTED, Store

if TYPE_CHECKING:  # pragma: no cover
    from overtake.mdp.model import TandemModel
    from overtake.mdp.scenario import Scenario

log = logging.getLogger("overtake.api")


class _Reporter:
    """Turns the solver's progress lines into (fraction, message) rows, at most 5 writes a second."""

    def __init__(self, store: Store, job_id: str, steps: list[str]) -> None:
        self.store, self.job_id, self.steps = store, job_id, steps
        self.last = 0.0
        self.done = 0

    def step(self, index: int, message: str) -> None:
        self.done = max(self.done, index)
        self.store.progress(self.job_id, self.done / len(self.steps), message)
        self.last = time.monotonic()

    def __call__(self, message: str) -> None:
        for i, name in enumerate(self.steps):
            if message.startswith(name + ":"):
                self.done = max(self.done, i)
        now = time.monotonic()
        if now - self.last >= 0.2:
            self.store.progress(self.job_id, self.done / len(self.steps), message)
            self.last = now


def estimate_states(scenario: Scenario, model: TandemModel) -> int:
    """States of the largest space :func:`run_model` builds, without building it.

    The larger of π*'s largest MDP (:func:`overtake.mdp.optimum.estimate_states`: exact for a
    fixed truncation) and the π(∞) baseline's chain, which grows with the load
    (:func:`overtake.mdp.rule_evaluation.ps_chain_states`: exact).
    """
    from overtake.mdp.optimum import estimate_states as mdp_states
    from overtake.mdp.rule_evaluation import ps_chain_states

    return max(mdp_states(model, scenario.fixed_truncation()), ps_chain_states(model, tol=scenario.tolerance))


def run_model(store: Store, job_id: str) -> None:
    """Solve π* (paper 004 §3, auto-truncation), extract the overtaking rules, compare with baselines."""
    from overtake.mdp import solve
    from overtake.mdp.comparison import compare, default_baselines
    from overtake.mdp.rules import overtaking_rule
    from overtake.mdp.scenario import parse_scenario

    job = store.get(job_id)
    assert job is not None
    sc = parse_scenario(job.request["scenario"])
    model = sc.build_model()
    baselines = default_baselines(model.n_stages)
    rep = _Reporter(store, job_id, ["pi*", "rules", *baselines])
    opt = solve(model, truncation=sc.fixed_truncation(), tol=sc.tolerance, progress=rep,
                phase_info=sc.phase_info, routes=sc.build_routes(model))
    rep.step(1, "extracting the overtaking rules")
    # the rules read pi*'s phase-known decisions; a policy over counts has none to read
    rules = overtaking_rule(opt.solve, opt.policy).to_dict() if sc.phase_info == "full" else None  # type: ignore[arg-type]
    rep.step(2, "evaluating the baselines")
    doc = compare(model, tol=sc.tolerance, truncation=sc.fixed_truncation(), progress=rep, optimum=opt)
    pol = opt.policy
    pol.meta.update(metrics=opt.metrics.to_dict(), gain_bounds=list(opt.solve.gain_bounds),
                    truncation_trace=opt.trace, method=opt.solve.method, rules=rules)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.npz"
        pol.save(path)
        artifact = path.read_bytes()
    result = {"metrics": opt.metrics.to_dict(), "comparison": doc, "rules": rules, "policy_hash": pol.digest(),
              "columns": pol.columns, "phase_info": pol.phase_info, "max_requests": pol.max_requests,
              "max_threads": pol.max_threads, "states": int(pol.keys.size)}
    store.finish(job_id, result, artifact)


def run_fit(store: Store, job_id: str) -> None:
    """EM fit of a phase-type distribution per stage (as ``overtake fit``)."""
    import numpy as np

    from overtake.fitting import FittingInputError, fit_observations, samples

    job = store.get(job_id)
    assert job is not None
    opts = job.request["options"]
    data: dict[str, list[float]] = job.request["samples"]
    out: dict[str, Any] = {}
    for i, (name, xs) in enumerate(data.items()):
        store.progress(job_id, i / len(data), f"fitting stage {name!r} ({len(xs)} samples)")
        try:
            obs = samples(np.asarray(xs, dtype=np.float64))
        except FittingInputError as exc:
            raise type(exc)(f"samples.{name}: {exc}") from None
        res = fit_observations(obs, structure=opts["structure"], order=opts["order"],
                               preserve_mean=opts["preserve_mean"], random_state=opts["seed"],
                               max_iter=opts["max_iter"])
        out[name] = res.to_dict()
    store.finish(job_id, {"stages": out})


def execute(db_url: str, job_id: str) -> str:
    """Worker entry point: run one job; every exception becomes the job's failure reason."""
    store = Store(db_url)
    if not store.start(job_id):
        return "skipped"
    job = store.get(job_id)
    assert job is not None
    try:
        (run_model if job.kind == "model" else run_fit)(store, job_id)
    except ValueError as exc:  # input errors name the field (mdp/errors.py, fitting/errors.py)
        store.fail(job_id, str(exc))
        return "failed"
    except Exception as exc:  # a solver bug or limit: keep the reason, not a silent stall
        log.error("job %s failed:\n%s", job_id, traceback.format_exc())
        store.fail(job_id, f"{type(exc).__name__}: {exc}")
        return "failed"
    return "done"


def _warm() -> None:
    """Import the solver once per worker so the first job does not pay for it."""
    import overtake.fitting as fitting  # noqa: F401
    import overtake.mdp as mdp  # noqa: F401


class JobRunner:
    """Bounded pool of solver processes: at most ``workers`` jobs run at once."""

    def __init__(self, store: Store, *, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.store = store
        self.workers = workers
        self._lock = threading.Lock()
        self._closing = False
        self._pool = self._new_pool()
        self._futures: dict[str, Future[str]] = {}

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_warm)

    def submit(self, job_id: str) -> None:
        with self._lock:
            try:
                fut = self._pool.submit(execute, self.store.url, job_id)
            except BrokenProcessPool:  # a worker died earlier: start a fresh pool
                self._pool = self._new_pool()
                fut = self._pool.submit(execute, self.store.url, job_id)
            self._futures[job_id] = fut
        fut.add_done_callback(functools.partial(self._done, job_id))

    def _done(self, job_id: str, fut: Future[str]) -> None:
        with self._lock:
            self._futures.pop(job_id, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            return
        # the worker died (killed, out of memory, or stopped by shutdown): the running job fails,
        # a queued one runs again
        reason = INTERRUPTED if self._closing else f"worker process failed: {type(exc).__name__}: {exc}"
        self.store.fail(job_id, reason, only_running=True)
        job = self.store.get(job_id)
        if not self._closing and job is not None and job.status == "queued":
            self.submit(job_id)

    @property
    def pending(self) -> int:
        return len(self._futures)

    def shutdown(self) -> None:
        """Stop now: queued jobs stay queued (re-queued at the next start); running ones are failed."""
        self._closing = True
        procs = list((getattr(self._pool, "_processes", None) or {}).values())  # no public handle on them
        self._pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(5)
        self.store.fail_running(INTERRUPTED)
