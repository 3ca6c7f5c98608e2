"""The online loop: measure service demand and arrivals, refit the PH model, re-solve, hot-swap (issue #5).

Netflix concurrency-limits' split between algorithm and enforcement: the
:class:`overtake.controller.limiter.Limiter` enforces; this module only *observes* it
(:class:`RecordingLimiter` reports every arrival, admission and completion instant) and, rate
limited, proposes a new policy through the sidecar's existing atomic swap path.

Estimates
---------
* **Service demand per completed stage request**, two sources, the log preferred:

  - ``access_log`` — Apache's own note of the thread CPU the stage handler burnt
    (``cpu_us=%{stage_cpu_us}n`` in :data:`overtake.controller.apache.LOG_FORMAT`), tailed from the
    access log given with ``--access-log``;
  - ``attained`` — the attained service under processor sharing (paper 004, §2: with K active
    threads each progresses at rate c(K)/K, c(K) = min(K, m)/(1 + δK)):
    ``S = ∫_{admit}^{done} c(K(t))/K(t) dt``, K(t) the stage requests the limiter has admitted
    (the sidecar sees every change of K, so the integral is exact for the model). It assumes
    Apache's threads own the m cores: on a shared machine it counts CPU taken by other processes
    as service (measured: bench/online_refit.py), hence the log's CPU notes are preferred.

  A stage uses the log's samples when it has ``min_samples`` of them, else the attained ones;
  the decision log and ``overtake_online_fitted_mean_seconds{source}`` say which.
  Each (stage, source) keeps the latest ``reservoir`` samples (a sliding window, so the fit
  follows drift).
* **Arrival rate** λ of transactions: arrivals to the first stage in the last
  ``arrival_window`` seconds (bucketed counts, O(1) memory).

Refit (at most once per ``refit_interval``; skipped with a logged reason when a stage has fewer
than ``min_samples`` samples or the estimated load λ·ΣE[S]/m ≥ ``max_load``): in a worker
process (:class:`concurrent.futures.ProcessPoolExecutor`, one worker; the event loop never
blocks) :func:`refit_job` fits a PH per stage by EM (:func:`overtake.fitting.fit`, order 1 or 2 by BIC,
hyperexponential for SCV > 1 else CF1, mean preserved), builds the :class:`overtake.mdp.TandemModel`,
solves π* (:func:`overtake.mdp.solve_optimal`) and evaluates the *current* policy exactly under the
*new* model (:func:`overtake.mdp.truncation.evaluate_rule`, both on one evaluation cap). The new policy
is swapped in only if its predicted E[W] is lower by more than ``margin`` (default 1 %).
Every decision is one JSON log line (``event = online_refit``) and counted in
``overtake_online_refits_total{outcome}``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from overtake.controller.errors import SidecarInputError
from overtake.controller.limiter import ADMITTED, PASSTHROUGH, Limiter, Ticket
from overtake.controller.policies import BaselinePolicy, SpawnPolicy, TablePolicy
from overtake.controller.stages import StageTable

__all__ = [
    "OUTCOMES", "AccessLogTail", "ArrivalRate", "AttainedService", "OnlineCollector", "OnlineLoop",
    "OnlineSettings", "RecordingLimiter", "RefitJob", "capacity", "refit_job",
]

log = logging.getLogger("overtake.sidecar")

FloatArray = npt.NDArray[np.float64]

#: values of the ``outcome`` label of ``overtake_online_refits_total``
OUTCOMES = ("swapped", "kept", "failed", "skipped_samples", "skipped_load", "skipped_rate_limited",
            "skipped_busy", "skipped_superseded")
SOURCES = ("access_log", "attained")
_READ_MAX = 4 << 20  # bytes of access log parsed per poll (the rest at the next poll)


def capacity(k: int, cores: int, overhead: float) -> float:
    """c(K) = min(K, m) / (1 + δ·K): total service rate with K active threads (paper 004 §2,
    δ > 0 the thread-overhead extension of :mod:`overtake.mdp.model`)."""
    return min(k, cores) / (1.0 + overhead * k) if k > 0 else 0.0


@dataclass(frozen=True)
class OnlineSettings:
    """Options of the online loop (``overtake sidecar --online ...``). Times in seconds."""

    refit_interval: float = 60.0  #: at most one refit per interval
    min_samples: int = 200  #: per stage, before a refit is tried
    arrival_window: float = 60.0  #: λ is estimated over this window
    reservoir: int = 2000  #: latest demand samples kept per (stage, source)
    margin: float = 0.01  #: swap only if E[W] improves by more than this fraction
    max_load: float = 0.95  #: skip refits at or above this estimated load
    max_order: int = 2  #: PH order chosen by BIC in 1..max_order (when not pinned)
    tolerance: float = 1e-2  #: solve_optimal's relative accuracy of E[W]
    access_log: str | None = None  #: Apache access log (LOG_FORMAT) to take CPU demands from
    log_poll: float = 1.0  #: seconds between reads of the access log
    policy_dir: str | None = None  #: where new policies are written (default: a temporary dir)

    def __post_init__(self) -> None:
        checks = (
            ("refit-interval", self.refit_interval > 0 and math.isfinite(self.refit_interval), "a number of seconds > 0, e.g. 60"),
            ("min-samples", self.min_samples >= 2, "an integer >= 2, e.g. 200"),
            ("arrival-window", self.arrival_window > 0 and math.isfinite(self.arrival_window), "a number of seconds > 0, e.g. 60"),
            ("reservoir", self.reservoir >= self.min_samples, f"an integer >= --min-samples ({self.min_samples})"),
            ("swap-margin", 0 <= self.margin < 1, "a fraction in [0, 1), e.g. 0.01"),
            ("max-load", 0 < self.max_load < 1, "a load in (0, 1), e.g. 0.95"),
            ("max-order", 1 <= self.max_order <= 4, "an integer 1..4 (larger orders make the MDP too big to re-solve online)"),
            ("refit-tolerance", 0 < self.tolerance < 0.5, "a fraction in (0, 0.5), e.g. 0.01"),
            ("log-poll", self.log_poll > 0, "a number of seconds > 0"),
        )
        for name, ok, fix in checks:
            if not ok:
                raise SidecarInputError(f"--{name}: must be {fix}")
        if self.access_log is not None and not Path(self.access_log).parent.is_dir():
            raise SidecarInputError(
                f"--access-log: directory of {self.access_log!r} does not exist; give WORKDIR/logs/access.log "
                "of `overtake apache start --workdir WORKDIR`"
            )


# ---- estimators ------------------------------------------------------------------------------
class AttainedService:
    """Attained service under processor sharing: S = ∫ c(K(t))/K(t) dt over the request's stay.

    One virtual clock V(t) = ∫ c(K)/K dt advanced at every change of K; a request's attained
    service is V(done) − V(admit) (K constant between events, so this is exact)."""

    def __init__(self, cores: int = 1, overhead: float = 0.0) -> None:
        self.cores = cores
        self.overhead = overhead
        self.k = 0
        self.v = 0.0
        self._t: float | None = None
        self._start: dict[int, float] = {}

    def _advance(self, now: float) -> None:
        if self._t is not None and self.k:
            self.v += (now - self._t) * capacity(self.k, self.cores, self.overhead) / self.k
        self._t = now

    def admit(self, key: int, now: float) -> None:
        self._advance(now)
        self._start[key] = self.v
        self.k += 1

    def release(self, key: int, now: float) -> float | None:
        """End ``key``'s stay; its attained service (None if it was never admitted here)."""
        start = self._start.pop(key, None)
        if start is None:
            return None
        self._advance(now)
        self.k -= 1
        return self.v - start


class ArrivalRate:
    """Arrivals per second over a sliding window, from counts in ``buckets`` equal buckets."""

    def __init__(self, window: float, start: float | None = None, buckets: int = 64) -> None:
        self.window = window
        self.width = window / buckets
        self.buckets = buckets
        self.start = start  # None: from the first arrival (no bias from an idle start-up)
        self.total = 0
        self._counts: deque[list[int]] = deque()  # [bucket index, count], oldest first

    def add(self, now: float, n: int = 1) -> None:
        if self.start is None:
            self.start = now
        b = int((now - self.start) // self.width)
        if self._counts and self._counts[-1][0] == b:
            self._counts[-1][1] += n
        else:
            self._counts.append([b, n])
        self.total += n
        self._trim(b)

    def _trim(self, b: int) -> None:
        while self._counts and self._counts[0][0] <= b - self.buckets:
            self._counts.popleft()

    def rate(self, now: float) -> float | None:
        """λ over the window ending at ``now`` (whole buckets plus the current partial one);
        None before any arrival or time has passed."""
        if self.start is None:
            return None
        b = int((now - self.start) // self.width)
        self._trim(b)
        span = min(now - self.start, (now - self.start) - (b - self.buckets + 1) * self.width)
        if span <= 0:
            return None
        return sum(c for _, c in self._counts) / span


class AccessLogTail:
    """New lines of Apache's access log since the last read: (stage index, CPU seconds)."""

    def __init__(self, path: str | os.PathLike[str], table: StageTable) -> None:
        import apachelogs  # type: ignore[import-untyped]  # no stubs upstream

        from overtake.controller.harness.apache import LOG_FORMAT

        self.path = Path(path)
        self.table = table
        self.parser = apachelogs.LogParser(LOG_FORMAT)
        try:  # only requests from now on: a long history would stall the first read
            self.offset = self.path.stat().st_size
        except FileNotFoundError:
            self.offset = 0
        self.bad_lines = 0
        self.no_cpu = 0

    def poll(self) -> list[tuple[int, float]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # rotated or truncated
            self.offset = 0
        if size == self.offset:
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(min(size - self.offset, _READ_MAX))
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        out = []
        for line in data[:end].decode("utf-8", errors="replace").split("\n"):
            if not line:
                continue
            try:
                e = self.parser.parse(line).directives
            except Exception:  # apachelogs.InvalidEntryError: a foreign line; counted, not fatal
                self.bad_lines += 1
                continue
            method, _, rest = str(e["%r"]).partition(" ")
            path = rest.rsplit(" ", 1)[0].partition("?")[0]
            routed = self.table.route(method, path)
            cpu = e["%{stage_cpu_us}n"]
            if routed is None or e["%>s"] != 200:
                continue
            if cpu is None:
                self.no_cpu += 1
                continue
            out.append((routed[0], int(cpu) / 1e6))
        return out


class RecordingLimiter(Limiter):
    """The limiter, reporting arrivals, admissions and completions of stage requests to ``recorder``
    (an :class:`OnlineLoop`); enforcement itself is unchanged."""

    recorder: OnlineLoop

    def submit(self, stage: int, phase: int, route: str) -> Ticket | None:
        if stage != PASSTHROUGH:
            self.recorder.on_arrival(stage, self.clock())
        return super().submit(stage, phase, route)

    def _admit(self, t: Ticket, now: float) -> None:
        super()._admit(t, now)
        if t.stage != PASSTHROUGH:
            self.recorder.on_admit(t, now)

    def release(self, t: Ticket, outcome: str, follow: tuple[int, int] | None = None) -> Ticket | None:
        if t.status == ADMITTED and t.stage != PASSTHROUGH:
            self.recorder.on_release(t, self.clock(), outcome)
        return super().release(t, outcome, follow)

    def claim(self, hold: Ticket, phase: int, route: str) -> Ticket | None:
        t = super().claim(hold, phase, route)
        if t is not None:
            self.recorder.on_arrival(t.stage, t.t_arrive)  # the follow-up's arrival is its claim
            if t.status == ADMITTED:  # attained service counts from the claim, not the reservation
                self.recorder.attained.release(id(t), t.t_admit)
                self.recorder.on_admit(t, t.t_admit)
        return t


# ---- the worker's job ------------------------------------------------------------------------
@dataclass(frozen=True)
class RefitJob:
    """Everything the worker process needs (picklable). Times in model units."""

    stage_names: tuple[str, ...]
    samples: tuple[FloatArray, ...]
    arrival_rate: float
    cores: int
    overhead: float
    orders: tuple[int | None, ...]  #: pinned PH order per stage, None = BIC over 1..max_order
    max_order: int
    phase_info: str
    current: str | Any  #: baseline name (e.g. "pi(1)") or the running mdp.Policy
    tolerance: float
    out: str  #: where to write the new policy
    margin: float = 0.01  #: the swap margin (decides when a common evaluation cap is needed)
    seed: int = 0


def _warm_up() -> None:
    import overtake.fitting as fitting  # noqa: F401
    import overtake.mdp as mdp  # noqa: F401


def _fit_stage(x: FloatArray, order: int | None, max_order: int, seed: int) -> dict[str, Any]:
    from overtake.fitting import fit

    scv = float(np.var(x) / np.mean(x) ** 2)
    best = None
    tried = []
    for k in ([order] if order else range(1, max_order + 1)):
        structure = "cf1" if k == 1 or scv <= 1 else "hyperexp"
        r = fit(x, structure=structure, order=k, preserve_mean=True, random_state=seed)
        tried.append({"order": k, "structure": structure, "bic": r.bic})
        if best is None or r.bic < best.bic:
            best = r
    assert best is not None
    a = np.asarray(best.ph.alpha, dtype=float)
    T = np.asarray(best.ph.T, dtype=float)
    if np.allclose(T, np.diag(np.diag(T))):
        # hyperexponential: phase 1 = shortest mean, so clients' phase headers keep one meaning
        idx = np.argsort(np.diag(T))  # most negative diagonal = highest rate = shortest mean
        a, T = a[idx], T[np.ix_(idx, idx)]
    return {"alpha": a, "T": T, "mean": float(best.ph.mean()), "order": int(a.size), "scv": scv,
            "structure": best.structure, "bic": tried, "n": int(x.size)}


def _grow(evaluate: Callable[[int], Any], start: int, tol: float) -> Any:
    from overtake.mdp.truncation import grow_requests

    return grow_requests(evaluate, start, tol, "current policy")[0]


def refit_job(job: RefitJob) -> dict[str, Any]:
    """Fit, solve π*, evaluate the current policy under the new model; write π* to ``job.out``.

    Runs in the worker process. Returns the fitted stages, both predicted E[W] (model units, on a
    common evaluation cap) and timings."""
    from overtake.mdp.baselines import Baseline
    from overtake.mdp.model import Stage, TandemModel
    from overtake.mdp.policy import Policy
    from overtake.mdp.statespace import Layout
    from overtake.mdp.truncation import evaluate_baseline, evaluate_rule, solve_optimal

    t0 = time.perf_counter()
    fits = [_fit_stage(np.asarray(x, dtype=float), o, job.max_order, job.seed)
            for x, o in zip(job.samples, job.orders)]
    t_fit = time.perf_counter() - t0
    model = TandemModel(job.arrival_rate, tuple(Stage(n, f["alpha"], f["T"]) for n, f in zip(job.stage_names, fits)),
                        cores=job.cores, overhead=job.overhead)
    opt = solve_optimal(model, phase_info=job.phase_info, tol=job.tolerance)  # type: ignore[arg-type]
    t_solve = time.perf_counter() - t0 - t_fit
    new = opt.metrics

    cur_name: str
    cur_error = None
    cur: Any = None
    try:
        if isinstance(job.current, str):
            cur_name = job.current
            b = Baseline.parse(job.current, model.n_stages)
            lay = Layout.build(model, "start")
            rule = b.rule(lay.queue_stage, model.coord_stage())

            def ev(C: int) -> Any:
                return evaluate_rule(model, lay, rule, max_requests=C, max_threads=b.max_threads)

            cur = evaluate_baseline(model, job.current, tol=job.tolerance).metrics
        else:
            old: Policy = job.current
            cur_name = str(old.meta.get("hash", old.digest()))
            if tuple(s.phases for s in old.model.stages) != tuple(s.phases for s in model.stages):
                raise ValueError("the running policy's phase counts differ from the refitted model's")
            lay = Layout.build(model, old.phase_info)

            def ev(C: int) -> Any:
                return evaluate_rule(model, lay, old.actions, max_requests=C, max_threads=old.max_threads)

            cur = _grow(ev, max(new.max_requests, old.max_requests), job.tolerance)
        # Each E[W] is within tol of its limit on its own cap. Where that could decide the swap,
        # evaluate both on one cap, the larger (their truncation residues then largely cancel).
        C = max(cur.max_requests, new.max_requests)
        if cur.mean_response_time < new.mean_response_time * (1.0 + job.margin + 2.0 * job.tolerance):
            if cur.max_requests < C:
                cur = ev(C)
            if new.max_requests < C:
                new = evaluate_rule(model, Layout.build(model, job.phase_info), opt.policy.actions,  # type: ignore[arg-type]
                                    max_requests=C, max_threads=opt.truncation.k_max)
        cur_w = float(cur.mean_response_time)
    except Exception as exc:  # unstable or unevaluable under the new model: any stable π* is better
        cur_w = math.inf
        cur_error = f"{type(exc).__name__}: {exc}"
    t_eval = time.perf_counter() - t0 - t_fit - t_solve
    pol = opt.policy
    pol.meta.update(
        metrics=new.to_dict(), method=opt.solve.method, gain_bounds=list(opt.solve.gain_bounds),
        online={"arrival_rate": job.arrival_rate, "samples": [f["n"] for f in fits],
                "current": cur_name, "current_mean_response_time": cur_w},
    )
    pol.save(job.out)
    return {
        "stages": [{"name": n, "mean": f["mean"], "order": f["order"], "scv": f["scv"], "structure": f["structure"],
                    "bic": f["bic"], "n": f["n"], "alpha": f["alpha"].tolist(), "T": f["T"].tolist()}
                   for n, f in zip(job.stage_names, fits)],
        "arrival_rate": job.arrival_rate,
        "load": job.arrival_rate * model.mean_service() / job.cores,
        "predicted_new": float(new.mean_response_time),
        "predicted_current": cur_w,
        "current": cur_name,
        "current_error": cur_error,
        "evaluation_cap": int(new.max_requests),
        "states": int(opt.solve.space.size),
        "truncation": [opt.truncation.max_requests, opt.truncation.k_max],
        "hash": pol.digest(),
        "path": job.out,
        "seconds": {"fit": t_fit, "solve": t_solve, "evaluate": t_eval, "total": time.perf_counter() - t0},
    }


# ---- the loop --------------------------------------------------------------------------------
@dataclass
class _StageEstimates:
    reservoirs: dict[str, deque[float]]
    observed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))


class OnlineLoop:
    """Records demand and arrivals from the limiter; refits, re-solves and swaps, rate limited.

    ``policy`` is the policy at start, ``current()`` returns the running one, ``swap(path)`` installs a policy file through the
    sidecar's atomic path (raising on refusal). Demands are stored in model time units
    (seconds / ``time_unit``)."""

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
        self.time_unit = time_unit
        self.current = current
        self._swap = swap
        self.classifier_mode = classifier_mode
        # the processor (cores m, overhead δ) is the running policy's model's, else one core
        model = policy.policy.model if isinstance(policy, TablePolicy) else None
        self.cores = cores if cores is not None else (model.cores if model is not None else 1)
        self.overhead = overhead if overhead is not None else (model.overhead if model is not None else 0.0)
        self.attained = AttainedService(self.cores, self.overhead)
        self.clock = clock
        self.wall = wall
        self.arrivals = [ArrivalRate(settings.arrival_window) for _ in self.names]
        self.stages = [_StageEstimates({s: deque(maxlen=settings.reservoir) for s in SOURCES}) for _ in self.names]
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.last_refit_start: float | None = None  # monotonic
        self.last_refit_time: float | None = None  # unix time of the last completed refit
        self.last: dict[str, Any] = {}  # the last decision's record
        self.generation = 0  # policies swapped in by this loop
        self._executor = executor
        self._own_executor = executor is None
        self._job = job
        self._busy = False
        self._tasks: list[asyncio.Task[None]] = []
        self._dir = Path(settings.policy_dir) if settings.policy_dir else None
        self._own_dir = self._dir is None
        self._seq = 0
        self.tail = AccessLogTail(settings.access_log, table) if settings.access_log else None

    # ---- observations (called by RecordingLimiter on the event loop; O(1)) -----------------
    def on_arrival(self, stage: int, now: float) -> None:
        self.arrivals[stage].add(now)

    def on_admit(self, t: Ticket, now: float) -> None:
        self.attained.admit(id(t), now)

    def on_release(self, t: Ticket, now: float, outcome: str) -> None:
        s = self.attained.release(id(t), now)
        if s is not None and outcome == "completed" and s > 0:
            self.add_demand(t.stage, s, "attained")

    def add_demand(self, stage: int, seconds: float, source: str) -> None:
        """One service-demand sample (seconds) of ``stage`` from ``source``."""
        st = self.stages[stage]
        st.reservoirs[source].append(seconds / self.time_unit)
        st.observed[source] += 1

    def poll_log(self, recs: list[tuple[int, float]] | None = None) -> int:
        """Add access-log samples (read now, or ``recs`` read by :meth:`AccessLogTail.poll`);
        number added. Runs on the event loop: the reservoirs are not shared with threads."""
        if self.tail is None:
            return 0
        if recs is None:
            recs = self.tail.poll()
        for stage, cpu in recs:
            if cpu > 0:
                self.add_demand(stage, cpu, "access_log")
        return len(recs)

    # ---- snapshot ----------------------------------------------------------------------------
    def arrival_rate(self) -> float | None:
        """λ (per second) of transactions: arrivals to the first stage in the window."""
        return self.arrivals[0].rate(self.clock())

    def _choose(self, stage: int) -> tuple[str, FloatArray]:
        res = self.stages[stage].reservoirs
        log = np.fromiter(res["access_log"], dtype=float)
        if log.size >= self.settings.min_samples:
            return "access_log", log
        # With an access log the log is the source: the attained estimate is biased whenever other
        # work shares Apache's cores. Its lines arrive a poll later than completions, so wait for
        # them; fall back only if the log has given nothing while 2 × min_samples requests completed
        # (a wrong --access-log path or format).
        if self.tail is not None and (log.size > 0 or len(res["attained"]) < 2 * self.settings.min_samples):
            return "access_log", log
        return "attained", np.fromiter(res["attained"], dtype=float)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        # start the worker and import fitting/mdp now, not at the first refit (seconds under load)
        self._pool().submit(_warm_up)
        self._tasks.append(asyncio.create_task(self._run()))
        if self.tail is not None:
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
                self.poll_log(await asyncio.to_thread(self.tail.poll))  # type: ignore[union-attr]
            except OSError as exc:
                log.warning("access log unreadable", extra={"event": "online_log", "detail": str(exc)})

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        if self._executor is not None and self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._own_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _pool(self) -> Executor:
        if self._executor is None:
            # spawn: no fork of a process running an event loop and threads
            self._executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return self._executor

    def _out_path(self) -> str:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="overtake-online-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        return str(self._dir / f"online-{os.getpid()}-{self._seq:04d}.npz")

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
        chosen = [self._choose(i) for i in range(len(self.names))]
        counts = {n: int(x.size) for n, (_, x) in zip(self.names, chosen)}
        sources = {n: src for n, (src, _) in zip(self.names, chosen)}
        lam = self.arrival_rate()
        base: dict[str, Any] = {"samples": counts, "source": sources,
                                "arrival_rate_per_second": lam}
        short = [n for n, c in counts.items() if c < s.min_samples]
        if short:
            return self._decide("skipped_samples", {**base, "reason": f"stages {short} have fewer than "
                                                    f"{s.min_samples} demand samples"})
        if not lam:
            return self._decide("skipped_samples", {**base, "reason": "no arrivals in the window"})
        means = [float(x.mean()) for _, x in chosen]
        lam_model = lam * self.time_unit
        load = lam_model * sum(means) / self.cores
        base.update(load=load, means_seconds={n: m * self.time_unit for n, m in zip(self.names, means)})
        if load >= s.max_load:
            return self._decide("skipped_load", {**base, "reason": f"estimated load {load:.3f} >= {s.max_load:g}: "
                                                 "the model has no stationary optimum to re-solve for"})
        pol = self.current()
        if isinstance(pol, TablePolicy):
            current: Any = pol.policy
            orders: tuple[int | None, ...] = tuple(pol.phases)  # keep the phase count: exact comparison
            phase_info = pol.policy.phase_info
        elif isinstance(pol, BaselinePolicy):
            current = pol.baseline.name
            orders = (None,) * len(self.names)
            phase_info = "start" if self.classifier_mode == "hidden" else "full"
        else:  # pragma: no cover - only the two policy families exist
            return self._decide("failed", {**base, "reason": f"policy type {type(pol).__name__} unknown"})
        job = RefitJob(
            stage_names=self.names, samples=tuple(x for _, x in chosen), arrival_rate=lam_model,
            cores=self.cores, overhead=self.overhead, orders=orders, max_order=s.max_order,
            phase_info=phase_info, current=current, tolerance=s.tolerance, out=self._out_path(), margin=s.margin,
        )
        self.last_refit_start = now
        self._busy = True
        t0 = time.perf_counter()
        try:
            res = await asyncio.get_running_loop().run_in_executor(self._pool(), self._job, job)
        except Exception as exc:
            if self._own_executor and self._executor is not None and type(exc).__name__ == "BrokenProcessPool":
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
            _unlink(job.out)
            return self._decide("failed", {**base, "reason": f"{type(exc).__name__}: {exc}",
                                           "policy": pol.name}, logging.ERROR)
        finally:
            self._busy = False
        wall = time.perf_counter() - t0
        rec = {**base, "fit": res["stages"], "predicted_new": res["predicted_new"],
               "predicted_current": res["predicted_current"], "current_error": res["current_error"],
               "states": res["states"], "worker_seconds": res["seconds"], "seconds": wall,
               "policy": pol.name, "new_hash": res["hash"]}
        if self.current().hash != pol.hash:
            _unlink(job.out)
            return self._decide("skipped_superseded", {**rec, "reason": "the policy was swapped while the refit ran"})
        new_w, cur_w = res["predicted_new"], res["predicted_current"]
        if not new_w < cur_w * (1.0 - s.margin):
            _unlink(job.out)
            return self._decide("kept", {**rec, "reason": f"predicted E[W] {new_w:.6g} is not better than the "
                                         f"current {cur_w:.6g} by more than {s.margin:.1%}"})
        try:
            installed = self._swap(job.out)
        except (ValueError, OSError) as exc:
            _unlink(job.out)
            return self._decide("failed", {**rec, "reason": f"swap refused: {exc}"}, logging.ERROR)
        self.generation += 1
        self._prune(keep=job.out)
        return self._decide("swapped", {**rec, "reason": f"predicted E[W] {new_w:.6g} < current {cur_w:.6g}",
                                        "generation": self.generation, "new_policy": installed.name})

    def _prune(self, keep: str) -> None:
        """Delete earlier online policies (only the running one is needed)."""
        if self._dir is None:
            return
        for p in self._dir.glob(f"online-{os.getpid()}-*.npz"):
            if str(p) != keep:
                _unlink(str(p))

    def status(self) -> dict[str, Any]:
        """For ``GET /-/policy``."""
        return {"generation": self.generation, "refits": dict(self.outcomes), "last": self.last,
                "last_refit_time": self.last_refit_time}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class OnlineCollector(Collector):
    """``overtake_online_*`` metrics, read from the loop at scrape time."""

    def __init__(self, loop: OnlineLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        lp = self.loop
        refits = CounterMetricFamily("overtake_online_refits", "Online refit attempts by outcome", labels=["outcome"])
        for k, v in lp.outcomes.items():
            refits.add_metric([k], v)
        yield refits
        yield GaugeMetricFamily("overtake_online_generation", "Policies swapped in by the online loop", value=lp.generation)
        if lp.last_refit_time is not None:
            yield GaugeMetricFamily("overtake_online_last_refit_timestamp_seconds",
                                    "Unix time of the last refit decision (swapped, kept, failed or skipped)",
                                    value=lp.last_refit_time)
        lam = lp.arrival_rate()
        if lam is not None:
            yield GaugeMetricFamily("overtake_online_arrival_rate_per_second",
                                    "Estimated transaction arrival rate (first stage) over the arrival window",
                                    value=lam)
        samples = GaugeMetricFamily("overtake_online_demand_samples", "Service-demand samples held per stage and source",
                                    labels=["stage", "source"])
        observed = CounterMetricFamily("overtake_online_demand_observations", "Service-demand samples recorded",
                                       labels=["stage", "source"])
        mean = GaugeMetricFamily("overtake_online_demand_mean_seconds",
                                 "Mean of the held service-demand samples (compare the two sources)",
                                 labels=["stage", "source"])
        for name, st in zip(lp.names, lp.stages):
            for src in SOURCES:
                r = st.reservoirs[src]
                samples.add_metric([name, src], len(r))
                observed.add_metric([name, src], st.observed[src])
                if r:
                    mean.add_metric([name, src], sum(r) / len(r) * lp.time_unit)
        yield samples
        yield observed
        yield mean
        last = lp.last
        if "fit" in last:
            fm = GaugeMetricFamily("overtake_online_fitted_mean_seconds", "Mean service demand of the last fit",
                                   labels=["stage", "source"])
            for f in last["fit"]:
                fm.add_metric([f["name"], last["source"][f["name"]]], f["mean"] * lp.time_unit)
            yield fm
            pw = GaugeMetricFamily("overtake_online_predicted_response_time_seconds",
                                   "Model E[W] under the last refitted model", labels=["policy"])
            for k in ("current", "new"):
                w = last[f"predicted_{k}"]
                pw.add_metric([k], w * lp.time_unit if math.isfinite(w) else math.inf)
            yield pw
            yield GaugeMetricFamily("overtake_online_refit_duration_seconds", "Wall time of the last refit job",
                                    value=last["seconds"])
