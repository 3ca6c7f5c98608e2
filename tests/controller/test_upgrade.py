"""``Upgrade: h2c`` (what ``curl --http2`` sends) is ignored and answered in HTTP/1.1, and the
connection goes on (RFC 9113 §3.1); issue 19 found the next request refused with a 400."""

from __future__ import annotations

import json
import socket
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
