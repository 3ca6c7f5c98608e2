"""Running a sidecar: start, close and drain (``SIGTERM``), and its background tasks.

:meth:`SidecarRuntime.drain` stops accepting and lets every request already received finish
within ``drain_timeout``. What it checks of Apache is in
:mod:`~overtake.controller.sidecar.apache_checks`, reloading (``SIGHUP``) in
:mod:`~overtake.controller.sidecar.reloading`, what the control endpoints see in
:mod:`~overtake.controller.sidecar.admin_view`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.admin import AdminEndpoints
from overtake.controller.sidecar.admin_view import AdminView
from overtake.controller.sidecar.apache_checks import ApacheChecks
from overtake.controller.sidecar.module_mode import enforce_for
from overtake.controller.sidecar.policies import PolicySet
from overtake.controller.sidecar.policy_in_force import log
from overtake.controller.sidecar.reloading import Reloading

__all__ = ["SidecarRuntime"]


class SidecarRuntime(Reloading, AdminView, ApacheChecks):
    """The running sidecar; :class:`~overtake.controller.sidecar.service.Sidecar` builds it."""

    listen: tuple[str, int] | None
    admin_addr: tuple[str, int]
    admin: AdminEndpoints
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

    def _log_request(self, rec: Any) -> None:
        if self.request_log is not None:
            self.request_log.write(rec)

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
            if not self.module_mode and self.listen is not None:  # module mode: Apache serves the traffic
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
