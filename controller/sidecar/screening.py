"""The gateway's first steps: what a request may ask, who may steer it, and where it goes.

In order: a target whose routing could differ from Apache's is refused, Apache's status pages
are hidden, the headers that steer scheduling are stripped from untrusted clients, the admin
paths are answered (:mod:`overtake.controller.sidecar.admin`), and the request is routed to its
stage and start phase (:class:`~overtake.controller.sidecar.stages.StageTable`,
:class:`~overtake.controller.sidecar.classifier.Classifier`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import InitVar, dataclass

from overtake.controller.sidecar.classifier import BadPhaseHeader, Classifier
from overtake.controller.sidecar.exchange import Answer, Exchange
from overtake.controller.sidecar.heads import REASONS
from overtake.controller.sidecar.http1 import ClientConnection
from overtake.controller.sidecar.limiter import PASSTHROUGH
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.request import Request
from overtake.controller.sidecar.reservations import Reservations
from overtake.controller.sidecar.stages import StageTable

__all__ = ["Screening"]

#: Apache's own status pages: the sidecar scrapes them directly, clients never get them through it
_PRIVATE = ("/server-status", "/server-info", "/overtake-prio-status")


@dataclass(eq=False)
class Screening:
    """The steps before admission: :meth:`refuse_bad_target`, :meth:`hide_private`,
    :meth:`strip_untrusted`, :meth:`serve_admin`, :meth:`route`."""

    table: StageTable
    classifier: Classifier
    metrics: SidecarMetrics
    holds: Reservations
    admin: Callable[[Request, bool], Awaitable[tuple[int, bytes, bytes]]] | None
    phase_header: bytes
    next_header: InitVar[bytes]
    trusted_sources: InitVar[Sequence[str]]
    #: the admin paths have a listener of their own: the public one answers only health checks
    separate_admin: bool = False
    #: stages the online loop found serialised (controller.online.lockwatch): sent exempt, as cpu_exempt
    learned_exempt: frozenset[int] = frozenset()

    def __post_init__(self, next_header: bytes, trusted_sources: Sequence[str]) -> None:
        #: headers honoured from trusted sources only, else stripped: those that steer scheduling,
        #: and X-Forwarded-Proto (a front end that terminated TLS says https; a client must not)
        self._steering = frozenset({self.phase_header, next_header, b"x-overtake-class", b"x-overtake-exempt",
                                    b"x-forwarded-proto"})
        self._trusted_nets = tuple(ipaddress.ip_network(c, strict=False) for c in trusted_sources)
        self._trust: dict[str, bool] = {}

    async def refuse_bad_target(self, ex: Exchange) -> Answer | None:
        """A target whose routing could differ from Apache's is refused, as HAProxy does."""
        if ex.req.bad_target is None:
            return None
        self.metrics.errors.labels("bad_target").inc()
        return ex.refuse(400, f"request-target: {ex.req.bad_target}")

    async def hide_private(self, ex: Exchange) -> Answer | None:
        """Apache's status pages trust the sidecar's loopback address (Require local): a client
        must never reach them through it."""
        if not ex.path.startswith(_PRIVATE):
            return None
        self.metrics.errors.labels("private_path").inc()
        return ex.refuse(404, "not found")

    async def strip_untrusted(self, ex: Exchange) -> Answer | None:
        """The headers that steer scheduling count only from ``trusted_sources``."""
        if not self._trusted(ex.conn.peer):
            ex.req.headers = [(k, v) for k, v in ex.req.headers if k.lower() not in self._steering]
        return None

    async def serve_admin(self, ex: Exchange) -> Answer | None:
        """Every request of the admin listener, and ``/-/`` paths of the public one (where the
        admin side serves only health checks)."""
        if self.admin is None or not (ex.path.startswith("/-/") or ex.from_admin):
            return None
        ex.rec.stage = "admin"
        status, ctype, body = await self.admin(ex.req, not ex.from_admin and self.separate_admin)
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            status, REASONS.get(status, b"Error"), ctype, len(body),
            b"" if ex.req.keep_alive else b"Connection: close\r\n")
        ex.rec.status, ex.rec.bytes = status, len(body)
        return Answer(ex.req.keep_alive, head + body)

    async def route(self, ex: Exchange) -> Answer | None:
        """The request's stage (or passthrough), start phase and route key."""
        try:
            ex.stage, ex.phase, ex.route_key = self._route(ex.conn, ex.req, ex.path)
        except BadPhaseHeader as exc:
            self.metrics.errors.labels("bad_phase").inc()
            return ex.refuse(400, str(exc))
        ex.rec.stage = "passthrough" if ex.stage == PASSTHROUGH else self.table.names[ex.stage]
        if ex.stage != PASSTHROUGH and (self.table.cpu_exempt(ex.stage, ex.req.method.decode("latin-1"))
                                         or ex.stage in self.learned_exempt):
            self._exempt(ex.req, ex.stage)
        return None

    def _exempt(self, req: Request, stage: int) -> None:
        """A request that may hold a lock (the stage's ``cpu_exempt``): mod_overtake_prio keeps its
        priority (``X-Overtake-Exempt``), counted in ``overtake_stage_cpu_exempt_total{stage}``."""
        if not any(k.lower() == b"x-overtake-exempt" for k, _ in req.headers):
            req.headers.append((b"X-Overtake-Exempt", b"1"))
        self.metrics.cpu_exempt.labels(self.table.names[stage]).inc()

    def _trusted(self, peer: str) -> bool:
        """May ``peer`` set the phase and class headers (``trusted_sources``)?"""
        hit = self._trust.get(peer)
        if hit is None:
            try:
                addr = ipaddress.ip_address(peer)
                hit = any(addr in net for net in self._trusted_nets)
            except ValueError:
                hit = False
            if len(self._trust) > 4096:
                self._trust.clear()
            self._trust[peer] = hit
        return hit

    def _route(self, conn: ClientConnection, req: Request, path: str) -> tuple[int, int, str]:
        """(stage, start phase, learned key) of a request; raises :class:`BadPhaseHeader`."""
        method = req.method.decode("latin-1")
        query = req.target.partition(b"?")[2].decode("latin-1")
        routed = self.table.route(method, path, query)
        if routed is None:
            return PASSTHROUGH, 0, ""
        stage, route, route_phase = routed
        phase_value = next((v for k, v in req.headers if k.lower() == self.phase_header), None)
        hold = self.holds.held(conn)
        # a linked stage's reservation carries the previous stage's request (Dispatch._follow)
        link = hold.route if self.table.linked[stage] and hold is not None and hold.stage == stage else ""
        key = self.table.learned_key(route, method, path, query, _body_size(req), link)
        return stage, self.classifier.start_phase(stage, key, phase_value, route_phase), key


def _body_size(req: Request) -> int | None:
    """The request body's length: declared, else as received; None for no body."""
    declared = next((v for k, v in req.headers if k.lower() == b"content-length"), None)
    if declared is not None and declared.strip().isdigit():
        return int(declared)
    n = sum(len(b) for b in req.body)
    return n or None


