"""The online loop's asyncio side: rate-limited refits in a worker process, the decision, the hot swap.

Package docstring (:mod:`overtake.controller.online`) for what is estimated and when a refit is
skipped. A refit runs :func:`overtake.controller.online.refit_job` in one worker process (the
event loop never blocks); the new policy is installed through the sidecar's atomic swap only if
its predicted E[W] beats the running policy's by more than ``margin``. Every decision is one JSON
log line (``event = online_refit``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from overtake.controller.online.decision import check_window, refit_record, resolve_target, thresholds_moved
from overtake.controller.online.estimators import DemandRecorder
from overtake.controller.online.lockwatch import LockWatch
from overtake.controller.online.refit import RefitJob, refit_job
from overtake.controller.online.settings import OUTCOMES, OnlineSettings
from overtake.controller.online.worker import RefitWorker, discard
from overtake.controller.sidecar.control_file import age_thresholds as policy_age_thresholds
from overtake.controller.sidecar.policies import SpawnPolicy, TablePolicy
from overtake.controller.sidecar.stages import StageTable

__all__ = ["OnlineLoop"]

log = logging.getLogger("overtake.sidecar")

#: answered requests of a stage, none with a demand, before module mode's loop warns that the
#: stage's refits will wait for samples
NO_DEMAND_SAY = 50


class OnlineLoop:
    """Refits, re-solves and swaps, rate limited, from what :attr:`recorder` has heard.

    ``policy`` is the policy at start, ``current()`` returns the running one, ``swap(path)``
    installs a policy file through the sidecar's atomic path (raising on refusal). The sidecar
    subscribes :attr:`recorder` (a :class:`~overtake.controller.online.DemandRecorder`) to its
    limiter with :meth:`overtake.controller.sidecar.limiter.Limiter.add_listener`."""

    def __init__(
        self,
        settings: OnlineSettings,
        *,
        table: StageTable,
        time_unit: float,
        policy: SpawnPolicy,
        current: Callable[[], SpawnPolicy],
        swap: Callable[[str], SpawnPolicy],
        classifier_mode: str = "explicit",
        age_thresholds: bool = False,
        cores: int | None = None,
        overhead: float | None = None,
        executor: Executor | None = None,
        job: Callable[[RefitJob], dict[str, Any]] = refit_job,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.table = table
        self.names = table.names
        #: ``lock: auto`` stages' learned capacities (controller.online.lockwatch)
        self.learned_locks: dict[int, int | None] = {}
        self._lock_said = False
        self._routing_said = False
        self._no_demand_said: set[str] = set()  # stages warned of: their answers give no demand
        self.time_unit = time_unit
        self.current = current
        self._swap = swap
        self.classifier_mode = classifier_mode
        #: refits also choose age thresholds (the sidecar writes them to its control file)
        self.age_thresholds = age_thresholds
        # the processor (cores m, overhead δ) is the running policy's model's, else one core
        model = policy.policy.model if isinstance(policy, TablePolicy) else None
        self.cores = cores if cores is not None else (model.cores if model is not None else 1)
        self.overhead = overhead if overhead is not None else (model.overhead if model is not None else 0.0)
        self.clock = clock
        self.wall = wall
        self.recorder = DemandRecorder(settings, table, time_unit=time_unit, cores=self.cores,
                                       overhead=self.overhead, clock=clock)
        #: serialisation verdicts per stage, from the access log's time split (with --access-log)
        self.lock_watch = LockWatch(table, clock=clock) if self.recorder.tail is not None else None
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.last_refit_start: float | None = None  # monotonic
        self.last_refit_time: float | None = None  # unix time of the last completed refit
        self.last: dict[str, Any] = {}  # the last decision's record
        self.generation = 0  # policies swapped in by this loop
        self.solve_cpu: dict[str, float] = {}  # CPU seconds of the refit jobs, by kind of solve (phase_info)
        #: the worker process the refit jobs run in, and their policy files
        self.worker = RefitWorker(settings.policy_dir, executor, job)
        self._busy = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def locks(self) -> tuple[int | None, ...] | None:
        """The stages' locks the refits solve with: ``lock: m``, and the learned ones of ``lock: auto``."""
        locks = tuple(self.table.lock(i) if not self.table.lock_auto(i) else self.learned_locks.get(i)
                      for i in range(len(self.names)))
        return locks if any(m is not None for m in locks) else None

    def set_time_unit(self, seconds: float) -> None:
        """Run at a new time unit (the sidecar's changed): the held samples are rescaled; the
        last decision keeps the unit it was made in (``time_unit`` in its record)."""
        self.recorder.set_time_unit(seconds)
        self.time_unit = seconds

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker process and the refit (and access-log) tasks on the running loop."""
        self.worker.warm()
        self._tasks.append(asyncio.create_task(self._run()))
        if self.recorder.tail is not None:
            self._tasks.append(asyncio.create_task(self._tail()))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refit_interval)
            try:
                await self.refit()
            except Exception as exc:  # never let the loop die; the reason is logged
                log.error("online refit crashed", extra={"event": "online_refit", "outcome": "failed",
                                                         "detail": f"{type(exc).__name__}: {exc}"})

    async def _tail(self) -> None:
        while True:
            await asyncio.sleep(self.settings.log_poll)
            try:
                await self.poll_log()
            except OSError as exc:
                log.warning("access log unreadable", extra={"event": "online_log", "detail": str(exc)})

    async def poll_log(self) -> None:
        """Read the access log's new lines: demands to the recorder, time splits to the lock watch."""
        tail = self.recorder.tail
        if tail is None:
            return
        entries = await asyncio.to_thread(tail.poll_entries)
        self.recorder.poll_log([(e.stage, e.cpu) for e in entries])
        self._say_no_demand()
        if self.lock_watch is not None:
            for e in entries:
                if e.times is not None and e.status == 200:
                    self.lock_watch.add(e.stage, e.times)
            self.lock_watch.table = self.table  # the stages file may have been reloaded
            self.lock_watch.check()

    def _say_no_demand(self) -> None:
        """Once per stage: warn when its answered requests give the refit no demand, where the log is
        the only source (module mode), after enough of them that a stray line does not count."""
        tail = self.recorder.tail
        if tail is None or not self.settings.arrivals_from_log:
            return
        for name, n in tail.no_demand.items():
            if n >= NO_DEMAND_SAY and not tail.with_demand[name] and name not in self._no_demand_said:
                self._no_demand_said.add(name)
                why = tail.why_no_demand(name)
                log.warning(f"online: stage {name}: {n} answered requests gave no service demand; its refits wait "
                            f"for samples: {why}",
                            extra={"event": "online_no_demand", "detail": {"stage": name, "lines": n, "why": why}})

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        self.worker.close()

    # ---- one refit ---------------------------------------------------------------------------
    def _decide(self, outcome: str, record: dict[str, Any], level: int = logging.INFO) -> str:
        self.outcomes[outcome] += 1
        record = {"outcome": outcome, **record}
        self.last = record
        if not outcome.startswith("skipped_rate") and not outcome.startswith("skipped_busy"):
            self.last_refit_time = self.wall()
        log.log(level, f"online refit: {outcome}", extra={"event": "online_refit", "outcome": outcome,
                                                           "reason": record.get("reason"), "refit": record})
        return outcome

    async def refit(self) -> str:
        """One refit attempt; returns its outcome (one of :data:`OUTCOMES`)."""
        now = self.clock()
        s = self.settings
        if self._busy:
            return self._decide("skipped_busy", {"reason": "a refit is still running"}, logging.DEBUG)
        if self.last_refit_start is not None and now - self.last_refit_start < s.refit_interval:
            return self._decide("skipped_rate_limited", {
                "reason": f"last refit {now - self.last_refit_start:.3g} s ago < refit interval {s.refit_interval:g} s"},
                logging.DEBUG)
        chosen = [self.recorder.choose(i) for i in range(len(self.names))]
        lam = self.recorder.arrival_rate()
        base, skip = check_window(self.names, chosen, lam, self.time_unit, self.cores, s)
        if skip is not None:
            return self._decide(skip[0], {**base, "reason": skip[1]})
        assert lam is not None  # a window without arrivals was skipped
        pol = self.current()
        target = resolve_target(pol, len(self.names), self.classifier_mode)
        if target is None:  # pragma: no cover - only the two policy families exist
            return self._decide("failed", {**base, "reason": f"policy type {type(pol).__name__} unknown"})
        job = self._job_for(chosen, lam * self.time_unit, *target)
        self.last_refit_start = now
        self._busy = True
        t0 = time.perf_counter()
        try:
            res = await self.worker.run(job)
        except Exception as exc:
            return self._decide("failed", {**base, "reason": f"{type(exc).__name__}: {exc}",
                                           "policy": pol.name}, logging.ERROR)
        finally:
            self._busy = False
        return self._conclude(job, res, pol, refit_record(base, res, time.perf_counter() - t0, pol.name,
                                                          job.time_unit))

    def _job_for(self, chosen: list[tuple[str, Any]], lam_model: float, current: Any,
                 orders: tuple[int | None, ...], phase_info: str, routes: Any) -> RefitJob:
        """The refit job for the window's samples, re-solving for what the running policy uses."""
        s = self.settings
        return RefitJob(
            stage_names=self.names, samples=tuple(x for _, x in chosen), arrival_rate=lam_model,
            cores=self.cores, overhead=self.overhead, orders=orders, max_order=s.max_order,
            phase_info=phase_info, current=current, tolerance=s.tolerance, out=self.worker.out_path(),
            margin=s.margin, time_unit=self.time_unit, age_thresholds=self.age_thresholds, routes=routes,
            locks=self.locks, pairs=self._pairs(phase_info, current),
        )

    def _conclude(self, job: RefitJob, res: dict[str, Any], pol: SpawnPolicy, rec: dict[str, Any]) -> str:
        """Decide on a finished refit: keep the running policy or swap its policy in."""
        s = self.settings
        if res.get("lock_ignored") and not self._lock_said:
            self._lock_said = True  # the same every refit: said once
            log.warning("online refit: solving without the stages' locks", extra={
                "event": "online_lock_ignored", "detail": f"{job.phase_info} re-solve: {res['lock_ignored']}"})
        self.solve_cpu[res["kind"]] = self.solve_cpu.get(res["kind"], 0.0) + res["cpu_seconds"]
        u = job.time_unit  # predictions are in its model units; the reasons say seconds
        if job.phase_info == "route" and res["seconds"]["solve"] > s.refit_interval:
            discard(job.out)
            return self._decide("skipped_route", {**rec, "reason": (
                f"the route re-solve took {res['seconds']['solve']:.3g} s, longer than the refit interval "
                f"{s.refit_interval:g} s: its policy would follow data older than one interval; raise --refit-interval")})
        if self.current().hash != pol.hash:
            discard(job.out)
            return self._decide("skipped_superseded", {**rec, "reason": "the policy was swapped while the refit ran"})
        new_w, cur_w = res["predicted_new"], res["predicted_current"]
        moved = thresholds_moved(policy_age_thresholds(pol), res.get("age_thresholds"), u) \
            if job.age_thresholds else None
        better = new_w < cur_w * (1.0 - s.margin)
        if not better and moved is None:
            discard(job.out)
            return self._decide("kept", {**rec, "reason": f"predicted E[W] {new_w * u:.6g} s is not better than the "
                                         f"current {cur_w * u:.6g} s by more than {s.margin:.1%}"})
        try:
            installed = self._swap(job.out)
        except (ValueError, OSError) as exc:
            discard(job.out)
            return self._decide("failed", {**rec, "reason": f"swap refused: {exc}"}, logging.ERROR)
        self.generation += 1
        self.worker.prune(keep=job.out)
        why = (f"predicted E[W] {new_w * u:.6g} s < current {cur_w * u:.6g} s" if better
               else f"predicted E[W] {new_w * u:.6g} s is not better than the current {cur_w * u:.6g} s, but {moved}")
        return self._decide("swapped", {**rec, "reason": why,
                                        "generation": self.generation, "new_policy": installed.name})

    def _pairs(self, phase_info: str, current: Any) -> tuple[Any, ...] | None:
        """The linked transactions' demand pairs the refit fits the routing on (coupled stages), or
        None for independent stages. Coupled stages are solved with full phase information only,
        and paired only where the stages file links a stage to the next (``next``: the sidecar
        sees both requests of one transaction on one connection). A running model with a routing
        that cannot be paired again is refitted independently, and the log says why once."""
        rec = self.recorder
        had = getattr(getattr(current, "model", None), "routing", None) is not None
        if phase_info != "full" or not any(rec.linked):
            if had and not self._routing_said:
                self._routing_said = True
                why = (f"the running policy sees {phase_info!r}, coupled stages are solved with full" if
                       phase_info != "full" else "no stage names the next in the stages file (next:), so the "
                       "sidecar cannot tell which requests make one transaction")
                log.warning("online refit: the running model's routing is not refitted", extra={
                    "event": "online_routing_dropped", "detail": f"{why}; the refit fits independent stages"})
            return None
        out = tuple(p if linked and len(p) >= self.settings.min_samples else None
                    for p, linked in ((rec.paired(i), rec.linked[i]) for i in range(len(rec.linked))))
        if all(p is None for p in out) and not had:
            return None  # too few pairs yet, and nothing coupled to keep: as before
        return out

    def status(self) -> dict[str, Any]:
        """For ``GET /-/policy``."""
        out = {"generation": self.generation, "refits": dict(self.outcomes), "last": self.last,
               "last_refit_time": self.last_refit_time}
        if self.lock_watch is not None:
            out["serialisation"] = self.lock_watch.status()
        return out
