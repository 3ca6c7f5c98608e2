"""Running a sidecar: start, close, drain (``SIGTERM``), reload (``SIGHUP``), the admission
gate's state, and what the control endpoints see.

:meth:`SidecarRuntime.drain` stops accepting and lets every request already received finish
within ``drain_timeout``; :meth:`SidecarRuntime.reload` applies a re-read config (the settings
that need no new socket) and stages file (what does not reshape the queues,
:mod:`overtake.controller.sidecar.stages_reload`) and reloads the policy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.admin import AdminAccess, AdminEndpoints
from overtake.controller.sidecar.apache_probe import ApacheProbe, workers_warning
from overtake.controller.sidecar.gate import Gate
from overtake.controller.sidecar.gateway import Gateway
from overtake.controller.sidecar.module_mode import enforce_for
from overtake.controller.sidecar.options import SidecarOptions, check_numbers, reloaded
from overtake.controller.sidecar.policies import PolicySet
from overtake.controller.sidecar.policy_in_force import PolicyInForce, log
from overtake.controller.sidecar.policy_source import PolicySource
from overtake.controller.sidecar.request_log import RequestLog
from overtake.controller.sidecar.stages import StagesConfig, StageTable
from overtake.controller.sidecar.stages_reload import live_merge
from overtake.controller.sidecar.upstream import UpstreamPool

__all__ = ["SidecarRuntime"]


class SidecarRuntime(PolicyInForce):
    """The running sidecar; :class:`~overtake.controller.sidecar.service.Sidecar` builds it."""

    reload_options: Callable[[], SidecarOptions] | None
    reload_stages: Callable[[], StageTable] | None
    listen: tuple[str, int]
    admin_addr: tuple[str, int]
    request_log: RequestLog | None
    source: PolicySource
    pool: UpstreamPool
    gate: Gate | None
    probe: ApacheProbe
    admin: AdminEndpoints
    gateway: Gateway
    _gate_said: bool | None
    _workers_checked: bool
    _auto_task: asyncio.Task[None] | None
    _cpu_task: asyncio.Task[None] | None

    async def _cpu_loop(self) -> None:
        """Sample where the CPU runs at Apache's scrape interval (a /proc scan, off the loop)."""
        while True:
            await asyncio.to_thread(self.cpu_location.sample)
            self.stacks.update(self.metrics.prio.families)
            await asyncio.sleep(self.options.observability.status_interval)

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
                "event": "gate_on", "detail": f"{self.gate.path}, {self.options.apache_side.gate_slots} slots"})
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
        # Apache's first reading, and what the sidecar finds wrong in it, come before the
        # listeners open: a sidecar that answers has said it (or that it could not look)
        await self.probe.scrape()
        stacks = self.stacks.update(self.metrics.prio.families)
        self._check_apache()
        try:
            await self.gateway.start_admin(*self.admin_addr)
        except OSError as exc:
            raise SidecarInputError(
                f"admin_listen: cannot listen on {self.options.endpoints.admin_listen} ({exc.strerror}); choose a free port"
            ) from None
        try:
            if not self.module_mode:  # module mode: Apache serves the traffic, nothing listens here
                await self.gateway.start(*self.listen)
        except OSError as exc:
            await self.gateway.close()
            raise SidecarInputError(
                f"listen: cannot listen on {self.options.endpoints.listen} ({exc.strerror}); choose a free port"
            ) from None
        self.source.start()
        if self.auto:
            self._auto_task = asyncio.create_task(self._auto_loop())
        if self.online is not None:
            self.online.start()
        self._cpu_task = asyncio.create_task(self._cpu_loop())
        self.probe.start()
        if self.verifier is not None:
            self.verifier.start()
        enforce = enforce_for(self.policy.phase_info, self.options.uplink.name)
        log.info("controller beside Apache (enforce: module): no traffic passes through the sidecar"
                 if self.module_mode else "sidecar listening", extra={
            "event": "start", "listen": None if self.module_mode else self.options.endpoints.listen,
            "apache": self.options.endpoints.apache,
            "policy": self.policy.name, "hash": self.policy.hash, "version": self.policy.version,
            "admin_listen": self.options.endpoints.admin_listen,
            "detail": f"enforce {self.options.enforce}; the policy's information ({self.policy.phase_info}) "
                      f"needs enforce: {enforce}" + "".join(f"; stage {s}: {st.said()}" for s, st in stacks.items()),
        })

    def _check_apache(self) -> None:
        """At start: check Apache's worker limit, or say why it cannot be checked yet (the probe
        checks it at the first scrape that reads Apache's status)."""
        apache = self.metrics.apache
        if apache.status is None and not apache.absent:  # no mod_status is logged once by the probe
            why = self.probe.health.reason or "GET /server-status?auto answered with an error"
            log.warning("Apache's status could not be read at start: its worker limit is checked later", extra={
                "event": "config_warning", "detail": f"{why}; limits.max_inflight is compared with Apache's "
                "MaxRequestWorkers at the first status scrape that reads it (every observability.status_interval)"})
        self.check_workers()

    def check_workers(self) -> None:
        """Warn when Apache has fewer workers than the sidecar may send it: once, at the first
        reading of Apache's status (at start, or at the first scrape that reads it)."""
        if self._workers_checked or self.metrics.apache.status is None:
            return
        self._workers_checked = True
        workers = self.probe.max_workers
        if workers is None:
            log.warning("Apache's status has no Scoreboard: its worker limit is not checked", extra={
                "event": "config_warning", "detail": f"GET /server-status?auto at {self.options.endpoints.apache} "
                "has no Scoreboard line; check limits.max_inflight against MaxRequestWorkers by hand"})
            return
        warning = workers_warning(workers, self.table.config.limits.max_inflight,
                                  self.options.apache_side.gate_slots if self.gate is not None else None)
        if warning is not None:
            log.warning("Apache has fewer workers than the sidecar may send it", extra={
                "event": "config_warning", "detail": warning})

    # ---- the admin endpoints' view (controller.sidecar.admin.PolicyControl) -------------------------
    def _admin_access(self) -> AdminAccess:
        return AdminAccess(self.options.guards.admin_put, self.options.guards.admin_token)

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
            "classifier": self.classifier.mode, "cpu_priority": self.options.apache_side.cpu_priority, **self.source.info(),
            **({"auto": {"chosen": p.chosen.name, "phase_info": p.chosen.phase_info, "reason": p.reason,
                         "predicted_gain": p.predicted_gain, "candidates": [m.name for m in p.members]}}
               if isinstance(p, PolicySet) else {}),
            **({"online": online.status()} if online is not None else {}),
            **({"lock": self.limiter.lock.info(self.policy)} if self.limiter.lock is not None else {}),
            **({"size_class": self.size_class.info()} if self.size_class is not None else {}),
            **({"verify": self.verifier.status()} if self.verifier is not None else {}),
            **({"stacks": self.stacks.info()} if self.stacks.stacks else {}),
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
            obs = new.observability
            log_changed = (obs.request_log, obs.request_log_format) != (self.options.observability.request_log,
                                                                       self.options.observability.request_log_format)
            self.options = new
            if log_changed:
                try:
                    old_log = self.request_log
                    self.request_log = RequestLog(obs.request_log, obs.request_log_format) if obs.request_log else None
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
        self.table = self.source.table = table
        self.gateway.retable(table)
        if self.online is not None:
            self.online.table = table
        self.pool.connect_timeout = cfg.limits.upstream_connect_timeout
        self.classifier.settings = cfg.classifier.model_copy(update={
            "time_unit": self.time_unit, "header": self.classifier.settings.header})
        self.limiter.set_limits(queue_caps=tuple(table.queue_cap(i) for i in range(len(table.names))),
                                max_inflight=cfg.limits.max_inflight, passthrough_cap=cfg.passthrough.cap,
                                passthrough_queue_cap=cfg.limits.queue_cap)
