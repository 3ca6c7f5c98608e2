"""The gateway's admission steps: a request's ticket in the limiter (:meth:`Admission.reserve`),
its wait for the policy to start a thread for it (:meth:`Admission.admit`: here, or inside
Apache's gate, :mod:`overtake.controller.sidecar.gate`), and a WebSocket handshake, which holds
its slot until its tunnel closes (:meth:`Admission.tunnel`).

Queue full or queue timeout → 503 with ``Retry-After``; a client that disconnects while queued
is withdrawn (never sent to Apache).
"""

from __future__ import annotations

import asyncio

from overtake.controller.sidecar.exchange import Answer, Exchange, TicketSteps, Wiring
from overtake.controller.sidecar.heads import simple_response
from overtake.controller.sidecar.http1 import ClientConnection
from overtake.controller.sidecar.limiter import ADMITTED, PASSTHROUGH, Ticket
from overtake.controller.sidecar.request import Request
from overtake.controller.sidecar.request_log import RequestRecord
from overtake.controller.sidecar.stages import StageTable

__all__ = ["Admission"]


class Admission(TicketSteps):
    """The steps :meth:`tunnel`, :meth:`reserve` and :meth:`admit`."""

    def __init__(self, table: StageTable, wiring: Wiring) -> None:
        super().__init__(table, wiring)
        #: queued requests use Apache's gate while ``gate_on`` (the sidecar sets it once Apache
        #: reports the same gate file), one per slot of it
        self.gate_on = False

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
                return Answer(await self.withdrawn(ex.conn, ex.req, ex.rec, t))
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

    def _admitted_now(self, ex: Exchange) -> None:
        t = ex.ticket
        assert t is not None
        self.hists.get(ex.stage, t.start_phase, self.table.names)[1].observe(t.t_admit - t.t_arrive)
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
                await self.withdrawn(conn, req, rec, t)
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

    async def withdrawn(self, conn: ClientConnection, req: Request, rec: RequestRecord, t: Ticket) -> bool:
        """A queued request timed out or its client went away: 503, or close."""
        rec.queue_wait = self.limiter.clock() - t.t_arrive
        if conn.closed.done():
            return False
        rec.status = 503
        await self._send(conn.writer, self._busy("queue timeout"))
        return req.keep_alive
    def _enter(self, conn: ClientConnection, stage: int, phase: int, route_key: str) -> Ticket | None:
        """The request's ticket: the client's reservation when it asks for the reserved stage,
        else a new one; None when the queue is full."""
        lim = self.limiter
        hold = self.holds.drop(conn)
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

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        await self.forwarder.send(writer, data)
