"""``Upgrade: h2c`` (what ``curl --http2`` sends) is ignored and answered in HTTP/1.1, and the
connection goes on (RFC 9113 §3.1); the next request is not refused with a 400.
``Upgrade: websocket`` becomes a tunnel (RFC 6455): Apache's 101 relayed, then bytes both ways,
capped by ``limits.max_tunnels``. A tunnel is admitted like any request of its route (a stage's
policy, or the passthrough cap) and holds that slot until it closes: Apache's worker is busy
with it all along."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.raw_http import read_head
from support.service_helpers import SidecarProc, StubApache, sidecar_in_thread

from overtake.controller.harness import apache
from overtake.controller.harness.scratch import free_port, scratch_dir

H2C = (b"GET /stage2/first HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
       b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")


def _responses(port: int, data: bytes, n: int) -> list[tuple[int, bytes]]:
    """Send ``data`` on one connection and read ``n`` HTTP/1.1 responses (Content-Length bodies)."""
    out: list[tuple[int, bytes]] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        buf = b""
        while len(out) < n:
            while b"\r\n\r\n" not in buf:
                chunk = s.recv(65536)
                assert chunk, f"connection closed after {len(out)} responses: {buf[:200]!r}"
                buf += chunk
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            length = next(int(v) for k, v in (ln.split(b":", 1) for ln in lines[1:]) if k.lower() == b"content-length")
            while len(buf) < length:
                buf += s.recv(65536)
            out.append((int(lines[0].split()[1]), buf[:length]))
            buf = buf[length:]
    return out


def test_h2c_offer_is_ignored_and_the_connection_goes_on(work: Path, stub: StubApache) -> None:
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url])
    try:
        for second in (b"GET /stage2/second HTTP/1.1\r\nHost: x\r\n\r\n",):
            (c1, b1), (c2, b2) = _responses(s.port, H2C + second, 2)  # pipelined behind the offer
            assert (c1, c2) == (200, 200)
            first = {k.lower(): v for k, v in json.loads(b1)["headers"]}
            assert json.loads(b1)["path"] == "/stage2/first" and json.loads(b2)["path"] == "/stage2/second"
            assert "upgrade" not in first and "http2-settings" not in first  # hop-by-hop: not forwarded
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:  # the offer, then later on
            c.sendall(H2C)
            assert c.recv(65536).startswith(b"HTTP/1.1 200")
            c.sendall(b"GET /stage2/later HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        assert s.stop() == 0


def test_pipelined_expect_continue_waits_for_the_answer_before_it(work: Path, stub: StubApache) -> None:
    """``Expect: 100-continue`` pipelined behind a slow answer: the interim 100 comes after that
    answer, never inside it (not inside a large body)."""
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url])
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(b"GET /slow/0.4 HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"PUT /stage2/put HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
            buf = b""
            while b"100 Continue" not in buf:
                chunk = c.recv(65536)
                assert chunk, buf
                buf += chunk
            assert buf.startswith(b"HTTP/1.1 200"), buf[:40]  # the slow answer first, whole
            head, rest = buf.split(b"\r\n\r\n", 1)
            length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            assert rest[length:].startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            c.sendall(b"hello")
            buf = rest[length + len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
            while b"\r\n\r\n" not in buf:
                buf += c.recv(65536)
            assert buf.startswith(b"HTTP/1.1 200")
    finally:
        assert s.stop() == 0


# ---- WebSocket (RFC 6455): a tunnel through the sidecar ------------------------------------------

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def _accept(key: bytes) -> bytes:
    """RFC 6455 §4.2.2: base64(SHA-1(key + GUID))."""
    import base64
    import hashlib

    return base64.b64encode(hashlib.sha1(key + WS_GUID).digest())


class WsEcho:
    """A loopback WebSocket server standing in for Apache: answers the handshake (101 with the
    RFC's accept value, or 400 without a key), then echoes every byte; plain GETs get 200."""

    def __init__(self) -> None:
        import threading

        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.heads: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        with c:
            buf = read_head(c)
            if buf is None:
                return
            head, rest = buf.split(b"\r\n\r\n", 1)
            self.heads.append(head)
            hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:])}
            if hdrs.get(b"upgrade", b"").lower() != b"websocket":
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                return
            if b"sec-websocket-key" not in hdrs:
                c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 6\r\nConnection: close\r\n\r\nno key")
                return
            if b"keep-open" in head.split(b"\r\n")[0]:  # refused, and the connection kept for more
                c.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 4\r\n\r\nnope")
                c.recv(1)  # until the sidecar closes it
                return
            c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      b"Sec-WebSocket-Accept: " + _accept(hdrs[b"sec-websocket-key"]) + b"\r\n\r\n")
            if rest:
                c.sendall(rest)
            while chunk := c.recv(65536):
                c.sendall(chunk)

    def close(self) -> None:
        self.srv.close()


KEY = b"dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455 §1.3's sample key: accept s3pPLMBiTxaQ9kYGzzhZRbK+xOo=
WS_HANDSHAKE = (b"GET /stage1/chat HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: " + KEY + b"\r\nSec-WebSocket-Version: 13\r\n\r\n")
FRAME = bytes([0x81, 0x85, 1, 2, 3, 4]) + bytes(b ^ m for b, m in zip(b"hello", b"\x01\x02\x03\x04\x01"))


def _read_until(c: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = c.recv(65536)
        assert chunk, f"closed after {got!r}"
        got += chunk
    return got


def test_websocket_upgrade_is_a_tunnel(work: Path) -> None:
    ws = WsEcho()
    stages = ('stages: [{name: stage1, path: "^/stage1"}, {name: stage2, path: "^/stage2"}]\n'
              "limits: {max_inflight: 8, queue_timeout: 2}\n")
    s = SidecarProc(work, ["--policy", "pi(1)", "--apache", ws.url], stages=stages)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(WS_HANDSHAKE + FRAME)  # the first frame in the same packet as the handshake
            head = _read_until(c, 1)
            while b"\r\n\r\n" not in head:
                head += c.recv(65536)
            answer, rest = head.split(b"\r\n\r\n", 1)
            assert answer.startswith(b"HTTP/1.1 101")
            assert b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in answer  # RFC 6455 §1.3
            assert rest + _read_until(c, len(FRAME) - len(rest)) == FRAME  # echoed through the tunnel
            # the tunnel holds stage1's one thread under pi(1): a stage1 request waits, and gives
            # up at the queue timeout; passthrough requests are not held
            assert s.request("GET", "/stage1/plain")[0] == 503
            assert s.request("GET", "/elsewhere")[0] == 200
            text = s.request("GET", "/-/metrics")[2].decode()
            assert "overtake_tunnels 1.0" in text
            assert 'overtake_stage_inflight{phase="1",stage="stage1"} 1.0' in text
            c.sendall(FRAME)
            assert _read_until(c, len(FRAME)) == FRAME
        sent = next(h for h in ws.heads if h.startswith(b"GET /stage1/chat")).lower()
        assert b"upgrade: websocket" in sent and b"sec-websocket-key: " + KEY.lower() in sent
        deadline = time.monotonic() + 5
        while "overtake_tunnels 0.0" not in (text := s.request("GET", "/-/metrics")[2].decode()):
            assert time.monotonic() < deadline, "tunnel not closed"
            time.sleep(0.1)
        assert re.search(r'overtake_stage_completed_total\{outcome="tunnel",phase="1",stage="stage1"\} 1\.0', text)
        assert s.request("GET", "/stage1/plain")[0] == 200  # the slot is back
    finally:
        assert s.stop() == 0
        ws.close()


def test_websocket_refused_by_apache_is_relayed_and_tunnels_are_capped(work: Path) -> None:
    ws = WsEcho()
    stages = ('stages: [{name: stage1, path: "^/stage1"}, {name: stage2, path: "^/stage2"}]\n'
              "limits: {max_inflight: 8, max_tunnels: 1, upstream_timeout: 60}\n")
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", ws.url], stages=stages)
    try:
        no_key = WS_HANDSHAKE.replace(b"Sec-WebSocket-Key: " + KEY + b"\r\n", b"")
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(no_key)
            got = b""
            while chunk := c.recv(65536):
                got += chunk
            assert got.startswith(b"HTTP/1.1 400") and got.endswith(b"no key")  # then closed
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            # a refusal on a connection Apache keeps open: relayed to its end, not to Apache's close
            c.sendall(WS_HANDSHAKE.replace(b"/stage1/chat", b"/stage1/keep-open"))
            got = b""
            while chunk := c.recv(65536):
                got += chunk
            assert got.startswith(b"HTTP/1.1 403") and got.endswith(b"\r\n\r\nnope")
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c1:
            c1.sendall(WS_HANDSHAKE)
            assert _read_until(c1, 12).startswith(b"HTTP/1.1 101")
            with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c2:
                c2.sendall(WS_HANDSHAKE)
                assert _read_until(c2, 12).startswith(b"HTTP/1.1 503")  # max_tunnels: 1
    finally:
        assert s.stop() == 0
        ws.close()


def test_tunnels_elsewhere_hold_the_passthrough_cap(work: Path) -> None:
    ws = WsEcho()
    stages = ('stages: [{name: stage1, path: "^/stage1"}, {name: stage2, path: "^/stage2"}]\n'
              "passthrough: {cap: 1}\nlimits: {max_inflight: 8, queue_timeout: 1}\n")
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", ws.url], stages=stages)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(WS_HANDSHAKE.replace(b"/stage1/chat", b"/chat"))
            assert _read_until(c, 12).startswith(b"HTTP/1.1 101")
            assert s.request("GET", "/plain")[0] == 503  # the cap's one request is the tunnel
            assert s.request("GET", "/stage2/x")[0] == 200
        deadline = time.monotonic() + 5
        while s.request("GET", "/plain")[0] != 200:
            assert time.monotonic() < deadline, "the passthrough slot was not given back"
    finally:
        assert s.stop() == 0
        ws.close()


def test_a_queued_handshake_whose_client_leaves_is_withdrawn(work: Path) -> None:
    ws = WsEcho()
    stages = ('stages: [{name: stage1, path: "^/stage1"}, {name: stage2, path: "^/stage2"}]\n'
              "limits: {max_inflight: 8, queue_timeout: 60}\n")
    s = SidecarProc(work, ["--policy", "pi(1)", "--apache", ws.url], stages=stages)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(WS_HANDSHAKE)
            assert _read_until(c, 12).startswith(b"HTTP/1.1 101")
            with socket.create_connection(("127.0.0.1", s.port), timeout=10) as queued:
                queued.sendall(WS_HANDSHAKE)
                deadline = time.monotonic() + 10
                while 'overtake_stage_queued{phase="1",stage="stage1"} 1.0' not in s.request("GET", "/-/metrics")[2].decode():
                    assert time.monotonic() < deadline, "the second handshake was not queued"
                    time.sleep(0.05)
            deadline = time.monotonic() + 10  # closed while queued: withdrawn, never sent to Apache
            while 'overtake_stage_rejected_total{reason="client_gone",stage="stage1"} 1.0' not in (
                    text := s.request("GET", "/-/metrics")[2].decode()):
                assert time.monotonic() < deadline, "the queued handshake was not withdrawn"
                time.sleep(0.05)
            assert 'overtake_stage_queued{phase="1",stage="stage1"} 0.0' in text
        assert sum(1 for h in ws.heads if h.startswith(b"GET /stage1/chat")) == 1
    finally:
        assert s.stop() == 0
        ws.close()


# ---- on a real Apache: a handshake Apache does not upgrade is an ordinary stage request ----------

def _handshake(port: int, target: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
        c.sendall(WS_HANDSHAKE.replace(b"/stage1/chat", target.encode()))
        got = b""
        while chunk := c.recv(65536):
            got += chunk
        return got


@pytest.fixture(scope="module")
def real_apache(apache_available: None) -> Iterator[apache.ApacheInstance]:
    parent = scratch_dir("overtake-upgrade-test-")
    cores = sorted(os.sched_getaffinity(0))
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=cores[-1] if len(cores) > 1 else None,
                        max_workers=16)
    try:
        yield inst
    finally:
        apache.stop(inst.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


def test_handshakes_on_a_stage_route_obey_its_policy(real_apache: apache.ApacheInstance, tmp_path: Path) -> None:
    """Six WebSocket handshakes for ``/stage1?work=0.3`` through π(1): Apache's stage handler
    burns the CPU and answers 200 (no upgrade). Each must be admitted by stage1's policy, one in
    Apache at a time (the hostile probe ran six at once, stage1's count at 0)."""
    stages = tmp_path / "stages.yaml"
    stages.write_text('stages: [{name: stage1, path: "^/stage1$"}, {name: stage2, path: "^/stage2$"}]\n'
                      "limits: {max_inflight: 8, queue_timeout: 60}\n")
    gen = sidecar_in_thread(stages, policy="pi(1)", apache=real_apache.base_url, status_interval=3600)
    port, side = next(gen)
    busy: list[int] = []
    answers: list[bytes] = []
    done = threading.Event()

    def sample() -> None:  # Apache's own count of busy workers (this status request is one)
        while not done.is_set():
            busy.append(int(apache.status(real_apache.workdir)["BusyWorkers"]))
            time.sleep(0.05)

    try:
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        clients = [threading.Thread(target=lambda: answers.append(_handshake(port, "/stage1?work=0.3")))
                   for _ in range(6)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(60)
        done.set()
        sampler.join(5)
        assert [a[:12] for a in answers] == [b"HTTP/1.1 200"] * 6
        lim = side.limiter
        assert sum(v for (st, _), v in lim.admitted.items() if st == 0) == 6  # each admitted as stage1
        assert lim.max_seen_inflight == 1 and lim.inflight_total == 0
        assert busy and max(busy) <= 2, busy
    finally:
        done.set()
        gen.close()
