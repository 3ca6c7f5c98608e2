"""Assembly of the sidecar: stages, policy, classifier, limiter, gateway, metrics, hot swap.

:class:`Sidecar` builds the pieces from :class:`SidecarOptions` and runs them; the control
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
import logging
import time
from collections.abc import Callable
from typing import Any

from overtake.controller.cpu_location import CpuLocation
from overtake.controller.errors import PolicyLoadError, SidecarInputError
from overtake.controller.online import OnlineCollector, OnlineLoop
from overtake.controller.php_prio import PhpPrioCollector
from overtake.controller.sidecar.admin import AdminAccess, AdminEndpoints
from overtake.controller.sidecar.apache_probe import ApacheProbe, workers_warning
from overtake.controller.sidecar.auto import Evidence, choose
from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.control_file import ControlPublisher
from overtake.controller.sidecar.count_table import module_blocker
from overtake.controller.sidecar.gate import Gate, GateOpener
from overtake.controller.sidecar.gateway import Gateway
from overtake.controller.sidecar.limiter import Limiter
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.module_mode import check_module_options, check_module_policy, enforce_for
from overtake.controller.sidecar.options import SidecarOptions, check_numbers, parse_addr, parse_apache_url, reloaded
from overtake.controller.sidecar.policies import (
    BaselinePolicy,
    PolicySet,
    SpawnPolicy,
    class_levels,
    load_policy,
    load_policy_bytes,
)
from overtake.controller.sidecar.policy_loads import LoadSlots
from overtake.controller.sidecar.policy_source import PolicySource
from overtake.controller.sidecar.request_log import RequestLog
from overtake.controller.sidecar.stage_lock import StageLock
from overtake.controller.sidecar.stages import ClassifierSettings, StagesConfig, StageTable
from overtake.controller.sidecar.stages_reload import live_merge
from overtake.controller.sidecar.units import FORMER_DEFAULT, Resolution, resolve, units_of
from overtake.controller.sidecar.upstream import UpstreamPool
from overtake.controller.sidecar.verify import Verifier
from overtake.controller.sidecar.verify_metrics import VerifyCollector
from overtake.controller.uplink import make_uplink
from overtake.controller.uplink.errors import UplinkInputError
from overtake.controller.uplink.metrics import UplinkCollector

__all__ = ["Sidecar"]

log = logging.getLogger("overtake.sidecar")


class Sidecar:
    """Everything wired together; ``await start()``, then ``await serve_forever()`` / ``close()``."""

    def __init__(self, table: StageTable, options: SidecarOptions, *,
                 reload_options: Callable[[], SidecarOptions] | None = None,
                 reload_stages: Callable[[], StageTable] | None = None) -> None:
        self.table = table
        self.options = options
        #: SIGHUP: re-read the config (``overtake sidecar --config``); None: reload the policy only
        self.reload_options = reload_options
        #: SIGHUP: re-read the stages file and apply what can be applied live (controller.sidecar.stages_reload)
        self.reload_stages = reload_stages
        self.listen = parse_addr(options.listen, "listen")
        self.admin_addr = parse_addr(options.admin_listen, "admin_listen")
        self.apache = parse_apache_url(options.apache)
        check_numbers(options)
        check_module_options(options)
        if options.enforce == "module" and options.online is not None:  # arrivals come from the log too
            options = self.options = dataclasses.replace(
                options, online=dataclasses.replace(options.online, arrivals_from_log=True))
        #: enforce: module: mod_overtake_prio holds the requests, no traffic passes here (.module_mode)
        self.module_mode = options.enforce == "module"
        #: policy loads off the event loop: one running, a few waiting, the rest refused
        self.loads = LoadSlots()
        self._class_key: tuple[object, object] | None = None
        self._class_levels: tuple[tuple[int, ...], ...] | None = None
        self.request_log = (RequestLog(options.request_log, options.request_log_format)
                            if options.request_log else None)
        if options.uplink not in ("srpt", "srrt") and options.uplink_cutoffs is not None:
            raise UplinkInputError(f"uplink_cutoffs: only for --uplink srpt or srrt, not {options.uplink!r}")
        self.uplink = make_uplink(options.uplink, cutoffs=options.uplink_cutoffs,
                                  top_fraction=options.uplink_top_fraction,
                                  lowest_writers=options.uplink_lowest_writers,
                                  ordered_bands=options.uplink_ordered_bands)
        self.source = PolicySource(table, options, lambda spec, source: self.install(spec, source=source),
                                   lambda: self.limiter.policy)
        self.swapped_at = time.time()
        #: classifier.mode auto (controller.sidecar.auto): the evidence the traffic gives, the candidates
        self.auto = table.config.classifier.mode == "auto"
        self._auto_task: asyncio.Task[None] | None = None
        #: where the CPU runs (Apache or PHP-FPM): the module reaches only Apache's
        self.cpu_location = CpuLocation(options.cpu_priority, php_extension=bool(options.php_stats_file))
        #: the policy's age thresholds for Apache's OvertakeControlFile (controller.sidecar.control_file)
        self.control = (ControlPublisher(options.control_file, len(table.names),
                                         stage_names=table.names if self.module_mode else None)
                        if options.control_file else None)
        self._warned_unrecorded: set[str] = set()
        policy, settings = self._first_policy(self.source.first)
        self.classifier = Classifier(settings, policy)
        if self.auto:
            self.classifier.evidence = Evidence()
            self._auto_choose(policy, initial=True)  # type: ignore[arg-type]
        self._wire(policy, settings.mode)

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
            raise SidecarInputError(f"policy: {options.policy} is a directory of policies; that needs "
                                    "classifier.mode: auto in the stages file (or give one .npz)")
        if self.module_mode:
            check_module_policy(policy)
        #: seconds per model time unit (controller.sidecar.units): the policy's, else the stages file's
        res = self._resolve_unit(policy)
        self.time_unit = res.seconds if res.seconds is not None else 1.0
        self._say_unit(res.source if res.seconds is not None else "seconds: no policy model to convert")
        if options.cpu_priority == "age" and self.control is None:
            self._say_age_threshold(policy, self.time_unit)
        for p in policy.members if isinstance(policy, PolicySet) else (policy,):
            if getattr(p, "solved_priority", "off") == "class" and options.cpu_priority != "class":
                log.warning(f"policy {p.name} was solved with short-first CPU classes in force; run with "
                            "--cpu-priority class (and mod_overtake_prio, OvertakePrioAge Off) or solve without "
                            "--cpu-priority class", extra={"event": "cpu_priority_mismatch", "policy": p.name})
        return policy, settings.model_copy(update={"time_unit": self.time_unit})

    def _wire(self, policy: SpawnPolicy, classifier_mode: str) -> None:
        """Build the limiter, the metrics, the online loop, Apache's side and the gateway around
        the classifier and the first policy."""
        options, table, cfg = self.options, self.table, self.table.config
        self.limiter = Limiter(
            policy, self.classifier, stage_names=table.names,
            queue_caps=tuple(table.queue_cap(i) for i in range(len(table.names))),
            max_inflight=cfg.limits.max_inflight, passthrough_cap=cfg.passthrough.cap,
            passthrough_queue_cap=cfg.limits.queue_cap,
        )
        self.limiter.set_lock(StageLock.from_table(table))
        self.metrics = SidecarMetrics(lambda: self.limiter, time_unit=self.time_unit)
        self.online: OnlineLoop | None = None
        if self.control is not None:
            self.control.publish(self.limiter.policy, self.time_unit)
        #: the policy against Apache's default on live traffic (controller.sidecar.verify)
        self.verifier = None if options.verify is None else Verifier(
            options.verify, limiter=self.limiter, passthrough=BaselinePolicy("passthrough", len(table.names)),
            control=self.control, time_unit=lambda: self.time_unit, prio_levels=self.metrics.prio.levels)
        if self.verifier is not None:
            self.limiter.add_listener(self.verifier)
            self.metrics.registry.register(VerifyCollector(self.verifier))
        if options.online is not None:
            self.online = OnlineLoop(
                options.online, table=table, time_unit=self.time_unit, policy=policy,
                current=lambda: self.policy,
                swap=lambda path: self.swap(path, source="online"), classifier_mode=classifier_mode,
                age_thresholds=self.control is not None,
            )
            self.limiter.add_listener(self.online.recorder)
            self.metrics.registry.register(OnlineCollector(self.online))
        if self.uplink.name != "fair":  # srpt/srrt/app: per-band bytes, flows, priority changes
            self.metrics.registry.register(UplinkCollector(self.uplink))
        if options.php_stats_file:  # PHP-FPM's workers run the CPU there: their demotions
            self.metrics.registry.register(PhpPrioCollector(options.php_stats_file))
        self.metrics.registry.register(self.cpu_location)
        self._cpu_task: asyncio.Task[None] | None = None
        self.source.register(self.metrics.registry)
        self.pool = UpstreamPool(*self.apache, connect_timeout=cfg.limits.upstream_connect_timeout)
        #: Apache's admission gate (controller.sidecar.gate), in use once Apache reports the same file
        self.gate = Gate(options.gate, options.gate_slots) if options.gate else None
        self._gate_said: bool | None = None
        if self.gate is not None:
            self.limiter.add_listener(GateOpener(self.gate, self.limiter, options.gate_backfill))
            self.gate.on_lost = self._gate_lost
        self.probe = ApacheProbe(
            *self.apache, self.metrics.apache, self.metrics.prio, interval=lambda: self.options.status_interval,
            want_prio=(f"cpu_priority {options.cpu_priority}" if options.cpu_priority != "off"
                       else "the gate" if self.gate is not None
                       else "the control file" if self.control is not None else None),
            on_gate_token=self.check_gate)
        self.admin = AdminEndpoints(self.metrics.registry, self, self._admin_access, lambda: self.probe.health)
        self.gateway = Gateway(
            table, self.limiter, self.classifier, self.pool, self.uplink, self.metrics,
            admin=self.admin.handle, phase_header=options.phase_header, admin_body_cap=self.admin.body_cap,
            trusted_sources=options.trusted_sources,
            on_request=self._log_request,
            cpu_class=self._cpu_class if options.cpu_priority == "class" else None,
            gate=self.gate,
        )
        if self.online is not None and self.online.lock_watch is not None:
            self.online.lock_watch.on_exempt = self._learned_exempt
        if self.gate is not None:
            gw = self.gateway
            self.metrics.gate_enabled.set_function(lambda: float(gw.gate_on))
            self.metrics.gate_in_use.set_function(lambda: float(self.gate.in_use) if self.gate else 0.0)

    def _learned_exempt(self, stages: frozenset[int]) -> None:
        """Send the requests of ``stages`` (serialised, controller.online.lockwatch) exempt from demotion."""
        self.gateway.learned_exempt = stages

    @property
    def policy(self) -> SpawnPolicy:
        """The sidecar's policy: in force, or under verification against Apache's default."""
        return self.limiter.policy if self.verifier is None else self.verifier.chosen

    # ---- the time unit (controller.sidecar.units) -------------------------------------------------
    def _resolve_unit(self, policy: SpawnPolicy, stages: StagesConfig | None = None) -> Resolution:
        """The unit ``policy`` runs at under ``stages``' ``classifier.time_unit`` (default: the
        running stages file's); raises :class:`PolicyLoadError` (one line naming both values and
        the fix) when they disagree. Warns once per policy that recorded no unit."""
        res = resolve(units_of(policy), (stages or self.table.config).classifier.time_unit)
        for name in res.unrecorded:
            if name not in self._warned_unrecorded:
                self._warned_unrecorded.add(name)
                used = res.seconds if res.seconds is not None else FORMER_DEFAULT
                log.warning(f"policy {name} records no time unit (solved by an older overtake): its model times are "
                            f"taken as {used:g} s per unit ({res.source}); re-solve it with `overtake solve` to "
                            "carry its unit", extra={"event": "time_unit_unrecorded", "policy": name})
        return res

    def _say_unit(self, source: str) -> None:
        log.info(f"time unit: {self.time_unit:g} s per model time unit ({source})",
                 extra={"event": "time_unit", "detail": source})

    def _set_time_unit(self, seconds: float, source: str) -> None:
        """Run at a new unit from now on: the classifier's learned demands and the online loop's
        samples are rescaled, metrics and logs convert with it."""
        if seconds == self.time_unit:
            return
        self.time_unit = seconds
        self.classifier.set_time_unit(seconds)
        self.metrics.time_unit = seconds
        if self.online is not None:
            self.online.set_time_unit(seconds)
        self._say_unit(source)

    @staticmethod
    def _say_age_threshold(policy: SpawnPolicy, time_unit: float, *, warn: bool = True) -> None:
        """Log the age threshold the policy file's model chose, in seconds of thread CPU: the
        value for Apache's ``OvertakePrioLevels`` (the sidecar cannot set it)."""
        members = policy.members if isinstance(policy, PolicySet) else (policy,)
        for p in members:
            th = ((getattr(p, "priority_predictions", None) or {}).get("age") or {}).get("thresholds")
            if th and th[0] and th[0][0] is not None:
                secs = float(th[0][0]) * time_unit
                log.info(f"cpu_priority age: the model's threshold is {secs:.4g} s of thread CPU; Apache "
                         f"should run OvertakePrioLevels {secs:.4g} (mod_overtake_prio)",
                         extra={"event": "cpu_priority_threshold", "detail": f"{th[0][0]:.4g} model units x "
                                f"time_unit {time_unit:g} s, from {p.name}"})
                return
        if not warn:  # a swapped-in policy without a prediction under age priority: nothing new to say
            return
        log.warning("cpu_priority age: no policy file carries a prediction with age priority; solve with "
                    "`overtake solve --cpu-priority age` so that auto can weigh it", extra={"event": "cpu_priority_threshold"})

    def _cpu_class(self, stage: int, label: int) -> int | None:
        """mod_overtake_prio's starting level for a request of ``stage`` with ``label`` under the
        policy in force (short-first classes, :func:`~overtake.controller.sidecar.policies.class_levels`)."""
        pol = self.limiter.policy
        key = (pol, getattr(pol, "chosen", pol))  # held, so a new policy is never mistaken for it
        if self._class_key is None or key[0] is not self._class_key[0] or key[1] is not self._class_key[1]:
            self._class_key, self._class_levels = key, class_levels(pol)
        lv = self._class_levels
        if lv is None or stage >= len(lv) or not 0 <= label < len(lv[stage]):
            return None
        return lv[stage][label]

    # ---- auto (controller.sidecar.auto) ------------------------------------------------------------
    def _as_set(self, policy: SpawnPolicy) -> PolicySet:
        if isinstance(policy, PolicySet):
            return policy
        members = [] if isinstance(policy, BaselinePolicy) else [policy]
        return PolicySet(members, policy.name, len(self.table.names))

    def _auto_choose(self, ps: PolicySet, *, initial: bool = False) -> bool:
        """Choose among ``ps``'s members for the evidence so far; True when the choice changed.
        The caller installs ``ps`` (``initial``: the limiter is built with it next)."""
        ev = self.classifier.evidence
        assert ev is not None
        settings = self.table.config.classifier
        choice = choose(ps.members, ev.available(), ps.passthrough, margin=settings.auto_margin,
                        cpu_priority=self._cpu_priority_in_reach())
        changed = choice.policy is not ps.chosen or initial
        ps.adopt(choice.policy, choice.reason, choice.predicted_gain)
        if changed:
            self.classifier.mode = choice.mode
            log.info("auto: " + choice.reason, extra={
                "event": "auto_choice", "policy": choice.policy.name, "detail": f"information {choice.info}, "
                f"classifier {choice.mode}, available {', '.join(sorted(ev.available()))}, "
                f"needs enforce: {enforce_for(choice.info, self.options.uplink)}"})
        return changed

    def _cpu_priority_in_reach(self) -> str:
        """The CPU priority auto may count on: ``cpu_priority``, unless the CPU runs in PHP-FPM,
        where mod_overtake_prio cannot act and no PHP extension's counters are given."""
        if self.cpu_location.module_reaches is False and not self.options.php_stats_file:
            return "off"
        return self.options.cpu_priority

    async def _cpu_loop(self) -> None:
        """Sample where the CPU runs at Apache's scrape interval (a /proc scan, off the loop)."""
        while True:
            await asyncio.to_thread(self.cpu_location.sample)
            await asyncio.sleep(self.options.status_interval)

    async def _auto_loop(self) -> None:
        """Re-check what the traffic shows; swap when the best usable policy changes."""
        while True:
            await asyncio.sleep(self.table.config.classifier.auto_interval)  # a reload may change it
            ps = self.limiter.policy
            if isinstance(ps, PolicySet) and self._auto_choose(ps):
                self.limiter.swap(ps)
                self.metrics.swaps += 1
                self.swapped_at = time.time()
                if self.verifier is not None:  # another member: verify it afresh
                    self.verifier.adopt(ps)

    # ---- lifecycle -------------------------------------------------------------------------
    def _log_request(self, rec: Any) -> None:
        if self.request_log is not None:
            self.request_log.write(rec)

    def check_gate(self, token: int | None, detail: str = "") -> None:
        """Use the gate only while Apache reports our gate file mapped (token from its
        ``/overtake-prio-status``; None: not reported); say each change once."""
        if self.gate is None:
            return
        ok = token == self.gate.token and self.gate.check() is None
        if ok == self._gate_said:
            return
        self._gate_said = self.gateway.gate_on = ok
        if ok:
            log.info("admission gate in use: queued requests wait in Apache", extra={
                "event": "gate_on", "detail": f"{self.gate.path}, {self.options.gate_slots} slots"})
        else:
            why = detail or ("Apache reports no gate file" if token in (None, 0) else
                             f"Apache has another gate file mapped (token {token}, ours {self.gate.token})")
            log.warning("admission gate not in use: queued requests wait in the sidecar", extra={
                "event": "gate_off", "detail": f"{why}; load mod_overtake_prio with OvertakeGate {self.gate.path} "
                "(apache-conf/mod_overtake_prio/README.md)"})

    def _gate_lost(self, why: str) -> None:
        """The gate file is no longer ours (truncated, removed, replaced): requests already held
        in Apache are let through there; new ones wait here, until a restart re-creates it."""
        self._gate_said = self.gateway.gate_on = False
        assert self.gate is not None
        log.warning("admission gate lost: queued requests wait in the sidecar", extra={
            "event": "gate_lost", "detail": f"{why}; restart the sidecar to create {self.gate.path} again"})

    async def start(self) -> None:
        try:
            await self.gateway.start_admin(*self.admin_addr)
        except OSError as exc:
            raise SidecarInputError(
                f"admin_listen: cannot listen on {self.options.admin_listen} ({exc.strerror}); choose a free port"
            ) from None
        try:
            if not self.module_mode:  # module mode: Apache serves the traffic, nothing listens here
                await self.gateway.start(*self.listen)
        except OSError as exc:
            await self.gateway.close()
            raise SidecarInputError(
                f"listen: cannot listen on {self.options.listen} ({exc.strerror}); choose a free port"
            ) from None
        self.source.start()
        if self.auto:
            self._auto_task = asyncio.create_task(self._auto_loop())
        if self.online is not None:
            self.online.start()
        self._cpu_task = asyncio.create_task(self._cpu_loop())
        await self.probe.scrape()
        self.probe.start()
        self._check_apache()
        if self.verifier is not None:
            self.verifier.start()
        log.info("controller beside Apache (enforce: module): no traffic passes through the sidecar"
                 if self.module_mode else "sidecar listening", extra={
            "event": "start", "listen": None if self.module_mode else self.options.listen, "apache": self.options.apache,
            "policy": self.policy.name, "hash": self.policy.hash, "version": self.policy.version,
            "admin_listen": self.options.admin_listen,
            "detail": f"enforce {self.options.enforce}; the policy's information "
                      f"({self.policy.phase_info}) needs enforce: {enforce_for(self.policy.phase_info, self.options.uplink)}",
        })

    def _check_apache(self) -> None:
        """Warn when Apache is unreachable or has fewer workers than the sidecar may send it."""
        if self.metrics.apache.status is None:
            if not self.metrics.apache.absent:  # no mod_status is logged once by the probe
                log.warning("Apache not reachable at start", extra={"event": "config_warning",
                                                                    "detail": self.options.apache})
            return
        workers = self.probe.max_workers
        if workers is None:
            return
        warning = workers_warning(workers, self.table.config.limits.max_inflight,
                                  self.options.gate_slots if self.gate is not None else None)
        if warning is not None:
            log.warning("Apache has fewer workers than the sidecar may send it", extra={
                "event": "config_warning", "detail": warning})

    # ---- the admin endpoints' view (controller.sidecar.admin.PolicyControl) -------------------------
    def _admin_access(self) -> AdminAccess:
        return AdminAccess(self.options.admin_put, self.options.admin_token)

    def url_allowed(self, url: str) -> bool:
        """May ``PUT /-/policy`` follow ``url``?"""
        return self.source.url_allowed(url)

    async def follow(self, url: str) -> None:
        """Take the policy from ``url`` now and poll it from then on."""
        await self.source.follow(url)

    def unfollow(self) -> None:
        """An explicit policy replaced the API's: stop following it."""
        self.source.unfollow()

    def policy_info(self) -> dict[str, Any]:
        """The body of ``GET /-/policy``."""
        p = self.policy
        online = self.online
        return {
            "name": p.name, "version": p.version, "hash": p.hash, "phases": list(p.phases),
            "per_phase_queues": p.per_phase_queues, "phase_info": p.phase_info,
            "predicted_response_time_model_units": p.predicted_wait,
            "predicted_response_time_seconds": None if p.predicted_wait is None else p.predicted_wait * self.time_unit,
            "time_unit": self.time_unit,
            "phase_names": None if p.model_phases is None else [list(n) for n in p.model_phases],
            "swapped_at": self.swapped_at, "swaps": self.metrics.swaps, "refused": self.metrics.refused,
            "classifier": self.classifier.mode, "cpu_priority": self.options.cpu_priority, **self.source.info(),
            **({"auto": {"chosen": p.chosen.name, "phase_info": p.chosen.phase_info, "reason": p.reason,
                         "predicted_gain": p.predicted_gain, "candidates": [m.name for m in p.members]}}
               if isinstance(p, PolicySet) else {}),
            **({"online": online.status()} if online is not None else {}),
            **({"lock": self.limiter.lock.info(self.policy)} if self.limiter.lock is not None else {}),
            **({"verify": self.verifier.status()} if self.verifier is not None else {}),
        }

    async def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()
        if self._auto_task is not None:
            self._auto_task.cancel()
        if self._cpu_task is not None:
            self._cpu_task.cancel()
        if self.online is not None:
            await self.online.close()
        self.source.stop()
        await self.probe.stop()
        await self.gateway.close()
        if self.request_log is not None:
            self.request_log.close()

    async def drain(self) -> int:
        """SIGTERM: stop accepting, let the requests already received finish (up to
        ``drain_timeout``); the number of connections still busy at the deadline."""
        t0 = time.monotonic()
        self.admin.draining = True  # /-/healthz answers 503: load balancers stop sending
        log.info("draining", extra={"event": "drain", "detail": f"up to {self.options.drain_timeout:g} s"})
        cut = await self.gateway.drain(self.options.drain_timeout)
        log.info("drained" if not cut else "drain deadline passed", extra={
            "event": "drained", "drained": round(time.monotonic() - t0, 3), "cut": cut})
        return cut

    async def reload(self) -> None:
        """SIGHUP: apply the re-read config (reloadable settings; the others are named in a
        warning and wait for a restart), reopen the request log, reload the policy."""
        new = None
        if self.reload_options is not None:
            try:
                new = self.reload_options()
                check_numbers(new)
            except (SidecarInputError, OSError) as exc:
                log.error("config reload refused, old config kept", extra={"event": "reload_refused",
                                                                            "detail": str(exc)})
                new = None
            except Exception as exc:  # noqa: BLE001 - a reload runs as a bare task: an escape is a lost traceback
                log.error("config reload refused, old config kept", extra={
                    "event": "reload_refused", "detail": f"{exc.__class__.__name__}: {exc}"})
                new = None
        if new is not None:
            new, fixed = reloaded(self.options, new)
            if fixed:
                log.warning("config changes that need a restart were not applied", extra={
                    "event": "reload_partial", "detail": ", ".join(fixed)})
            log_changed = (new.request_log, new.request_log_format) != (self.options.request_log,
                                                                       self.options.request_log_format)
            self.options = new
            if log_changed:
                try:
                    old_log = self.request_log
                    self.request_log = RequestLog(new.request_log, new.request_log_format) if new.request_log else None
                    if old_log is not None:
                        old_log.close()
                except SidecarInputError as exc:
                    log.error("request log not reopened", extra={"event": "reload_refused", "detail": str(exc)})
        if self.request_log is not None:
            self.request_log.reopen()  # logrotate moved it
        if self.reload_stages is not None:
            self._reload_stages(self.reload_stages)
        log.info("reloading", extra={"event": "reload", "detail": "config and policy" if new else "policy"})
        await self.source.reload("sighup", new)

    def _reload_stages(self, read: Callable[[], StageTable]) -> None:
        """SIGHUP: re-read the stages file; apply what a running sidecar can change, name what
        needs a restart (``reload_partial``); a file that does not load, or whose time unit the
        running policy contradicts, is refused whole (``reload_refused``)."""
        try:
            fresh = read()
            merged, applied, restart = live_merge(self.table.config, fresh.config)
            unit = (self._resolve_unit(self.policy, merged)
                    if merged.classifier.time_unit != self.table.config.classifier.time_unit else None)
        except (SidecarInputError, OSError) as exc:  # PolicyLoadError is a SidecarInputError
            log.error("stages file reload refused, old stages kept", extra={
                "event": "reload_refused", "detail": str(exc) if not isinstance(exc, OSError)
                else f"stages file: {exc.strerror}: {exc.filename}"})
            return
        if restart:
            log.warning("stages file changes that need a restart were not applied", extra={
                "event": "reload_partial", "detail": "stages file: " + ", ".join(restart)})
        if not applied:
            return
        self._apply_stages(merged)
        if unit is not None:
            self._set_time_unit(unit.seconds if unit.seconds is not None else self.time_unit, unit.source)
        log.info("stages file changes applied", extra={"event": "reload", "detail": "; ".join(applied)})

    def _apply_stages(self, cfg: StagesConfig) -> None:
        """Run with ``cfg``, whose stages route exactly as the running ones (live_merge's output)."""
        table = StageTable(cfg)
        self.table = self.source.table = self.gateway.table = table
        if self.online is not None:
            self.online.table = table
        self.gateway.limits = self.gateway.forwarder.limits = cfg.limits
        self.pool.connect_timeout = cfg.limits.upstream_connect_timeout
        self.classifier.settings = cfg.classifier.model_copy(update={
            "time_unit": self.time_unit, "header": self.classifier.settings.header})
        self.limiter.set_limits(queue_caps=tuple(table.queue_cap(i) for i in range(len(table.names))),
                                max_inflight=cfg.limits.max_inflight, passthrough_cap=cfg.passthrough.cap,
                                passthrough_queue_cap=cfg.limits.queue_cap)

    # ---- the swap paths --------------------------------------------------------------------
    async def install(self, spec: str, *, source: str, data: bytes | None = None) -> SpawnPolicy:
        """Load ``spec`` (or ``data``, the bytes of an ``.npz`` named ``spec``) in a worker thread
        under ``policy_load_timeout`` and install it atomically; loads are bounded by
        :class:`~overtake.controller.sidecar.policy_loads.LoadSlots` (one at a time, a few waiting). On
        any error keep the old policy and raise :class:`PolicyLoadError` (one line, naming the
        field; :class:`~overtake.controller.sidecar.policy_loads.LoadBusy` when no slot is free)."""
        opts = self.options
        names = self.table.names

        def load() -> SpawnPolicy:
            if data is not None:
                return load_policy_bytes(data, spec, names, max_array_bytes=opts.policy_max_array_bytes,
                                         max_inflated_bytes=opts.policy_max_inflated_bytes)
            return load_policy(spec, names, max_bytes=opts.policy_max_bytes,
                               max_array_bytes=opts.policy_max_array_bytes,
                               max_inflated_bytes=opts.policy_max_inflated_bytes)

        try:
            new = await self._load(load, spec)
            res = self._resolve_unit(new)
            self._check_module(new)
        except (PolicyLoadError, SidecarInputError) as exc:
            self._refused(exc, source)
            raise
        return self._install(new, source, res)

    async def _load(self, load: Callable[[], SpawnPolicy], spec: str) -> SpawnPolicy:
        """``load()`` through the load slots, every failure turned into one-line PolicyLoadError."""
        timeout = self.options.policy_load_timeout
        try:
            return await self.loads.run(load, timeout, spec)
        except TimeoutError:
            raise PolicyLoadError(f"policy: loading {spec} took longer than policy_load_timeout = {timeout:g} s; "
                                  "raise it for a very large policy") from None
        except (PolicyLoadError, SidecarInputError):
            raise
        except Exception as exc:  # noqa: BLE001 - any malformed file is refused, never a traceback
            raise PolicyLoadError(f"policy: {spec}: not a usable policy ({exc.__class__.__name__}: {exc})") from None

    def swap(self, spec: str, *, source: str) -> SpawnPolicy:
        """Load ``spec`` on the calling thread and install it atomically (the online loop's own
        solved files); on any error keep the old policy and raise."""
        try:
            new = load_policy(spec, self.table.names, max_bytes=self.options.policy_max_bytes,
                              max_array_bytes=self.options.policy_max_array_bytes,
                              max_inflated_bytes=self.options.policy_max_inflated_bytes)
            res = self._resolve_unit(new)
            self._check_module(new)
        except (PolicyLoadError, SidecarInputError) as exc:
            self._refused(exc, source)
            raise
        return self._install(new, source, res)

    def _check_module(self, new: SpawnPolicy) -> None:
        """Module mode enforces count tables only: refuse a policy that sees phases or routes."""
        why = module_blocker(new) if self.module_mode else None
        if why is not None:
            raise PolicyLoadError(f"policy: {why}")

    def _refused(self, exc: Exception, source: str) -> None:
        self.metrics.refused += 1
        log.error("policy refused, old policy kept", extra={
            "event": "policy_refused", "source": source, "detail": str(exc), "policy": self.policy.name,
        })

    def _install(self, new: SpawnPolicy, source: str, unit: Resolution) -> SpawnPolicy:
        old = self.policy
        if self.auto:
            new = self._as_set(new)
            self._auto_choose(new, initial=True)
        elif isinstance(new, PolicySet):
            raise PolicyLoadError(f"policy: {new.name} is a directory of policies; that needs classifier.mode: auto")
        if unit.seconds is not None:
            self._set_time_unit(unit.seconds, unit.source)
        self.limiter.swap(new)
        self.metrics.swaps += 1
        self.swapped_at = time.time()
        log.info("policy swapped", extra={
            "event": "policy_swap", "source": source, "policy": new.name, "hash": new.hash,
            "version": new.version, "detail": f"from {old.name} ({old.hash})",
        })
        if self.control is not None:
            self.control.publish(new, self.time_unit)
        elif self.options.cpu_priority == "age":
            self._say_age_threshold(new, self.time_unit, warn=False)
        if self.verifier is not None:
            self.verifier.adopt(new)
        return new
