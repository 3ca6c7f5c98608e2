"""``Upgrade: h2c`` (what ``curl --http2`` sends) is ignored and answered in HTTP/1.1, and the
connection goes on (RFC 9113 §3.1); issue 19 found the next request refused with a 400.
``Upgrade: websocket`` becomes a tunnel (RFC 6455): Apache's 101 relayed, then bytes both ways,
outside the stage slots, capped by ``limits.max_tunnels``."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from service_helpers import SidecarProc, StubApache

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
    answer, never inside it (issue 19 found it inside an 8 MB body)."""
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
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = c.recv(65536)
                if not chunk:
                    return
                buf += chunk
            head, rest = buf.split(b"\r\n\r\n", 1)
            self.heads.append(head)
            hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:])}
            if hdrs.get(b"upgrade", b"").lower() != b"websocket":
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                return
            if b"sec-websocket-key" not in hdrs:
                c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 6\r\nConnection: close\r\n\r\nno key")
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
            # the tunnel takes no stage slot: under pi(1) a stage1 request is still served at once
            assert s.request("GET", "/stage1/plain")[0] == 200
            text = s.request("GET", "/-/metrics")[2].decode()
            assert "overtake_tunnels 1.0" in text
            c.sendall(FRAME)
            assert _read_until(c, len(FRAME)) == FRAME
        sent = next(h for h in ws.heads if h.startswith(b"GET /stage1/chat")).lower()
        assert b"upgrade: websocket" in sent and b"sec-websocket-key: " + KEY.lower() in sent
        deadline = time.monotonic() + 5
        while "overtake_tunnels 0.0" not in s.request("GET", "/-/metrics")[2].decode():
            assert time.monotonic() < deadline, "tunnel not closed"
            time.sleep(0.1)
    finally:
        assert s.stop() == 0
        ws.close()


def test_websocket_refused_by_apache_is_relayed_and_tunnels_are_capped(work: Path) -> None:
    ws = WsEcho()
    stages = ('stages: [{name: stage1, path: "^/stage1"}, {name: stage2, path: "^/stage2"}]\n'
              "limits: {max_inflight: 8, max_tunnels: 1}\n")
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", ws.url], stages=stages)
    try:
        no_key = WS_HANDSHAKE.replace(b"Sec-WebSocket-Key: " + KEY + b"\r\n", b"")
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(no_key)
            got = b""
            while chunk := c.recv(65536):
                got += chunk
            assert got.startswith(b"HTTP/1.1 400") and got.endswith(b"no key")  # then closed
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c1:
            c1.sendall(WS_HANDSHAKE)
            assert _read_until(c1, 12).startswith(b"HTTP/1.1 101")
            with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c2:
                c2.sendall(WS_HANDSHAKE)
                assert _read_until(c2, 12).startswith(b"HTTP/1.1 503")  # max_tunnels: 1
    finally:
        assert s.stop() == 0
        ws.close()
