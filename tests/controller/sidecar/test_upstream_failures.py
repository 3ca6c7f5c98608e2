"""Outcomes the sidecar must tell apart: Apache not answering a connect (a full accept
queue: bounded by ``limits.upstream_connect_timeout``), and a client that leaves mid-response
(``client_abort``, not an upstream error)."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from support.service_helpers import QuietHandler, SidecarProc

from overtake.controller.sidecar.upstream import UpstreamError, UpstreamPool


@pytest.fixture
def full_backlog() -> tuple[str, int]:
    """A listener that never accepts, its accept queue filled: further SYNs go unanswered."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(c)
    time.sleep(0.2)
    yield "127.0.0.1", port  # type: ignore[misc]
    for c in fillers:
        c.close()
    srv.close()


def test_connect_to_a_full_accept_queue_times_out(full_backlog: tuple[str, int]) -> None:
    pool = UpstreamPool(*full_backlog, connect_timeout=0.5)

    async def go() -> None:
        await pool.exchange(b"GET", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"", buffer_bytes=1 << 16, timeout=30,
                            on_stream=lambda r: asyncio.sleep(0))

    t0 = time.monotonic()
    with pytest.raises(UpstreamError, match=r"no answer within 0\.5 s \(limits\.upstream_connect_timeout\)"):
        asyncio.run(go())
    assert time.monotonic() - t0 < 3  # not the kernel's minutes of SYN retries


class Big(QuietHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(64 << 20))
        self.end_headers()
        chunk = b"x" * (1 << 20)
        try:
            for _ in range(64):
                self.wfile.write(chunk)
                time.sleep(0.01)
        except OSError:
            pass


def _behind_sidecar(work: Path, handler: type[QuietHandler], limits: str = "") -> tuple[ThreadingHTTPServer, SidecarProc]:
    """An upstream serving ``handler`` at /big (stage 1) and a sidecar in front of it (pi(2))."""
    up = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    stages = ('stages: [{name: stage1, path: "^/big"}, {name: stage2, path: "^/other"}]\n'
              f"limits: {{max_inflight: 8, response_buffer_bytes: 65536{limits}}}\n")
    return up, SidecarProc(work, ["--policy", "pi(2)", "--apache", f"http://127.0.0.1:{up.server_address[1]}"],
                           stages=stages)


def test_a_client_leaving_mid_response_is_a_client_abort(work: Path) -> None:
    up, s = _behind_sidecar(work, Big)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            got = 0
            while got < 2 << 20:
                got += len(c.recv(1 << 16))
        deadline = time.monotonic() + 10
        while True:
            text = s.request("GET", "/-/metrics")[2].decode()
            if re.search(r'overtake_gateway_errors_total\{reason="client_abort"\} [1-9]', text):
                break
            assert time.monotonic() < deadline, "no client_abort counted"
            time.sleep(0.2)
        assert 'overtake_gateway_errors_total{reason="upstream_error"} 0.0' in text
        assert re.search(r'overtake_stage_completed_total\{outcome="client_abort",phase="1",stage="stage1"\} 1\.0', text)
        assert re.search(r"^overtake_inflight 0\.0$", text, re.M)
    finally:
        assert s.stop() == 0
        up.shutdown()
        up.server_close()


def test_slowloris_gets_408_after_the_header_timeout(work: Path) -> None:
    """A head dribbled a byte at a time keeps the connection active; the deadline is on the head."""
    from support.service_helpers import STAGES, StubApache

    stub = StubApache()
    stages = STAGES.replace("limits: {", "limits: {header_timeout: 1, ")
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url], stages=stages)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(b"GET /stage2/x HTTP/1.1\r\nHost: x\r\n")
            t0, got = time.monotonic(), b""
            c.settimeout(0.3)
            while time.monotonic() - t0 < 6:
                try:
                    c.sendall(b"X")
                    chunk = c.recv(4096)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                got += chunk
            assert got.startswith(b"HTTP/1.1 408"), got[:60]
            assert time.monotonic() - t0 < 4
        assert s.request("GET", "/stage2/ok")[0] == 200  # a normal client is unaffected
        assert 'overtake_gateway_errors_total{reason="header_timeout"} 1.0' in s.request("GET", "/-/metrics")[2].decode()
    finally:
        assert s.stop() == 0
        stub.close()


class Steady(QuietHandler):
    """64 × 256 KiB over about 3 s: slower in total than the test's upstream_timeout, never idle."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(64 << 18))
        self.end_headers()
        for _ in range(64):
            self.wfile.write(b"y" * (1 << 18))
            time.sleep(0.05)


def test_a_long_streamed_answer_is_bounded_per_progress_not_per_response(work: Path) -> None:
    up, s = _behind_sidecar(work, Steady, ", upstream_timeout: 1")
    try:
        t0 = time.monotonic()
        code, _, body = s.request("GET", "/big")
        assert code == 200 and len(body) == 64 << 18 and time.monotonic() - t0 > 2
    finally:
        assert s.stop() == 0
        up.shutdown()
        up.server_close()


class Trickle(QuietHandler):
    """A small answer (well within the response buffer) in 30 pieces 0.1 s apart: about 3 s in
    all, never idle for long; ``/big?stall`` stops after the head instead."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "300")
        self.end_headers()
        self.wfile.flush()
        if self.path.endswith("stall"):
            time.sleep(3)
            return
        for _ in range(30):
            time.sleep(0.1)
            self.wfile.write(b"t" * 10)
            self.wfile.flush()


def test_upstream_timeout_is_the_longest_silence_of_apache_not_the_whole_answer(work: Path) -> None:
    """A small answer that trickles is not cut at ``upstream_timeout`` (buffered, it was: 502);
    an Apache that goes silent for longer still is."""
    up, s = _behind_sidecar(work, Trickle, ", upstream_timeout: 1")
    try:
        code, _, body = s.request("GET", "/big")
        assert (code, body) == (200, b"t" * 300)
        assert s.request("GET", "/big?stall")[0] == 502
    finally:
        assert s.stop() == 0
        up.shutdown()
        up.server_close()
