"""The gateway's request path, one step at a time (no Apache, no listener).

Each step gets a real request, parsed by :class:`~overtake.controller.sidecar.http1.ClientConnection`
from bytes written into a socket pair, and a real limiter, classifier and stage table; a step
either answers (an :class:`~overtake.controller.sidecar.exchange.Answer`) or passes the request on
(None), having recorded what it learned on the :class:`~overtake.controller.sidecar.exchange.Exchange`.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.exchange import Answer, Exchange
from overtake.controller.sidecar.gateway import Gateway
from overtake.controller.sidecar.http1 import ClientConnection
from overtake.controller.sidecar.limiter import ADMITTED, PASSTHROUGH, Limiter
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.policies import load_policy
from overtake.controller.sidecar.request_log import RequestRecord
from overtake.controller.sidecar.stages import StagesConfig, StageTable
from overtake.controller.sidecar.upstream import UpstreamPool
from overtake.controller.uplink import make_uplink

STAGES = {"stages": [{"name": "s1", "path": "^/s1", "queue_cap": 1}, {"name": "s2", "path": "^/s2"}],
          "classifier": {"mode": "explicit"}}


def _gateway(policy: str = "pi(1)") -> Gateway:
    table = StageTable(StagesConfig.model_validate(STAGES))
    cfg = table.config
    pol = load_policy(policy, table.names)
    classifier = Classifier(cfg.classifier, pol)
    limiter = Limiter(pol, classifier, stage_names=table.names,
                      queue_caps=tuple(table.queue_cap(i) for i in range(len(table.names))),
                      max_inflight=cfg.limits.max_inflight, passthrough_cap=cfg.passthrough.cap,
                      passthrough_queue_cap=cfg.limits.queue_cap)
    metrics = SidecarMetrics(lambda: limiter, time_unit=1.0)
    return Gateway(table, limiter, classifier, UpstreamPool("127.0.0.1", 9), make_uplink("fair"), metrics,
                   admin=_admin)


async def _admin(req: Any, public: bool) -> tuple[int, bytes, bytes]:
    return 200, b"text/plain", b"public" if public else b"admin"


def _run(raw: bytes, check: Callable[[Gateway, Exchange], Awaitable[None]], *, peer: str = "unknown",
         from_admin: bool = False, policy: str = "pi(1)") -> None:
    """Parse ``raw`` into a request and hand ``check`` a gateway and the request's exchange."""

    async def main() -> None:
        gw = _gateway(policy)
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        conn = ClientConnection(gw.limits, reader, writer, gw.body_budget)
        conn.peer = peer
        reading = asyncio.create_task(conn.read_loop())
        b.sendall(raw)
        try:
            req = await asyncio.wait_for(conn.next_request(), 30)
            assert req is not None
            rec = RequestRecord(0.0, 0.0, peer, req.method.decode(), req.url.decode(), req.version)
            await check(gw, Exchange(conn, req, rec, from_admin=from_admin, path=req.path))
        finally:
            reading.cancel()
            writer.close()
            b.close()

    asyncio.run(main())


def _errors(gw: Gateway, reason: str) -> float:
    return gw.metrics.errors.labels(reason)._value.get()


def test_the_steps_run_in_the_documented_order() -> None:
    async def check(gw: Gateway, ex: Exchange) -> None:
        assert [s.__name__ for s in gw.steps] == ["refuse_bad_target", "hide_private", "strip_untrusted",
                                                  "serve_admin", "route", "tunnel", "reserve", "admit", "forward"]

    _run(b"GET /s1 HTTP/1.1\r\nHost: x\r\n\r\n", check)


def test_a_bad_target_is_a_400_and_a_good_one_passes() -> None:
    async def bad(gw: Gateway, ex: Exchange) -> None:
        answer = await gw.screening.refuse_bad_target(ex)
        assert answer is not None and answer.keep and answer.data.startswith(b"HTTP/1.1 400 ")
        assert ex.rec.status == 400 and _errors(gw, "bad_target") == 1

    async def good(gw: Gateway, ex: Exchange) -> None:
        assert await gw.screening.refuse_bad_target(ex) is None and ex.rec.status == 0

    _run(b"GET /s1%00x HTTP/1.1\r\nHost: x\r\n\r\n", bad)
    _run(b"GET /s1 HTTP/1.1\r\nHost: x\r\n\r\n", good)


def test_apaches_status_pages_are_hidden_even_behind_dot_segments() -> None:
    async def hidden(gw: Gateway, ex: Exchange) -> None:
        answer = await gw.screening.hide_private(ex)
        assert answer is not None and answer.data.startswith(b"HTTP/1.1 404 ") and not answer.keep
        assert _errors(gw, "private_path") == 1

    async def shown(gw: Gateway, ex: Exchange) -> None:
        assert await gw.screening.hide_private(ex) is None

    _run(b"GET /s1/../server-status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", hidden)
    _run(b"GET /server-statusx/../s1 HTTP/1.1\r\nHost: x\r\n\r\n", shown)


def test_steering_headers_are_stripped_from_untrusted_peers_only() -> None:
    raw = b"GET /s1 HTTP/1.1\r\nHost: x\r\nX-Overtake-Phase: 2\r\nX-Forwarded-Proto: https\r\nX-Other: 1\r\n\r\n"

    def names(ex: Exchange) -> set[bytes]:
        return {k.lower() for k, _ in ex.req.headers}

    async def untrusted(gw: Gateway, ex: Exchange) -> None:
        assert await gw.screening.strip_untrusted(ex) is None
        assert names(ex) == {b"host", b"x-other"}

    async def trusted(gw: Gateway, ex: Exchange) -> None:
        assert await gw.screening.strip_untrusted(ex) is None
        assert names(ex) == {b"host", b"x-overtake-phase", b"x-forwarded-proto", b"x-other"}

    _run(raw, untrusted, peer="192.0.2.7")
    _run(raw, trusted, peer="127.0.0.1")


def test_admin_paths_are_answered_by_the_admin_side_and_others_pass() -> None:
    async def public(gw: Gateway, ex: Exchange) -> None:
        gw.screening.separate_admin = True  # an admin listener exists
        answer = await gw.screening.serve_admin(ex)
        assert answer is not None and answer.data.endswith(b"\r\n\r\npublic") and ex.rec.stage == "admin"

    async def admin(gw: Gateway, ex: Exchange) -> None:
        answer = await gw.screening.serve_admin(ex)
        assert answer is not None and answer.data.endswith(b"\r\n\r\nadmin") and ex.rec.status == 200

    async def other(gw: Gateway, ex: Exchange) -> None:
        assert await gw.screening.serve_admin(ex) is None and ex.rec.stage == "-"

    _run(b"GET /-/healthz HTTP/1.1\r\nHost: x\r\n\r\n", public)
    _run(b"GET /anything HTTP/1.1\r\nHost: x\r\n\r\n", admin, from_admin=True)
    _run(b"GET /s1 HTTP/1.1\r\nHost: x\r\n\r\n", other)


def test_route_sets_stage_and_phase_and_refuses_a_bad_phase_header() -> None:
    async def stage2(gw: Gateway, ex: Exchange) -> None:
        assert await gw.screening.route(ex) is None
        assert (ex.stage, ex.phase, ex.route_key, ex.rec.stage) == (1, 0, "GET /s2", "s2")

    async def passthrough(gw: Gateway, ex: Exchange) -> None:
        assert await gw.screening.route(ex) is None
        assert (ex.stage, ex.rec.stage) == (PASSTHROUGH, "passthrough")

    async def bad_phase(gw: Gateway, ex: Exchange) -> None:
        answer = await gw.screening.route(ex)
        assert answer is not None and answer.data.startswith(b"HTTP/1.1 400 ") and _errors(gw, "bad_phase") == 1

    _run(b"GET /s2 HTTP/1.1\r\nHost: x\r\n\r\n", stage2)
    _run(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n", passthrough)
    _run(b"GET /s1 HTTP/1.1\r\nHost: x\r\nX-Overtake-Phase: nonsense\r\n\r\n", bad_phase, peer="127.0.0.1")


def test_reserve_admits_queues_and_refuses_when_the_queue_is_full() -> None:
    """pi(1): one thread for stage s1, whose queue holds one request: the first is admitted, the
    second queued, the third refused with 503 and Retry-After."""

    async def check(gw: Gateway, ex: Exchange) -> None:
        assert await gw.screening.route(ex) is None and ex.stage == 0
        answers: list[Answer | None] = []
        tickets = []
        for _ in range(3):
            ex.ticket = None
            answers.append(await gw.admission.reserve(ex))
            tickets.append(ex.ticket)
        assert answers[:2] == [None, None] and tickets[0] is not None and tickets[1] is not None
        assert tickets[0].status == ADMITTED and tickets[1].status != ADMITTED
        third = answers[2]
        assert third is not None and third.data.startswith(b"HTTP/1.1 503 ") and b"Retry-After:" in third.data
        assert ex.rec.status == 503

    _run(b"GET /s1 HTTP/1.1\r\nHost: x\r\n\r\n", check)


def test_admit_records_the_queue_wait_of_an_admitted_request() -> None:
    async def check(gw: Gateway, ex: Exchange) -> None:
        assert await gw.screening.route(ex) is None and await gw.admission.reserve(ex) is None
        assert await gw.admission.admit(ex) is None
        assert ex.rec.queue_wait is not None and ex.rec.queue_wait >= 0 and ex.rec.phase == 1

    _run(b"GET /s1 HTTP/1.1\r\nHost: x\r\n\r\n", check)
