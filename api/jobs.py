"""Solve and fit jobs run in worker processes, with progress and results in the store.

Solves and EM fits are CPU-bound and hold the GIL, so they run in solver processes
(:class:`~overtake.api.worker.Worker`: spawned, no fork of a threaded server), at most
``--workers`` at once, and the API stays responsive. A worker reads its job from the store,
marks it running, writes progress lines as the solver reports them, and stores the result — or
the failure reason — itself. The API process (:class:`JobRunner`) hands out ids in order and
stops a job at its deadline or on a cancel by terminating its process.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .db import INTERRUPTED, Store
from .errors import WorkerDiedError, WorkerTimeoutError
from .worker import Worker

if TYPE_CHECKING:  # pragma: no cover
    from overtake.mdp.model import TandemModel
    from overtake.mdp.scenario import Scenario

log = logging.getLogger("overtake.api")

#: seconds a job may run; ``overtake api --job-deadline``
DEFAULT_JOB_DEADLINE = 3600.0


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
    """Solve π* (van der Weij et al., "Dynamic thread assignment", §3; auto-truncation), extract the
    overtaking rules, compare with baselines."""
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
                    truncation_trace=opt.trace, method=opt.solve.method, rules=rules, time_unit=sc.time_unit)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.npz"
        pol.save(path)
        artifact = path.read_bytes()
    result = {"metrics": opt.metrics.to_dict(), "comparison": doc, "rules": rules, "policy_hash": pol.digest(),
              "columns": pol.columns, "phase_info": pol.phase_info, "max_requests": pol.max_requests,
              "max_threads": pol.max_threads, "states": int(pol.keys.size), "time_unit": sc.time_unit}
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


def deadline_reason(deadline: float) -> str:
    """The failure reason of a job stopped at its deadline: the limit, and how to raise it."""
    return (f"deadline: still running after the job deadline of {deadline:g} s, so it was stopped; raise the "
            f"deadline (overtake api --job-deadline SECONDS) or post a smaller job (a smaller truncation, fewer "
            f"phases, a lower load, fewer samples)")


def cancelled_reason(kind: str, job_id: str) -> str:
    return f"cancelled: DELETE /v1/{kind}s/{job_id} stopped it; post it again to run it"


class JobRunner:
    """At most ``workers`` jobs run at once, each in a solver process of its own, for at most
    ``deadline`` seconds.

    One thread per process (a slot) takes the oldest queued id, hands it to its process and
    waits for the answer up to the deadline. A job past it, or cancelled, has its process
    terminated; the slot starts a fresh one and the other slots never notice. A process that
    dies (out of memory, killed) fails the job it was running. ``entry`` is what a process runs
    for a job (:func:`execute`; tests inject a job that never ends).

    Store writes of the runner happen under its lock and never once :meth:`shutdown` has begun:
    shutdown fails the running jobs itself, synchronously, and returns with every slot thread
    and process gone, so nothing writes to the store after it.
    """

    def __init__(self, store: Store, *, workers: int = 1, deadline: float = DEFAULT_JOB_DEADLINE,
                 entry: Callable[[str, str], str] = execute) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not deadline > 0:
            raise ValueError(f"deadline must be > 0 seconds, got {deadline}")
        self.store = store
        self.workers = workers
        self.deadline = deadline
        self._entry = entry
        self._cond = threading.Condition()
        self._queue: deque[str] = deque()
        self._running: dict[str, Worker] = {}  # job id -> the process running it
        self._cancelled: set[str] = set()
        self._processes: set[Worker] = set()
        self._closing = False
        self._slots = [threading.Thread(target=self._slot, name=f"overtake-jobs-{i}", daemon=True)
                       for i in range(workers)]
        for t in self._slots:
            t.start()

    @property
    def pending(self) -> int:
        """Jobs handed to this runner and not ended: queued here or running."""
        with self._cond:
            return len(self._queue) + len(self._running)

    def pids(self) -> list[int]:
        """The solver processes' ids."""
        with self._cond:
            return sorted(w.pid for w in self._processes if w.pid is not None)

    def submit(self, job_id: str) -> None:
        """Queue a stored job; after :meth:`shutdown` it stays queued in the store (run at the next start)."""
        with self._cond:
            if self._closing:
                return
            self._queue.append(job_id)
            self._cond.notify()

    def cancel(self, job_id: str, reason: str) -> bool:
        """Cancel a queued or running job (its process terminated first); False when it had ended."""
        with self._cond:
            if self._closing:
                return False
            if job_id in self._queue:
                self._queue.remove(job_id)
            worker = self._running.get(job_id)
            if worker is not None:
                self._cancelled.add(job_id)  # its slot writes nothing for it
                worker.stop()  # reaped: it writes nothing more either
            return self.store.cancel(job_id, reason)

    def shutdown(self) -> None:
        """Stop now: queued jobs stay queued (re-queued at the next start); running ones are failed."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
            workers = list(self._processes)
        for w in workers:
            w.stop()
        for t in self._slots:
            t.join(30)
        self.store.fail_running(INTERRUPTED)

    # ---- a slot: one thread, one process at a time -----------------------------------------
    def _slot(self) -> None:
        worker: Worker | None = None
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if self._closing:
                        return
                # the process starts with the slot's first job (an idle server runs none, and the
                # API's start is not slowed by the solver's imports), and stays for the next
                if worker is None and (worker := self._start_process()) is None:
                    return
                with self._cond:
                    if self._closing:
                        return
                    if not self._queue:  # cancelled while the process started
                        continue
                    job_id = self._queue.popleft()
                    self._running[job_id] = worker
                if not self._run(worker, job_id):
                    self._retire(worker)
                    worker = None
        except Exception:  # a bug here would silently lose a slot: say so
            log.exception("job slot %s stopped", threading.current_thread().name)
        finally:
            if worker is not None:
                self._retire(worker)

    def _start_process(self) -> Worker | None:
        """A fresh solver process, once it has imported; None when shutting down."""
        while True:
            with self._cond:
                if self._closing:
                    return None
                worker = Worker(_warm, name="overtake-job")
                self._processes.add(worker)
            try:
                worker.wait_ready()
                return worker
            except WorkerDiedError as exc:
                self._retire(worker)
                with self._cond:
                    if self._closing:
                        return None
                log.error("a solver process ended while starting (%s); starting another", exc)
                time.sleep(1.0)

    def _retire(self, worker: Worker) -> None:
        with self._cond:
            self._processes.discard(worker)
        worker.close()

    def _run(self, worker: Worker, job_id: str) -> bool:
        """One job in ``worker``; False when the process is gone (ended, or stopped here)."""
        ended: str | None = None
        try:
            worker.call(self._entry, (self.store.url, job_id), {}, self.deadline)
        except WorkerTimeoutError:
            worker.stop()
            ended = deadline_reason(self.deadline)
        except WorkerDiedError as exc:
            ended = f"worker process failed ({exc}: out of memory, or killed?); post the job again"
        except Exception as exc:  # execute() itself failed (the store is unreadable?): the process lives on
            log.error("job %s could not run: %s: %s", job_id, type(exc).__name__, exc)
            ended = f"worker: {type(exc).__name__}: {exc}"
        with self._cond:
            self._running.pop(job_id, None)
            cancelled = job_id in self._cancelled
            self._cancelled.discard(job_id)
            if ended is not None and not cancelled and not self._closing:
                # queued too: a process that died before it started the job failed it all the same
                self.store.fail(job_id, ended)
        return worker.process.exitcode is None
