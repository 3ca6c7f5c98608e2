"""Prometheus exposition of the sidecar and of Apache's mod_status, in one scrape.

Sidecar metrics (``overtake_`` namespace, labels ``stage`` and ``phase``; the passthrough lane is
``stage="passthrough", phase="all"``) are read from the limiter's plain counters at scrape time
by a custom collector (prometheus/client_python ``docs/content/collector/custom.md``), so the
request path pays nothing for gauges:

======================================================  =======  =================================
name                                                    type     meaning
======================================================  =======  =================================
overtake_stage_queued{stage,phase}                      gauge    waiting in the sidecar
overtake_stage_inflight{stage,phase}                    gauge    admitted, response not complete
overtake_stage_limit{stage,phase}                       gauge    threads the policy allows now
overtake_stage_admitted_total{stage,phase}              counter  released to Apache
overtake_stage_completed_total{stage,phase,outcome}     counter  outcome = completed | failed |
                                                                 client_abort | unused (a ``next``
                                                                 reservation) | tunnel (closed)
overtake_stage_rejected_total{stage,reason}             counter  queue_full | queue_timeout |
                                                                 client_gone | follow_up_missing
overtake_stage_duration_seconds{stage,phase}            hist.    arrival -> response received
overtake_stage_queue_wait_seconds{stage,phase}          hist.    arrival -> admission
overtake_gateway_errors_total{reason}                   counter  bad_request, header_too_large,
                                                                 body_too_large, bad_phase, ...
overtake_inflight / overtake_inflight_limit             gauge    all requests in Apache / hard cap
overtake_inflight_max                                   gauge    largest inflight seen
overtake_response_spool_bytes                           gauge    finished answers waiting on disk
                                                                 for slow clients
overtake_tunnels                                        gauge    open WebSocket tunnels
overtake_gate_enabled                                   gauge    1 while queued requests wait in
                                                                 Apache's gate (``--gate``, paired)
overtake_gate_slots_in_use                              gauge    gated requests not yet finished
overtake_gate_full_total                                counter  queued requests kept in the sidecar
                                                                 for want of a gate slot
overtake_policy_info{name,version,hash,phase_info,      gauge    1 (auto: the chosen policy and why)
                     chosen,reason}
overtake_policy_predicted_response_time_seconds         gauge    model E[W] x time unit (tables)
overtake_policy_swaps_total / _refused_total            counter  hot swaps done / refused
overtake_policy_guard_admissions_total                  counter  liveness-guard admissions
overtake_stage_lock_capacity{stage}                     gauge    a locked stage's ``lock: m`` (or
                                                                 learned, ``lock: auto``)
overtake_stage_lock_learned{stage}                      gauge    1 learned capacity, 0 configured
overtake_stage_lock_waiting{stage}                      gauge    waiting while its lock is full
overtake_stage_lock_wait_seconds_total{stage}           counter  request-seconds waited on the
                                                                 full lock
overtake_stage_lock_aged_total{stage}                   counter  started ahead of a waiting request
                                                                 predicted shorter (its wait counted)
overtake_policy_fetches_total{result}                   counter  --policy-url polls: updated |
                                                                 not_modified | error | refused
======================================================  =======  =================================

With ``--online`` (:class:`overtake.controller.online.OnlineCollector`): ``overtake_online_refits_total{outcome}``
(swapped, kept, failed, skipped_*), ``overtake_online_generation``,
``overtake_online_last_refit_timestamp_seconds``, ``overtake_online_arrival_rate_per_second``,
``overtake_online_demand_samples{stage,source}``, ``overtake_online_demand_observations_total{stage,source}``,
``overtake_online_demand_mean_seconds{stage,source}`` (source = access_log | attained),
``overtake_online_fitted_mean_seconds{stage,source}``,
``overtake_online_predicted_response_time_seconds{policy}`` (current | new, under the last refitted
model), ``overtake_online_refit_duration_seconds`` and ``overtake_solve_cpu_seconds_total{kind}`` (the
refit worker's CPU by kind of solve: full, start, none, route); with ``--access-log`` and Apache's
request-time split (``OvertakeRequestTimes On``), ``overtake_stage_serialised{stage}`` and
``overtake_stage_serialised_capacity{stage}`` (:mod:`overtake.controller.online.lockwatch`).

With ``--verify`` (:class:`overtake.controller.sidecar.verify_metrics.VerifyCollector`):
``overtake_verification_state{state}`` (1 for idle, verifying, kept or fell_back),
``overtake_verification_arm{arm}`` (1 for what is in force: policy or default),
``overtake_verification_gain_ratio`` and ``overtake_verification_gain_ci_ratio{bound}`` (the measured
gain 1 − policy / default of the mean response time, and its CI),
``overtake_verification_pairs_total{outcome}`` (used | void),
``overtake_verification_decisions_total{state,reason}`` and
``overtake_verification_window_mean_response_seconds{arm}`` (the last pair's windows).

Apache's ``/server-status?auto`` (:func:`overtake.controller.sidecar.mod_status.parse_status`) is exported under the
names of prometheus-community/apache_exporter: ``apache_up``, ``apache_info{version,mpm}``,
``apache_accesses_total``, ``apache_sent_kilobytes_total``, ``apache_duration_ms_total``,
``apache_cpu_time_ms_total{type}``, ``apache_cpuload``, ``apache_uptime_seconds_total``,
``apache_workers{state}``, ``apache_processes{state}``, ``apache_connections{state}``,
``apache_scoreboard{state}``, ``apache_load{interval}``, ``apache_generation{type}``.

With ``--cpu-priority age|class``, ``--gate`` or ``--control-file``, mod_overtake_prio's counters
(``/overtake-prio-status``, scraped with mod_status) are passed through under the module's own names:
``overtake_cpu_prio_enabled``, ``overtake_cpu_prio_requests_total{level}``, ``overtake_cpu_prio_demotions_total{level,cause}``,
``overtake_cpu_prio_restores_total``, the gate's ``overtake_gate_held_total``,
``overtake_gate_wait_seconds_total``, the control file's ``overtake_cpu_prio_control_generation`` and the
rest (apache-conf/mod_overtake_prio/README.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from overtake.controller.sidecar.limiter import PASSTHROUGH, Limiter
from overtake.controller.sidecar.mod_status import SCOREBOARD_STATES, scoreboard_counts

__all__ = ["ApacheCollector", "SidecarMetrics"]

_GAP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _LimiterCollector(Collector):
    def __init__(self, owner: SidecarMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        lim = self.owner.limiter()
        yield from _stage_families(lim)
        yield GaugeMetricFamily("overtake_inflight", "Requests inside Apache through the sidecar", value=lim.inflight_total)
        yield GaugeMetricFamily("overtake_inflight_limit", "Global hard cap on requests inside Apache", value=lim.max_inflight)
        yield GaugeMetricFamily(
            "overtake_inflight_max", "Largest number of requests inside Apache seen", value=lim.max_seen_inflight
        )
        yield from _policy_families(lim, self.owner)
        if lim.lock is not None:
            yield from _lock_families(lim)


def _stage_families(lim: Limiter) -> Iterator[Metric]:
    """Per stage and phase (and the passthrough): queued, in Apache, the policy's limit now, and
    the admitted, completed and rejected counters."""
    names = lim.stage_names
    queued = GaugeMetricFamily("overtake_stage_queued", "Requests waiting in the sidecar", labels=["stage", "phase"])
    inflight = GaugeMetricFamily(
        "overtake_stage_inflight",
        "Requests admitted to Apache, response not yet received",
        labels=["stage", "phase"],
    )
    limit = GaugeMetricFamily(
        "overtake_stage_limit",
        "Threads the policy allows in this stage and phase at the current state",
        labels=["stage", "phase"],
    )
    admitted = CounterMetricFamily("overtake_stage_admitted", "Requests released to Apache", labels=["stage", "phase"])
    completed = CounterMetricFamily(
        "overtake_stage_completed", "Admitted requests ended, by outcome", labels=["stage", "phase", "outcome"]
    )
    rejected = CounterMetricFamily(
        "overtake_stage_rejected",
        "Requests answered 503 or dropped before admission, by reason",
        labels=["stage", "reason"],
    )
    for i, name in enumerate(names):
        for j in range(lim.phases[i]):
            c = lim.offset[i] + j
            ph = str(j + 1)
            queued.add_metric([name, ph], lim.waiting[c])
            inflight.add_metric([name, ph], lim.threads[c])
            limit.add_metric([name, ph], lim.stage_limit(i, j))
    queued.add_metric(["passthrough", "all"], len(lim.pt_queue))
    inflight.add_metric(["passthrough", "all"], lim.pt_inflight)
    if lim.passthrough_cap is not None:
        limit.add_metric(["passthrough", "all"], lim.passthrough_cap)
    for (i, j), v in sorted(lim.admitted.items()):
        admitted.add_metric(_labels(names, i, j), v)
    for (i, j, outcome), v in sorted(lim.completed.items()):
        completed.add_metric([*_labels(names, i, j), outcome], v)
    for (i, reason), v in sorted(lim.rejected.items()):
        rejected.add_metric([names[i] if i != PASSTHROUGH else "passthrough", reason], v)
    yield from (queued, inflight, limit, admitted, completed, rejected)


def _policy_families(lim: Limiter, owner: SidecarMetrics) -> Iterator[Metric]:
    """The running policy: its identity, its predicted E[W], and the swap and guard counters."""
    pol = lim.policy
    # phase_info: what the enforced policy sees; chosen/reason: what classifier.mode auto runs and why
    # (passthrough when no candidate is predicted better than Apache's default by the margin)
    info = GaugeMetricFamily("overtake_policy_info", "The running policy",
                             labels=["name", "version", "hash", "phase_info", "chosen", "reason"])
    chosen = getattr(pol, "chosen", pol)
    info.add_metric([pol.name, pol.version, pol.hash, pol.phase_info, chosen.name, getattr(pol, "reason", "")], 1)
    yield info
    if pol.predicted_wait is not None:
        yield GaugeMetricFamily(
            "overtake_policy_predicted_response_time_seconds",
            "Model's mean response time E[W] of the running policy (model units x time unit)",
            value=pol.predicted_wait * owner.time_unit,
        )
    yield CounterMetricFamily("overtake_policy_swaps", "Policies installed at runtime", value=owner.swaps)
    yield CounterMetricFamily("overtake_policy_refused", "Policy swaps refused (old policy kept)", value=owner.refused)
    yield CounterMetricFamily(
        "overtake_policy_guard_admissions", "Admissions by the liveness guard", value=lim.guard_admissions
    )


def _lock_families(lim: Limiter) -> Iterator[Metric]:
    """The locked stages' gauges and counters (controller.sidecar.stage_lock)."""
    lock = lim.lock
    assert lock is not None
    cap = GaugeMetricFamily("overtake_stage_lock_capacity", "Requests of the stage that may be in Apache at once (lock)",
                            labels=["stage"])
    waiting = GaugeMetricFamily("overtake_stage_lock_waiting", "Requests waiting in the sidecar for the stage's full lock",
                                labels=["stage"])
    wait = CounterMetricFamily("overtake_stage_lock_wait_seconds",
                               "Request-seconds spent waiting in the sidecar while the stage's lock was full",
                               labels=["stage"])
    aged = CounterMetricFamily("overtake_stage_lock_aged",
                               "Requests started ahead of a waiting request predicted shorter, for their wait",
                               labels=["stage"])
    learned = GaugeMetricFamily("overtake_stage_lock_learned",
                                "1: the stage's lock capacity was learned (lock: auto), 0: configured (lock: m)",
                                labels=["stage"])
    for i, m in enumerate(lock.caps):
        if m is None:
            continue
        name = lock.names[i]
        cap.add_metric([name], m)
        learned.add_metric([name], float(lock.source[i] == "learned"))
        waiting.add_metric([name], lock.waiting[i])
        wait.add_metric([name], lock.wait_seconds[i])
        aged.add_metric([name], lock.aged[i])
    yield from (cap, waiting, wait, aged, learned)


def _labels(names: tuple[str, ...], i: int, j: int) -> list[str]:
    return ["passthrough", "all"] if i == PASSTHROUGH else [names[i], str(j + 1)]


def _version_number(v: str) -> float:
    # apache_exporter: "Apache/2.4.71 (Debian)" -> 2.04071
    try:
        nums = [int(x) for x in v.split("/", 1)[1].split()[0].split(".")[:3]]
    except (IndexError, ValueError):
        return 0.0
    nums += [0] * (3 - len(nums))
    return nums[0] + nums[1] / 100 + nums[2] / 100000


class PrioCollector(Collector):
    """mod_overtake_prio's metric families as last scraped (empty until then, or without it)."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        yield from self.families

    def levels(self) -> int | None:
        """The module's configured level count (``overtake_cpu_prio_levels``); None before a scrape."""
        for f in self.families:
            if f.name == "overtake_cpu_prio_levels":
                return next((int(s.value) for s in f.samples), None)
        return None


class ApacheCollector(Collector):
    """Yields apache_exporter-named metrics from the last parsed ``?auto`` (or ``apache_up 0``);
    nothing at all while ``absent`` (Apache answers, but has no mod_status for the sidecar)."""

    def __init__(self) -> None:
        self.status: dict[str, Any] | None = None
        self.scrape_failures = 0
        self.absent = False

    def collect(self) -> Iterator[Metric]:
        s = self.status
        if self.absent:
            return
        yield GaugeMetricFamily("apache_up", "Could the apache server be reached", value=1 if s else 0)
        yield CounterMetricFamily(
            "apache_exporter_scrape_failures", "Number of errors while scraping apache", value=self.scrape_failures
        )
        if not s:
            return
        yield from _apache_identity(s)
        yield from _apache_totals(s)
        yield from _apache_states(s)


def _apache_identity(s: dict[str, Any]) -> Iterator[Metric]:
    """Which Apache: version, MPM, restart generations, and the host's load."""
    version = str(s.get("ServerVersion", ""))
    info = GaugeMetricFamily("apache_info", "Apache version information", labels=["version", "mpm"])
    info.add_metric([version, str(s.get("ServerMPM", ""))], 1)
    yield info
    yield GaugeMetricFamily("apache_version", "Apache server version", value=_version_number(version))
    gen = GaugeMetricFamily("apache_generation", "Apache restart generation", labels=["type"])
    gen.add_metric(["config"], float(s.get("ParentServerConfigGeneration", 0)))
    gen.add_metric(["mpm"], float(s.get("ParentServerMPMGeneration", 0)))
    yield gen
    load = GaugeMetricFamily("apache_load", "Apache server load", labels=["interval"])
    for key, lab in (("Load1", "1min"), ("Load5", "5min"), ("Load15", "15min")):
        if key in s:
            load.add_metric([lab], float(s[key]))
    yield load


def _apache_totals(s: dict[str, Any]) -> Iterator[Metric]:
    """Apache's running totals (accesses, bytes, durations, uptime, CPU time) and its CPU load,
    each only where mod_status reports it."""
    for key, name, doc in (
        ("Total Accesses", "apache_accesses", "Current total apache accesses"),
        ("Total kBytes", "apache_sent_kilobytes", "Current total kbytes sent"),
        ("Total Duration", "apache_duration_ms", "Total duration of all registered requests in ms"),
        ("Uptime", "apache_uptime_seconds", "Current uptime in seconds"),
    ):
        if key in s:
            yield CounterMetricFamily(name, doc, value=float(s[key]))
    if "CPUUser" in s:
        cpu = CounterMetricFamily("apache_cpu_time_ms", "Apache CPU time", labels=["type"])
        cpu.add_metric(["user"], 1000 * (float(s.get("CPUUser", 0)) + float(s.get("CPUChildrenUser", 0))))
        cpu.add_metric(["system"], 1000 * (float(s.get("CPUSystem", 0)) + float(s.get("CPUChildrenSystem", 0))))
        yield cpu
    if "CPULoad" in s:
        yield GaugeMetricFamily(
            "apache_cpuload",
            "The current percentage CPU used by each worker and in total by all workers combined",
            value=float(s["CPULoad"]),
        )


def _apache_states(s: dict[str, Any]) -> Iterator[Metric]:
    """What Apache's workers, processes, connections and scoreboard slots are doing now."""
    workers = GaugeMetricFamily("apache_workers", "Apache worker statuses", labels=["state"])
    workers.add_metric(["busy"], float(s.get("BusyWorkers", 0)))
    workers.add_metric(["idle"], float(s.get("IdleWorkers", 0)))
    yield workers
    procs = GaugeMetricFamily("apache_processes", "Apache process count", labels=["state"])
    procs.add_metric(["all"], float(s.get("Processes", 0)))
    procs.add_metric(["stopping"], float(s.get("Stopping", 0)))
    yield procs
    conns = GaugeMetricFamily("apache_connections", "Apache connection statuses", labels=["state"])
    for key, lab in (("ConnsTotal", "total"), ("ConnsAsyncWriting", "writing"),
                     ("ConnsAsyncKeepAlive", "keepalive"), ("ConnsAsyncClosing", "closing")):
        conns.add_metric([lab], float(s.get(key, 0)))
    yield conns
    sb = GaugeMetricFamily("apache_scoreboard", "Apache scoreboard statuses", labels=["state"])
    counts = scoreboard_counts(str(s.get("Scoreboard", "")))
    for state in SCOREBOARD_STATES.values():
        sb.add_metric([state], counts.get(state, 0))
    yield sb


class SidecarMetrics:
    """The sidecar's own registry: request-path histograms and counters plus the collectors."""

    def __init__(self, limiter: Callable[[], Limiter], *, time_unit: float) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.limiter = limiter
        self.time_unit = time_unit
        self.swaps = 0
        self.refused = 0
        self.duration = Histogram(
            "overtake_stage_duration_seconds", "Arrival at the sidecar until Apache's whole response is received",
            ["stage", "phase"], buckets=_BUCKETS, registry=self.registry,
        )
        self.queue_wait = Histogram(
            "overtake_stage_queue_wait_seconds", "Arrival at the sidecar until admission to Apache",
            ["stage", "phase"], buckets=_BUCKETS, registry=self.registry,
        )
        self.follow_up_gap = Histogram(
            "overtake_follow_up_gap_seconds",
            "A `next` reservation until its request arrived (the client's round trip; reservations "
            "that lapse after follow_up_timeout are counted in rejected/completed, not here)",
            ["stage"], buckets=_GAP_BUCKETS, registry=self.registry,
        )
        self.spool_bytes = Gauge(
            "overtake_response_spool_bytes", "Bytes of responses Apache has finished that wait on disk for "
            "slow clients (limits.response_spill_bytes per response)", registry=self.registry,
        )
        self.tunnels = Gauge("overtake_tunnels", "Open WebSocket tunnels (limits.max_tunnels)", registry=self.registry)
        self.gate_enabled = Gauge("overtake_gate_enabled", "1 while queued requests are sent to Apache and wait in "
                                  "mod_overtake_prio's gate (--gate, with Apache reporting the same file)",
                                  registry=self.registry)
        self.gate_in_use = Gauge("overtake_gate_slots_in_use", "Gated requests sent to Apache whose exchange has "
                                 "not ended (at most gate_slots)", registry=self.registry)
        self.gate_full = Counter("overtake_gate_full", "Queued requests kept in the sidecar because every gate slot "
                                 "was in use (gate_slots)", registry=self.registry)
        self.cpu_exempt = Counter(
            "overtake_stage_cpu_exempt", "Requests sent with X-Overtake-Exempt (the stage's cpu_exempt: "
            "mod_overtake_prio never demotes them)", ["stage"], registry=self.registry,
        )
        self.class_low = Counter(
            "overtake_class_low", "Requests sent at mod_overtake_prio's low level because their predicted holding "
            "time exceeded the stage's threshold (--cpu-priority class by size)", ["stage"], registry=self.registry,
        )
        self.errors = Counter(
            "overtake_gateway_errors", "Requests answered by the gateway itself, by reason",
            ["reason"], registry=self.registry,
        )
        for reason in ("bad_request", "header_too_large", "body_too_large", "bad_phase", "upstream_error", "upstream_timeout"):
            self.errors.labels(reason)
        self.apache = ApacheCollector()
        self.prio = PrioCollector()
        self.registry.register(self.prio)
        self.registry.register(_LimiterCollector(self))
        self.registry.register(self.apache)
