"""Reloading a running sidecar (``SIGHUP``): a re-read config (the settings that need no new
socket), the request log reopened, a re-read stages file (what does not reshape the queues,
:mod:`overtake.controller.sidecar.stages_reload`) and the policy.
"""

from __future__ import annotations

from collections.abc import Callable

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.cpu_choice import CpuChoice
from overtake.controller.sidecar.gateway import Gateway
from overtake.controller.sidecar.options import SidecarOptions, check_numbers, reloaded, with_cpu_priority
from overtake.controller.sidecar.policy_in_force import PolicyInForce, log
from overtake.controller.sidecar.policy_source import PolicySource
from overtake.controller.sidecar.request_log import RequestLog
from overtake.controller.sidecar.stages import StagesConfig, StageTable
from overtake.controller.sidecar.stages_reload import live_merge
from overtake.controller.sidecar.upstream import UpstreamPool

__all__ = ["Reloading"]


class Reloading(PolicyInForce):
    """``SIGHUP``: what a running sidecar can change without a restart, and a warning naming the rest."""

    reload_options: Callable[[], SidecarOptions] | None
    cpu_choice: CpuChoice
    reload_stages: Callable[[], StageTable] | None
    request_log: RequestLog | None
    source: PolicySource
    pool: UpstreamPool
    gateway: Gateway

    async def reload(self) -> None:
        """SIGHUP: apply the re-read config (reloadable settings; the others are named in a
        warning and wait for a restart), reopen the request log, reload the policy."""
        new = None
        if self.reload_options is not None:
            try:
                new = self.reload_options()
                check_numbers(new)
                if new.apache_side.cpu_priority == self.cpu_choice.requested:  # auto stays as resolved
                    new = with_cpu_priority(new, self.cpu_choice.chosen)
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
