"""What the sidecar checks of the Apache beside it: that Apache has mapped the sidecar's admission
gate (while it has, queued requests wait in Apache), and that Apache's worker limit holds what the
sidecar may send it.
"""

from __future__ import annotations

from overtake.controller.sidecar.apache_probe import ApacheProbe, workers_warning
from overtake.controller.sidecar.gate import Gate
from overtake.controller.sidecar.gateway import Gateway
from overtake.controller.sidecar.policy_in_force import PolicyInForce, log

__all__ = ["ApacheChecks"]


class ApacheChecks(PolicyInForce):
    """The gate's state and the worker-limit check, said once each time they change."""

    gate: Gate | None
    probe: ApacheProbe
    gateway: Gateway
    _gate_said: bool | None
    _workers_checked: bool

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
