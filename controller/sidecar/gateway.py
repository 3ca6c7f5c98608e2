"""The gateway: an asyncio HTTP/1.1 reverse proxy in front of Apache (paper 004, §4.2's front end).

I/O only: routing and admission here, HTTP parsing in :mod:`overtake.controller.sidecar.http1`,
Apache's side and the response relay in :mod:`overtake.controller.sidecar.forward`. For every request it
asks :class:`overtake.controller.sidecar.stages.StageTable` for the stage,
:class:`overtake.controller.sidecar.classifier.Classifier` for the phase, then holds it in
:class:`overtake.controller.sidecar.limiter.Limiter` until the policy starts a thread for it, forwards it to Apache
on a keep-alive connection, and releases the permit the moment Apache's *whole* response has
been received (buffered up to ``response_buffer_bytes``, then streamed; so a slow client never
holds a stage slot unless the response is larger than the buffer). Responses go to the client
through the uplink (:mod:`overtake.controller.uplink`).

HTTP handling: keep-alive and pipelining on the client side (requests are answered in order),
hop-by-hop headers removed both ways (RFC 9110 §7.6.1, incl. those named in ``Connection``),
``X-Forwarded-For`` appended, ``Expect: 100-continue`` answered, chunked request bodies
de-chunked and sent with Content-Length. Malformed requests → 400, header block larger than
``max_header_bytes`` → 431, body larger than ``max_body_bytes`` → 413, a head or body behind its
deadline → 408, a body beyond the bodies' memory budget → 503; each closes only its own
connection. Queue full or queue timeout → 503 with ``Retry-After``; a client that disconnects
while queued is withdrawn (never sent to Apache); Apache unreachable or broken mid-answer → 502.

Admin paths (:mod:`overtake.controller.sidecar.admin`): every path of a separate admin listener
(``start_admin``), and the ``/-/`` paths of the public one, which the admin side answers knowing
they came from there (it serves only health checks to it). ``drain``
stops accepting and lets the requests already received finish (SIGTERM). ``on_request`` gets
one :class:`overtake.controller.sidecar.request_log.RequestRecord` per answered request (the access log).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from overtake.controller.sidecar.budget import ByteBudget
from overtake.controller.sidecar.classifier import BadPhaseHeader, Classifier
from overtake.controller.sidecar.forward import Forwarder
from overtake.controller.sidecar.gate import Gate
from overtake.controller.sidecar.http1 import REASONS, ClientConnection, Request, content_length, simple_response
from overtake.controller.sidecar.limiter import ADMITTED, PASSTHROUGH, Limiter, Ticket
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.request_log import RequestRecord
from overtake.controller.sidecar.stages import StageTable
from overtake.controller.sidecar.upstream import UpstreamPool, UpstreamResponse, Withdrawn
from overtake.controller.uplink import Uplink

__all__ = ["Answer", "Exchange", "Gateway"]

log = logging.getLogger("overtake.sidecar")
#: Apache's own status pages: the sidecar scrapes them directly, clients never get them through it
_PRIVATE = ("/server-status", "/server-info", "/overtake-prio-status")
_DRAIN_QUIET = 0.25  # s without a byte before an idle connection is closed by drain()


@dataclass(frozen=True)
class Answer:
    """A step's answer: whether the connection stays open, and the bytes to write first (none
    when the step wrote its answer itself)."""

    keep: bool
    data: bytes = b""


@dataclass
class Exchange:
    """One request on its way through the steps, and what they learned about it."""

    conn: ClientConnection
    req: Request
    rec: RequestRecord
    from_admin: bool  #: received on the admin listener
    path: str  #: normalised (RFC 3986 §6.2.2, dot segments, merged slashes): what Apache routes on
    stage: int = PASSTHROUGH
    phase: int = 0
    route_key: str = ""
    ticket: Ticket | None = None
    gate: tuple[int, bytes] | None = None  #: the gate slot and header value, when it waits in Apache
    admitted: Callable[[], Awaitable[bool]] | None = None  #: with a gate slot: waits for the admission

    def refuse(self, status: int, message: str) -> Answer:
        """A plain-text error answer; the connection stays open when the client asked so."""
        self.rec.status = status
        return Answer(self.req.keep_alive, simple_response(status, message, close=not self.req.keep_alive))


class Gateway:
    """The proxy. Build with the pieces, then ``await gateway.start(host, port)``; ``close()`` ends it."""

    def __init__(
        self,
        table: StageTable,
        limiter: Limiter,
        classifier: Classifier,
        pool: UpstreamPool,
        uplink: Uplink,
        metrics: SidecarMetrics,
        *,
        admin: Callable[[Request, bool], Awaitable[tuple[int, bytes, bytes]]] | None = None,
        phase_header: str | None = None,
        admin_body_cap: Callable[[str], tuple[int, str]] | None = None,
        on_request: Callable[[RequestRecord], None] | None = None,
        trusted_sources: Sequence[str] = ("127.0.0.0/8", "::1/128"),
        cpu_class: Callable[[int, int], int | None] | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.table = table
        #: stages the online loop found serialised (controller.online.lockwatch): sent exempt, as cpu_exempt
        self.learned_exempt: frozenset[int] = frozenset()
        self.limits = table.config.limits
        self.limiter = limiter
        self.classifier = classifier
        self.pool = pool
        self.uplink = uplink
        self.metrics = metrics
        self.admin = admin
        #: (body bytes a /-/ request from this peer may carry, the refusal when 0)
        self.admin_body_cap = admin_body_cap
        self.on_request = on_request
        #: (stage, label) -> mod_overtake_prio starting level to send, or None (--cpu-priority class)
        self.cpu_class = cpu_class
        #: Apache's admission gate (controller.sidecar.gate); queued requests use it while ``gate_on``
        #: (the sidecar sets it once Apache reports the same gate file), one per slot of it
        self.gate = gate
        self.gate_on = False
        self.admin_server: asyncio.base_events.Server | None = None
        self._admin_conns: set[ClientConnection] = set()
        self._draining = False
        self._current: dict[ClientConnection, Request] = {}
        #: per client, the reservation for its next-stage request (the limiter's tandem routing)
        #: and the timer that gives it up
        self._holds: dict[ClientConnection, tuple[Ticket, asyncio.TimerHandle]] = {}
        #: the request path, in order (HAProxy's analysers, starlette's middleware): each step
        #: answers the request or returns None to pass it on; :meth:`forward` always answers
        self.steps: tuple[Callable[[Exchange], Awaitable[Answer | None]], ...] = (
            self.refuse_bad_target, self.hide_private, self.strip_untrusted, self.serve_admin, self.route,
            self.tunnel, self.reserve, self.admit, self.forward)
        self.forwarder = Forwarder(pool, uplink, limiter, metrics, self.limits)
        #: request bodies held in memory by all connections (limits.body_budget_bytes)
        self.body_budget = ByteBudget(self.limits.body_budget_bytes)
        self.phase_header = (phase_header or table.config.classifier.header).lower().encode()
        self.next_header = table.config.classifier.next_header.lower().encode()
        #: headers honoured from trusted sources only, else stripped: those that steer scheduling,
        #: and X-Forwarded-Proto (a front end that terminated TLS says https; a client must not)
        self._steering = frozenset({self.phase_header, self.next_header, b"x-overtake-class", b"x-overtake-exempt",
                                    b"x-forwarded-proto"})
        self._trusted_nets = tuple(ipaddress.ip_network(c, strict=False) for c in trusted_sources)
        self._trust: dict[str, bool] = {}
        self._conns: set[ClientConnection] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._hist: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # ---- server ----------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._client, host, port, backlog=1024, limit=1 << 16)
        prepare = getattr(self.uplink, "prepare_listener", None)
        if prepare is not None:  # SYN-ACKs in the control band (papers 001/003), not with small responses
            for sock in self.server.sockets:
                prepare(sock)
        self._sweeper = asyncio.create_task(self._sweep())

    async def start_admin(self, host: str, port: int) -> None:
        """Serve the /-/ paths on their own listener; the public one no longer does."""
        self.admin_server = await asyncio.start_server(self._admin_client, host, port, limit=1 << 16)

    async def _admin_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._client(reader, writer, admin=True)

    async def drain(self, timeout: float) -> int:
        """Stop accepting; close idle connections; let the requests already received (in Apache,
        queued, or pipelined) finish, each connection closing after its last answer; after
        ``timeout`` seconds close what is left. Returns the connections still busy then."""
        self._draining = True
        if self.server is not None:
            self.server.close()
        for c in self._conns:
            cur = self._current.get(c)
            if cur is not None and not c.ready and c not in self._admin_conns:
                cur.keep_alive = False  # its answer says Connection: close
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            public = [c for c in self._conns if c not in self._admin_conns]
            for c in public:
                # idle: nothing in progress, nothing parsed or half-received, quiet for a moment
                # (a client that connected just before the signal gets its request read)
                if c not in self._current and not c.ready and c.cur is None and now - c.last_active > _DRAIN_QUIET:
                    c.writer.close()
            if not public or now >= deadline:
                return len(public)
            await asyncio.sleep(0.02)

    async def _sweep(self) -> None:
        """Close client connections idle (no request in progress) longer than client_timeout, and
        those whose request head takes longer than header_timeout or whose body falls behind
        its deadline (408, :meth:`ClientConnection.body_late`): one timer for all connections
        instead of one per request."""
        lim = self.limits
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            cutoff = now - lim.client_timeout
            for c in list(self._conns):
                if c.head_started is not None and now - c.head_started > lim.header_timeout:
                    self._cut(c, "header_timeout", f"request head not complete within {lim.header_timeout:g} s")
                elif c.body_late(now):
                    self._cut(c, "body_timeout", f"request body too slow: due within {lim.body_timeout:g} s "
                              f"plus 1 s per {lim.body_min_rate} bytes received")
                elif not c.busy and not c.ready and c.last_active < cutoff:
                    c.writer.close()

    def _cut(self, c: ClientConnection, reason: str, message: str) -> None:
        """A request being read missed its deadline (slowloris, a stalled body): 408, then close
        (no 408 while an answer is being written: it would land inside it)."""
        self.metrics.errors.labels(reason).inc()
        if not c.busy:
            c.writer.write(simple_response(408, message, close=True))
        c.writer.close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for srv in (self.server, self.admin_server):
            if srv is not None:
                srv.close()
        for c in list(self._conns):
            c.writer.close()
        # end the per-connection tasks here, not in the loop's final cancel-all, which would
        # report each still-waiting handler as a CancelledError traceback
        self._closing = True
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.pool.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, admin: bool = False) -> None:
        conn = ClientConnection(self.limits, reader, writer, self.body_budget)
        if admin:
            self._admin_conns.add(conn)
        if self.admin is None or (self.admin_server is not None and not admin):
            conn.admin_body_max, conn.admin_refusal = 0, "control endpoints are not served on this listener"
        elif self.admin_body_cap is not None:
            conn.admin_body_max, conn.admin_refusal = self.admin_body_cap(conn.peer)
        self._conns.add(conn)
        reading = asyncio.create_task(conn.read_loop())
        me = asyncio.current_task()
        for t in (me, reading):
            if t is not None:
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
        try:
            while True:
                req = await conn.next_request()
                if req is None:
                    if conn.error is not None and not conn.ready:
                        status, reason, msg = conn.error
                        self.metrics.errors.labels(reason).inc()
                        retry = b"Retry-After: %d\r\n" % self.limits.retry_after if status == 503 else b""
                        await self._send(writer, simple_response(status, msg, close=True, extra=retry))
                    break
                conn.busy = True
                if self._draining and not conn.ready and not admin:
                    req.keep_alive = False  # the last answer before the drain closes it
                self._current[conn] = req
                rec = RequestRecord(time.time(), time.monotonic(), conn.peer, req.method.decode("latin-1"),
                                    req.url.decode("latin-1"), req.version)
                keep = await self._handle(conn, req, rec)
                del self._current[conn]
                if self.on_request is not None:
                    self._log_request(req, rec)
                conn.busy = False
                conn.answered()
                conn.last_active = time.monotonic()
                if not keep or (self._draining and not conn.ready and not admin):
                    break
        except asyncio.CancelledError:
            # close() cancels us: end normally, since Python 3.11's start_server callback calls
            # task.exception() on a cancelled task and prints a CancelledError traceback
            if not self._closing:
                raise
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
            conn.release_all()
            self._conns.discard(conn)
            self._admin_conns.discard(conn)
            self._current.pop(conn, None)
            hold = self._drop_hold(conn)
            if hold is not None:
                self.limiter.abandon(hold)
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        await self.forwarder.send(writer, data)

    # ---- one request -----------------------------------------------------------------------
    def _hists(self, stage: int, phase: int) -> tuple[Any, Any]:
        h = self._hist.get((stage, phase))
        if h is None:
            labels = ("passthrough", "all") if stage == PASSTHROUGH else (self.table.names[stage], str(phase + 1))
            h = (self.metrics.duration.labels(*labels), self.metrics.queue_wait.labels(*labels))
            self._hist[(stage, phase)] = h
        return h

    def _log_request(self, req: Request, rec: RequestRecord) -> None:
        for k, v in req.headers:
            lk = k.lower()
            if lk == b"host":
                rec.host = v.decode("latin-1")
            elif lk == b"user-agent":
                rec.user_agent = v.decode("latin-1")
            elif lk == b"referer":
                rec.referer = v.decode("latin-1")
        assert self.on_request is not None
        self.on_request(rec)

    async def _handle(self, conn: ClientConnection, req: Request, rec: RequestRecord) -> bool:
        """Answer one request through :attr:`steps`; False when the client connection must close."""
        ex = Exchange(conn, req, rec, from_admin=conn in self._admin_conns, path=req.path)
        for step in self.steps:
            answer = await step(ex)
            if answer is not None:
                if answer.data:
                    await self._send(conn.writer, answer.data)
                return answer.keep
        raise AssertionError("the last step answers every request")

    # ---- the steps, in order: each answers the request or lets the next one see it ---------
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
        status, ctype, body = await self.admin(ex.req, not ex.from_admin and self.admin_server is not None)
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

    async def tunnel(self, ex: Exchange) -> Answer | None:
        """A WebSocket handshake holds its slot until the tunnel closes (:meth:`_tunnel`)."""
        if ex.req.upgrade is None:
            return None
        return Answer(await self._tunnel(ex.conn, ex.req, ex.rec, ex.stage, ex.phase, ex.route_key))

    async def reserve(self, ex: Exchange) -> Answer | None:
        """The request's ticket in the limiter (the client's reservation when it has one); 503
        when its queue is full."""
        t = self._enter(ex.conn, ex.stage, ex.phase, ex.route_key)
        if t is None:
            ex.rec.status = 503
            return Answer(ex.req.keep_alive, self._busy("queue full"))
        ex.ticket = t
        return None

    async def admit(self, ex: Exchange) -> Answer | None:
        """A queued request waits for the policy to start a thread for it: here, or, with a
        gate slot free, inside Apache's gate (it is then sent at once, and :meth:`forward`
        waits for the admission that opens the slot)."""
        t = ex.ticket
        assert t is not None
        if t.status == ADMITTED:
            self._admitted_now(ex)
            return None
        ex.gate = self._arm(t)
        if ex.gate is None:
            if not await self._wait(ex.conn, t, ex.stage):
                return Answer(await self._withdrawn(ex.conn, ex.req, ex.rec, t))
            self._admitted_now(ex)
            return None

        async def admitted() -> bool:
            # sent already, held in Apache's gate: the limiter's admission opens it and a
            # withdrawal cancels it (controller.sidecar.gate.GateOpener)
            if await self._wait(ex.conn, t, ex.stage):
                self._admitted_now(ex)
                return True
            return False

        ex.admitted = admitted
        return None

    async def forward(self, ex: Exchange) -> Answer:
        """To Apache and back; the permit is released when Apache's whole answer is in."""
        t, conn, rec = ex.ticket, ex.conn, ex.rec
        assert t is not None
        h_dur = self._hists(ex.stage, t.start_phase)[0]

        async def complete(resp: UpstreamResponse) -> None:
            rec.status = resp.status
            rec.bytes = content_length(resp.headers) if resp.streamed else resp.body_bytes
            rec.upstream = self.limiter.clock() - t.t_admit
            await self._complete(conn, ex.req, t, resp, h_dur)

        level = (self.cpu_class(ex.stage, t.start_phase)
                 if self.cpu_class is not None and ex.stage != PASSTHROUGH else None)
        try:
            keep = await self.forwarder.forward(conn, ex.req, t, complete, level,
                                                gate=None if ex.gate is None else ex.gate[1], admitted=ex.admitted)
        except Withdrawn:
            return Answer(await self._withdrawn(conn, ex.req, rec, t))
        finally:
            if ex.gate is not None:
                t.gate = None
                assert self.gate is not None
                self.gate.free(ex.gate[0])
        if rec.status == 0 and not conn.closed.done():
            rec.status = 502  # the forwarder answered Apache's failure
        return Answer(keep)

    def _admitted_now(self, ex: Exchange) -> None:
        t = ex.ticket
        assert t is not None
        self._hists(ex.stage, t.start_phase)[1].observe(t.t_admit - t.t_arrive)
        ex.rec.queue_wait = t.t_admit - t.t_arrive
        if ex.stage != PASSTHROUGH:
            ex.rec.phase = t.start_phase + 1

    async def _tunnel(self, conn: ClientConnection, req: Request, rec: RequestRecord, stage: int, phase: int,
                      route_key: str) -> bool:
        """A WebSocket handshake: admitted as a request of its route (the stage's policy, or the
        passthrough cap), it holds that slot until the tunnel closes, for Apache's worker is busy
        with it all along (``overtake_stage_completed_total{outcome="tunnel"}``). The connection
        closes after it (False)."""
        t = self._enter(conn, stage, phase, route_key)
        if t is None:
            rec.status = 503
            await self._send(conn.writer, self._busy("queue full"))
            return False
        if t.status != ADMITTED:
            watch = asyncio.create_task(conn.watch_close())  # its reader is the tunnel's: no EOF seen otherwise
            try:
                admitted = await self._wait(conn, t, stage)
            finally:
                watch.cancel()
            if not admitted:
                await self._withdrawn(conn, req, rec, t)
                return False
        rec.queue_wait = t.t_admit - t.t_arrive
        try:
            rec.status = await self.forwarder.tunnel(conn, req)
        finally:
            self.limiter.release(t, "tunnel")
        return False

    def _arm(self, t: Ticket) -> tuple[int, bytes] | None:
        """A gate slot for queued ``t`` (it is then sent to Apache at once), or None: no gate, a
        passthrough request, or every slot in use (it waits here, as without a gate)."""
        lock = self.limiter.lock  # a locked stage's waiting requests stay out of Apache
        if not self.gate_on or self.gate is None or t.stage == PASSTHROUGH or (lock is not None and lock.locked(t.stage)):
            return None
        armed = self.gate.arm()  # the gate has gate_slots slots
        if armed is None:
            self.metrics.gate_full.inc()
            return None
        t.gate = armed[0]
        for fn in self.limiter.after_dispatch:  # the decision ran before the slot: idle starts
            fn()
        return armed

    async def _withdrawn(self, conn: ClientConnection, req: Request, rec: RequestRecord, t: Ticket) -> bool:
        """A queued request timed out or its client went away: 503, or close."""
        rec.queue_wait = self.limiter.clock() - t.t_arrive
        if conn.closed.done():
            return False
        rec.status = 503
        await self._send(conn.writer, self._busy("queue timeout"))
        return req.keep_alive

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
        held = self._holds.get(conn)
        hold = None if held is None else held[0]
        # a linked stage's reservation carries the previous stage's request (_follow)
        link = hold.route if self.table.linked[stage] and hold is not None and hold.stage == stage else ""
        key = self.table.learned_key(route, method, path, query, _body_size(req), link)
        return stage, self.classifier.start_phase(stage, key, phase_value, route_phase), key

    def _enter(self, conn: ClientConnection, stage: int, phase: int, route_key: str) -> Ticket | None:
        """The request's ticket: the client's reservation when it asks for the reserved stage,
        else a new one; None when the queue is full."""
        lim = self.limiter
        hold = self._drop_hold(conn)
        if hold is not None:
            if stage == hold.stage:
                gap = lim.clock() - hold.t_arrive
                t = lim.claim(hold, phase, route_key)
                if t is not None:
                    self.metrics.follow_up_gap.labels(self.table.names[stage]).observe(gap)
                    return t
            else:
                lim.abandon(hold)  # the client asked for something else
        return lim.submit(stage, phase, route_key)

    def _follow(self, conn: ClientConnection, req: Request, t: Ticket) -> tuple[int, int] | None:
        """(stage, phase) of the request this client sends next, when its stage has a ``next``."""
        if t.stage == PASSTHROUGH or not req.keep_alive or conn.closed.done():
            return None
        nxt = self.table.next_stage[t.stage]
        if nxt is None:
            return None
        value = next((v for k, v in req.headers if k.lower() == self.next_header), None)
        # a linked stage learns per previous request: its follow-up's phase is predicted from it
        try:
            return nxt, self.classifier.start_phase(nxt, self.table.follow_up_key(nxt, t.route), value, None,
                                                    observe=False)
        except BadPhaseHeader:
            self.metrics.errors.labels("bad_phase").inc()
            return nxt, self.classifier.prior_phase[nxt]

    def _drop_hold(self, conn: ClientConnection) -> Ticket | None:
        """Forget the client's reservation (its timer too); the reservation, if it had one."""
        held = self._holds.pop(conn, None)
        if held is None:
            return None
        held[1].cancel()
        return held[0]

    def _lapse(self, conn: ClientConnection, hold: Ticket) -> None:
        """The follow-up did not come within ``follow_up_timeout``: the reservation is given up."""
        held = self._holds.get(conn)
        if held is not None and held[0] is hold:
            self._drop_hold(conn)
            self.limiter.abandon(hold)

    def _busy(self, why: str) -> bytes:
        return simple_response(503, f"overtake sidecar: {why}; retry later", close=False,
                               extra=b"Retry-After: %d\r\n" % self.limits.retry_after)

    async def _wait(self, conn: ClientConnection, t: Ticket, stage: int) -> bool:
        """Wait for admission; on timeout or client disconnect withdraw the ticket.

        The task awaits the ticket's future itself (no asyncio.wait): admission wakes it in one
        loop step, so the released request reaches Apache with the least delay."""
        fut = t.future
        assert fut is not None
        timeout = self.table.queue_timeout(stage) if stage != PASSTHROUGH else self.limits.queue_timeout

        def interrupt(_: object = None) -> None:
            if not fut.done():
                fut.set_result(None)  # wakes us; t.status says whether we were admitted

        loop = asyncio.get_running_loop()
        timer = loop.call_later(timeout, interrupt)
        conn.closed.add_done_callback(interrupt)
        try:
            await fut
        except asyncio.CancelledError:
            self.limiter.cancel(t, "client_gone")
            raise
        finally:
            timer.cancel()
            conn.closed.remove_done_callback(interrupt)
        if t.status == ADMITTED:
            return True
        self.limiter.cancel(t, "client_gone" if conn.closed.done() else "queue_timeout")
        return False

    async def _complete(self, conn: ClientConnection, req: Request, t: Ticket, resp: UpstreamResponse,
                        h_dur: Any) -> None:
        """Apache has sent everything: release the permit (reserving the client's next stage),
        let the requests it admitted go first, and record the duration and the demand."""
        done = self.limiter.clock()
        admitted = self.limiter.admitted_total
        hold = self.limiter.release(t, "completed", self._follow(conn, req, t))
        if hold is not None:
            hold.route = t.route  # the link a linked stage's follow-up is learned under (_route)
            self._holds[conn] = (hold, asyncio.get_running_loop().call_later(
                self.limits.follow_up_timeout, self._lapse, conn, hold))
        if self.limiter.admitted_total != admitted:
            # the policy released waiting requests: let them reach Apache before we spend time on
            # this client (an idle gap on Apache's core costs every request behind it)
            await asyncio.sleep(0)
        h_dur.observe(done - t.t_arrive)
        if t.stage != PASSTHROUGH and self.classifier.collects:
            self.classifier.observe(t.stage, t.route, _demand(resp, done - t.t_admit))


def _body_size(req: Request) -> int | None:
    """The request body's length: declared, else as received; None for no body."""
    declared = next((v for k, v in req.headers if k.lower() == b"content-length"), None)
    if declared is not None and declared.strip().isdigit():
        return int(declared)
    n = sum(len(b) for b in req.body)
    return n or None


def _demand(resp: UpstreamResponse, sojourn: float) -> float:
    for k, v in resp.headers:
        if k.lower() == b"x-stage-cpu-us":
            try:
                return int(v) / 1e6
            except ValueError:
                break
    return sojourn
