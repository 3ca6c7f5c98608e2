"""Assembly of the sidecar: stages, policy, classifier, limiter, gateway, metrics, hot swap.

:class:`Sidecar` builds the pieces from :class:`SidecarOptions` and wires them; running them is
:mod:`.running`'s (start, drain, reload), keeping the policy in force :mod:`.policy_in_force`'s. The control
endpoints are :mod:`overtake.controller.sidecar.admin`'s, the policy's sources
:mod:`overtake.controller.sidecar.policy_source`'s. It owns the running policy. :meth:`Sidecar.swap` loads and validates a new one
(:func:`overtake.controller.sidecar.policies.load_policy`), and only then installs it with
:meth:`overtake.controller.sidecar.limiter.Limiter.swap` — one synchronous step on the event loop, so no request
ever sees half a policy; queued requests keep their order. A policy that fails to load or does
not match the stages raises :class:`overtake.controller.errors.PolicyLoadError` and the old policy stays.
Swaps come from ``PUT /-/policy`` (with the admin token), from the policy file changing on disk
(polled every ``watch_interval`` seconds; ``SIGHUP`` forces a reload), from the REST API
(``policy_url``: polled every ``policy_poll`` seconds with the ETag, see :mod:`overtake.controller.sidecar.policy_fetch`;
``PUT /-/policy`` with an ``http://`` URL follows another model), or from the online loop
(:mod:`overtake.controller.online`).

Policies from outside (``PUT /-/policy``, the file, the URL, ``SIGHUP``) are loaded by
:meth:`Sidecar.install`: in a worker thread under a deadline (``policy_load_timeout``), one at a
time (:mod:`overtake.controller.sidecar.policy_loads`), from regular files of bounded size only, with the
archive's inflated size bounded (:mod:`overtake.controller.sidecar.policy_archive`).

As a service (``overtake sidecar --config FILE``, :mod:`overtake.controller.sidecar.config`):
:meth:`Sidecar.drain` on ``SIGTERM`` stops accepting and lets every request already received
finish within ``drain_timeout``; :meth:`Sidecar.reload` on ``SIGHUP`` applies a re-read config
(the settings that need no new socket) and stages file (what does not reshape the queues,
:mod:`overtake.controller.sidecar.stages_reload`) and reloads the policy; the control endpoints are on their
own listener (``admin_listen``, loopback by default; :mod:`overtake.controller.sidecar.admin`), Apache's
status and health are :mod:`overtake.controller.sidecar.apache_probe`'s; ``request_log`` writes one line per request
(:mod:`overtake.controller.sidecar.request_log`).

The time unit (seconds per model time unit) comes from the policy, else the stages file
(:mod:`overtake.controller.sidecar.units`); every time the sidecar shows is in seconds.

Logs are JSON lines on stderr (:mod:`.logs`); the options and what a reload may change are
:mod:`.options`'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from prometheus_client.core import Metric

from overtake.controller.cpu_location import CpuLocation, StackWatch
from overtake.controller.errors import SidecarInputError
from overtake.controller.online import OnlineCollector, OnlineLoop
from overtake.controller.php_prio import PhpPrioCollector
from overtake.controller.sidecar.admin import AdminEndpoints
from overtake.controller.sidecar.apache_probe import ApacheProbe
from overtake.controller.sidecar.auto import Evidence
from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.control_file import ControlPublisher
from overtake.controller.sidecar.cpu_choice import choose_cpu_priority
from overtake.controller.sidecar.fpm_pool import pool_size
from overtake.controller.sidecar.gate import Gate, GateOpener
from overtake.controller.sidecar.gateway import Gateway
from overtake.controller.sidecar.limiter import Limiter
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.module_mode import check_module_options, check_module_policy
from overtake.controller.sidecar.module_stages import ModuleStageCheck
from overtake.controller.sidecar.options import (
    ApacheSide,
    SidecarOptions,
    check_numbers,
    parse_addr,
    parse_apache_url,
    with_cpu_priority,
)
from overtake.controller.sidecar.policies import BaselinePolicy, PolicySet, SpawnPolicy
from overtake.controller.sidecar.policy_in_force import log
from overtake.controller.sidecar.policy_loads import LoadSlots
from overtake.controller.sidecar.policy_source import PolicySource
from overtake.controller.sidecar.request_log import RequestLog
from overtake.controller.sidecar.running import SidecarRuntime
from overtake.controller.sidecar.size_class import SizeClass
from overtake.controller.sidecar.stage_lock import StageLock
from overtake.controller.sidecar.stages import ClassifierSettings, StageTable
from overtake.controller.sidecar.upstream import UpstreamPool
from overtake.controller.sidecar.verify import Verifier
from overtake.controller.sidecar.verify_metrics import VerifyCollector
from overtake.controller.uplink import Uplink, make_uplink
from overtake.controller.uplink.errors import UplinkInputError
from overtake.controller.uplink.metrics import UplinkCollector

__all__ = ["Sidecar"]


def _uplink(options: SidecarOptions) -> Uplink:
    """The response scheduler (``--uplink``); its cutoffs only where there are bands to cut."""
    if options.uplink.name not in ("srpt", "srrt") and options.uplink.cutoffs is not None:
        raise UplinkInputError(f"uplink_cutoffs: only for --uplink srpt or srrt, not {options.uplink.name!r}")
    return make_uplink(options.uplink.name, cutoffs=options.uplink.cutoffs,
                       top_fraction=options.uplink.top_fraction,
                       lowest_writers=options.uplink.lowest_writers,
                       ordered_bands=options.uplink.ordered_bands)


class Sidecar(SidecarRuntime):
    """Everything wired together; ``await start()``, then ``await serve_forever()`` / ``close()``.

    Built here (the pieces and their wiring), run by
    :class:`~overtake.controller.sidecar.running.SidecarRuntime`, its policy kept by
    :class:`~overtake.controller.sidecar.policy_in_force.PolicyInForce`.
    """

    def __init__(self, table: StageTable, options: SidecarOptions, *,
                 reload_options: Callable[[], SidecarOptions] | None = None,
                 reload_stages: Callable[[], StageTable] | None = None) -> None:
        self.table = table
        self.options = options
        #: SIGHUP: re-read the config (``overtake sidecar --config``); None: reload the policy only
        self.reload_options = reload_options
        #: SIGHUP: re-read the stages file and apply what can be applied live (controller.sidecar.stages_reload)
        self.reload_stages = reload_stages
        # module mode serves no traffic: its listen, when given, is checked and never opened
        if options.endpoints.listen is None and options.enforce != "module":
            raise SidecarInputError("listen: required: give --listen (where clients connect, e.g. 0.0.0.0:80)")
        self.listen = parse_addr(options.endpoints.listen, "listen") if options.endpoints.listen else None
        self.admin_addr = parse_addr(options.endpoints.admin_listen, "admin_listen")
        self.apache = parse_apache_url(options.endpoints.apache)
        options = self._settle_options(options)
        #: policy loads off the event loop: one running, a few waiting, the rest refused
        self.loads = LoadSlots()
        self._class_key: tuple[object, object] | None = None
        self._class_levels: tuple[tuple[int, ...], ...] | None = None
        self.request_log = (RequestLog(options.observability.request_log, options.observability.request_log_format)
                            if options.observability.request_log else None)
        self.uplink = _uplink(options)
        self.source = PolicySource(table, options, lambda spec, source: self.install(spec, source=source),
                                   lambda: self.limiter.policy)
        self.swapped_at = time.time()
        #: classifier.mode auto (controller.sidecar.auto): the evidence the traffic gives, the candidates
        self.auto = table.config.classifier.mode == "auto"
        self._auto_task: asyncio.Task[None] | None = None
        self._warned_unrecorded: set[str] = set()
        self._apache_side(options.apache_side)
        policy, settings = self._first_policy(self.source.first)
        self.classifier = Classifier(settings, policy)
        if self.auto:
            self.classifier.evidence = Evidence()
            self._auto_choose(policy, initial=True)  # type: ignore[arg-type]
        self._wire(policy, settings.mode)

    def _settle_options(self, options: SidecarOptions) -> SidecarOptions:
        """The options checked and completed before anything is built from them: under ``enforce:
        module`` the online loop's arrivals come from the log too, and ``--cpu-priority auto`` is
        resolved against the stages file (:mod:`.cpu_choice`): from here on the options carry the
        chosen value."""
        check_numbers(options)
        check_module_options(options)
        if options.enforce == "module" and options.online is not None:  # arrivals come from the log too
            options = self.options = dataclasses.replace(
                options, online=dataclasses.replace(options.online, arrivals_from_log=True))
        #: enforce: module: mod_overtake_prio holds the requests, no traffic passes here (.module_mode)
        self.module_mode = options.enforce == "module"
        self.cpu_choice = choose_cpu_priority(options.apache_side.cpu_priority, self.table,
                                              module_mode=self.module_mode,
                                              control_file=bool(options.apache_side.control_file))
        if self.cpu_choice.requested == "auto":
            options = self.options = with_cpu_priority(options, self.cpu_choice.chosen)
            log.info(f"cpu_priority auto: {self.cpu_choice.chosen} ({self.cpu_choice.reason})",
                     extra={"event": "cpu_priority_auto", "detail": self.cpu_choice.reason})
        return options

    def _apache_side(self, side: ApacheSide) -> None:
        """What the sidecar knows of Apache's side: where the CPU runs (Apache or PHP-FPM: the
        module reaches only Apache's), per stage which lever reaches its work, the control file
        for the policy's age thresholds (:mod:`.control_file`), and the PHP-FPM pool's size."""
        self.cpu_location = CpuLocation(side.cpu_priority, php_extension=bool(side.php_stats_file))
        #: per stage (the module's OvertakeStage counters): where its work runs, which lever reaches it
        self.stacks = StackWatch(side.cpu_priority, php_extension=bool(side.php_stats_file))
        #: the policy's age thresholds for Apache's OvertakeControlFile (controller.sidecar.control_file)
        self.control = (ControlPublisher(side.control_file, len(self.table.names),
                                         stage_names=self.table.names if self.module_mode else None)
                        if side.control_file else None)
        #: the PHP-FPM pool behind Apache and its pm.max_children (controller.sidecar.fpm_pool), or None
        self.fpm_pool = pool_size(side.fpm_pool_config) if side.fpm_pool_config else None

    def _first_policy(self, policy: SpawnPolicy) -> tuple[SpawnPolicy, ClassifierSettings]:
        """The policy to start with and the classifier's settings for it: under auto, the
        candidates as one set (classified hidden until the first choice); the time unit in force
        (:mod:`.units`, :attr:`time_unit`); warnings about the CPU-priority option it needs."""
        options = self.options
        settings = self.table.config.classifier
        if options.phase_header:
            settings = settings.model_copy(update={"header": options.phase_header})
        if self.auto:
            policy = self._as_set(policy)
            settings = settings.model_copy(update={"mode": "hidden"})  # until the first choice
        elif isinstance(policy, PolicySet):
            raise SidecarInputError(f"policy: {options.policy.spec} is a directory of policies; that needs "
                                    "classifier.mode: auto in the stages file (or give one .npz)")
        if self.module_mode:
            check_module_policy(policy)
        #: seconds per model time unit (controller.sidecar.units): the policy's, else the stages file's
        res = self._resolve_unit(policy)
        self.time_unit = res.seconds if res.seconds is not None else 1.0
        self._say_unit(res.source if res.seconds is not None else "seconds: no policy model to convert")
        if options.apache_side.cpu_priority == "age" and self.control is None:
            self._say_age_threshold(policy, self.time_unit)
        for p in policy.members if isinstance(policy, PolicySet) else (policy,):
            if getattr(p, "solved_priority", "off") == "class" and options.apache_side.cpu_priority != "class":
                log.warning(f"policy {p.name} was solved with short-first CPU classes in force; run with "
                            "--cpu-priority class (and mod_overtake_prio, OvertakePrioAge Off) or solve without "
                            "--cpu-priority class", extra={"event": "cpu_priority_mismatch", "policy": p.name})
        return policy, settings.model_copy(update={"time_unit": self.time_unit})

    def _wire(self, policy: SpawnPolicy, classifier_mode: str) -> None:
        """Build the limiter, the metrics, the online loop, Apache's side and the gateway around
        the classifier and the first policy."""
        self._wire_limiter(policy)
        self._wire_online(policy, classifier_mode)
        self._wire_apache()

    def _wire_limiter(self, policy: SpawnPolicy) -> None:
        """The limiter with its listeners (size classes, the verifier) and the metrics."""
        options, table, cfg = self.options, self.table, self.table.config
        self.limiter = Limiter(
            policy, self.classifier, stage_names=table.names,
            queue_caps=tuple(table.queue_cap(i) for i in range(len(table.names))),
            max_inflight=cfg.limits.max_inflight, passthrough_cap=cfg.passthrough.cap,
            passthrough_queue_cap=cfg.limits.queue_cap,
        )
        self.limiter.set_lock(StageLock.from_table(table))
        #: --cpu-priority class where the policy knows no phases: the level from the predicted size
        self.size_class = SizeClass.from_table(table) if options.apache_side.cpu_priority == "class" else None
        if self.size_class is not None:
            self.limiter.add_listener(self.size_class)
        self.metrics = SidecarMetrics(lambda: self.limiter, time_unit=self.time_unit)
        self.online: OnlineLoop | None = None
        if self.control is not None:
            if options.apache_side.cpu_priority == "class":  # the size class alone: no age on top
                self.control.without_age(self.metrics.prio.levels)
            self.control.publish(self.limiter.policy, self.time_unit)
        self._say_pool(self.limiter.policy)
        #: the policy against Apache's default on live traffic (controller.sidecar.verify)
        self.verifier = None if options.verify is None else Verifier(
            options.verify, limiter=self.limiter, passthrough=BaselinePolicy("passthrough", len(table.names)),
            control=self.control, time_unit=lambda: self.time_unit, prio_levels=self.metrics.prio.levels)
        if self.verifier is not None:
            self.limiter.add_listener(self.verifier)
            self.metrics.registry.register(VerifyCollector(self.verifier))

    def _wire_online(self, policy: SpawnPolicy, classifier_mode: str) -> None:
        """The online loop (with ``--online``) and the collectors beside the limiter's."""
        options, table = self.options, self.table
        if options.online is not None:
            self.online = OnlineLoop(
                options.online, table=table, time_unit=self.time_unit, policy=policy,
                current=lambda: self.policy,
                swap=lambda path: self.swap(path, source="online"), classifier_mode=classifier_mode,
                age_thresholds=self.control is not None,
            )
            self.limiter.add_listener(self.online.recorder)
            if self.online.recorder.tail is not None:  # module mode's demands of a real application
                self.online.recorder.tail.runs_in = self._runs_in
            self.metrics.registry.register(OnlineCollector(self.online))
        if self.uplink.name != "fair":  # srpt/srrt/app: per-band bytes, flows, priority changes
            self.metrics.registry.register(UplinkCollector(self.uplink))
        if options.apache_side.php_stats_file:  # PHP-FPM's workers run the CPU there: their demotions
            self.metrics.registry.register(PhpPrioCollector(options.apache_side.php_stats_file))
        self.metrics.registry.register(self.cpu_location)
        self._cpu_task: asyncio.Task[None] | None = None
        self.source.register(self.metrics.registry)

    def _runs_in(self, stage: str) -> str | None:
        """Where the module last saw ``stage``'s work run (None: not known)."""
        st = self.stacks.stacks.get(stage)
        return None if st is None else st.runs_in

    def _wire_apache(self) -> None:
        """Apache's side: the upstream pool, the gate, the status probe, the admin endpoints and
        the gateway; ``lock: auto`` needs the online loop's lock watch."""
        options, table, cfg = self.options, self.table, self.table.config
        self.pool = UpstreamPool(*self.apache, connect_timeout=cfg.limits.upstream_connect_timeout)
        #: Apache's admission gate (controller.sidecar.gate), in use once Apache reports the same file
        self.gate = Gate(options.apache_side.gate, options.apache_side.gate_slots) if options.apache_side.gate else None
        self._gate_said: bool | None = None
        self._workers_checked = False  # Apache's worker limit against limits.max_inflight
        if self.gate is not None:
            self.limiter.add_listener(GateOpener(self.gate, self.limiter, options.apache_side.gate_backfill))
            self.gate.on_lost = self._gate_lost
        #: enforce: module: the stages file's stages and next against Apache's (controller.sidecar.module_stages)
        self.module_stages = (ModuleStageCheck(lambda: {s.name: s.next for s in self.table.config.stages})
                              if self.module_mode else None)
        if self.module_stages is not None:
            self.metrics.registry.register(self.module_stages)
        self.probe = ApacheProbe(
            *self.apache, self.metrics.apache, self.metrics.prio, interval=lambda: self.options.observability.status_interval,
            want_prio=(f"cpu_priority {options.apache_side.cpu_priority}" if options.apache_side.cpu_priority != "off"
                       else "the gate" if self.gate is not None
                       else "the control file" if self.control is not None else None),
            on_gate_token=self.check_gate, on_status=self.check_workers, on_prio=self._after_prio)
        self.admin = AdminEndpoints(self.metrics.registry, self, self._admin_access, lambda: self.probe.health)
        self.gateway = Gateway(
            table, self.limiter, self.classifier, self.pool, self.uplink, self.metrics,
            admin=self.admin.handle, phase_header=options.phase_header, admin_body_cap=self.admin.body_cap,
            trusted_sources=options.guards.trusted_sources,
            on_request=self._log_request,
            cpu_class=self._cpu_class if options.apache_side.cpu_priority == "class" else None,
            gate=self.gate,
        )
        if self.online is not None and self.online.lock_watch is not None:
            self.online.lock_watch.on_exempt = self._learned_exempt
            self.online.lock_watch.on_lock = self._learned_lock
        elif any(table.lock_auto(i) for i in range(len(table.names))):
            raise SidecarInputError("stages: lock: auto is learned by the online loop from Apache's request-time "
                                    "split: run with --online --access-log (online.access_log) and "
                                    "OvertakeRequestTimes On, or give the lock's capacity (lock: 1)")
        if self.gate is not None:
            gw = self.gateway
            self.metrics.gate_enabled.set_function(lambda: float(gw.gate_on))
            self.metrics.gate_in_use.set_function(lambda: float(self.gate.in_use) if self.gate else 0.0)

    def _after_prio(self, families: list[Metric]) -> None:
        """Each reading of mod_overtake_prio's status page: the control file rewritten when the
        module's level count is newly known (``cpu_priority: class``); in module mode, its stages
        against the stages file."""
        if self.control is not None:
            self.control.sync()
        if self.module_stages is not None:
            self.module_stages.update(families)

    def _learned_lock(self, stage: int, cap: int | None) -> None:
        """A ``lock: auto`` stage's learned capacity: the sidecar's lock from the next decision on,
        and the refits' model (controller.online.lockwatch)."""
        lock = self.limiter.lock
        assert lock is not None and self.online is not None  # lock: auto makes a StageLock
        lock.learn_cap(stage, cap)
        self.online.learned_locks[stage] = cap
        self.limiter.set_lock(lock)  # re-decide now: a removed lock frees its waiting requests

    def _learned_exempt(self, stages: frozenset[int]) -> None:
        """Send the requests of ``stages`` (serialised, controller.online.lockwatch) exempt from demotion."""
        self.gateway.screening.learned_exempt = stages

