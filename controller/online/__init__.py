"""The online loop: measure service demand and arrivals, refit the PH model, re-solve, hot-swap.

Netflix concurrency-limits' split between algorithm and enforcement: the
:class:`overtake.controller.sidecar.limiter.Limiter` enforces; this package only *observes* it (a
:class:`DemandRecorder`, one of the limiter's listeners, hears every arrival, admission and
completion instant) and, rate limited, proposes a new policy through the sidecar's existing
atomic swap path.

Modules
-------
:mod:`~overtake.controller.online.settings`
    :class:`OnlineSettings` (the ``--online`` options) and the metric label values.
:mod:`~overtake.controller.online.estimators`
    Service demand (attained service, Apache's access log) and arrival rate, and the
    :class:`DemandRecorder` that feeds them from the limiter.
:mod:`~overtake.controller.online.refit`
    :func:`refit_job`, the fit / re-solve / evaluate job run in a worker process.
:mod:`~overtake.controller.online.loop`
    :class:`OnlineLoop`: the asyncio tasks, one refit from window to hot swap.
:mod:`~overtake.controller.online.decision`
    What a refit re-solves for, whether a window can be refitted, whether a new policy replaces
    the running one, and each decision's record.
:mod:`~overtake.controller.online.worker`
    :class:`~overtake.controller.online.worker.RefitWorker`: the process the refit jobs run in,
    and their policy files.
:mod:`~overtake.controller.online.metrics`
    :class:`OnlineCollector`, the ``overtake_online_*`` Prometheus metrics (and the lock watch's).
:mod:`~overtake.controller.online.serialisation`
    Is a stage serialised by a lock? The test and the lock's capacity, from each request's time
    split into CPU, run-queue wait and blocked time (mod_overtake_prio's ``OvertakeRequestTimes``).
:mod:`~overtake.controller.online.lockwatch`
    :class:`~overtake.controller.online.lockwatch.LockWatch`: those verdicts per stage from the
    access log, logged and exported; the sidecar sends a serialised stage's requests exempt from
    CPU demotion.

Estimates
---------
* **Service demand per completed stage request**, two sources, the log preferred:

  - ``access_log`` — Apache's own note of the thread CPU the stage handler burnt
    (``cpu_us=%{stage_cpu_us}n`` in :data:`overtake.controller.log_format.LOG_FORMAT`), tailed from the
    access log given with ``--access-log``; where no stage handler notes one (a real application),
    mod_overtake_prio's note of the request's thread CPU (``ocpu_us``, ``OvertakeRequestTimes``)
    for a stage whose work the module saw run in Apache's threads (not behind PHP-FPM or a proxy,
    where Apache only waits); only lines answered 200;
  - ``attained`` — the attained service under processor sharing (van der Weij et al.,
    "Dynamic thread assignment", §2: with K active threads each progresses at rate c(K)/K, c(K) = min(K, m)/(1 + δK),
    :func:`overtake.mdp.model.capacity`): ``S = ∫_{admit}^{done} c(K(t))/K(t) dt``, K(t) the
    stage requests the limiter has admitted (the sidecar sees every change of K, so the integral
    is exact for the model). It assumes Apache's threads own the m cores: on a shared machine it
    counts CPU taken by other processes as service (bench/online_refit.py shows how much), hence the
    log's CPU notes are preferred.

  A stage uses the log's samples when it has ``min_samples`` of them, else the attained ones;
  the decision log and ``overtake_online_fitted_mean_seconds{source}`` say which.
  Each (stage, source) keeps the latest ``reservoir`` samples (a sliding window, so the fit
  follows drift).
* **Arrival rate** λ of transactions: arrivals to the first stage in the last
  ``arrival_window`` seconds (bucketed counts, O(1) memory): the limiter's, or in module mode
  every access-log line of the stage, whatever its answer (a request dropped because its client
  left arrived too).

Refit (at most once per ``refit_interval``; skipped with a logged reason when a stage has fewer
than ``min_samples`` samples or the estimated load λ·ΣE[S]/m ≥ ``max_load``): in a worker
process (:class:`concurrent.futures.ProcessPoolExecutor`, one worker at nice 19, its CPU counted
in ``overtake_solve_cpu_seconds_total{kind}``; the event loop never blocks) :func:`refit_job` fits
a PH per stage by EM (:func:`overtake.fitting.fit`, order 1 or 2 by BIC, hyperexponential for
SCV > 1 else CF1, mean preserved), builds the :class:`overtake.mdp.TandemModel`, solves π* for
the running policy's information (:func:`overtake.mdp.solve`; a route policy's classes carried
over by :func:`~overtake.controller.online.refit.carry_routes`) and evaluates the *current*
policy exactly under the *new* model (:func:`overtake.mdp.rule_evaluation.evaluate_rule`, both on
one evaluation cap). The new policy is swapped in only if its predicted E[W] is lower by more
than ``margin`` (default 1 %); a route solve longer than ``refit_interval`` is not swapped in.
Every decision is one JSON log line (``event = online_refit``) and counted in
``overtake_online_refits_total{outcome}``.

Coupled stages: where the stages file links a stage to the next (``next``), the recorder pairs
one transaction's two attained demands (the follow-up claims the reservation the first request's
completion left on its connection: the limiter's ``on_follow``), and a refit for full phase
information fits the routing between the stages' phases on those pairs
(:func:`overtake.fitting.coupled.fit_routing`, the stages' PHs held) and solves the coupled
model. A running model's routing that cannot be paired again is refitted as independent stages,
said once in the log (``event = online_routing_dropped``).
"""

from __future__ import annotations

from overtake.controller.online.estimators import AccessLogTail, ArrivalRate, AttainedService, DemandRecorder
from overtake.controller.online.loop import OnlineLoop
from overtake.controller.online.metrics import OnlineCollector
from overtake.controller.online.refit import RefitJob, refit_job
from overtake.controller.online.settings import OUTCOMES, SOURCES, OnlineSettings

__all__ = [
    "OUTCOMES",
    "SOURCES",
    "AccessLogTail",
    "ArrivalRate",
    "AttainedService",
    "DemandRecorder",
    "OnlineCollector",
    "OnlineLoop",
    "OnlineSettings",
    "RefitJob",
    "refit_job",
]
