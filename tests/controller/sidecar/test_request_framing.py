"""Request framing at the sidecar's front end (RFC 9112): what is forwarded, with which body, and
what is refused before Apache sees it.

The backend is ``service_helpers.StubApache``, which records every path, body and header block it
receives; the sidecar runs in-process. A desync shows as a request the backend saw that the client
did not frame (a body's hidden request reaching it), a body cut or padded, or a count of answers
that differs from the count of requests.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.service_helpers import StubApache, sidecar_in_thread

from overtake.controller.sidecar.service import Sidecar

SMUGGLED = b"GET /stage2/smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def side(stub: StubApache, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Sidecar]]:
    stages = Path(tmp_path_factory.mktemp("framing")) / "stages.yaml"
    stages.write_text("stages: [{name: stage1, path: '^/s1/'}, {name: stage2, path: '^/stage2'}]\n"
                      "limits: {max_inflight: 8}\n")
    yield from sidecar_in_thread(stages, policy="pi(2)", apache=stub.url, status_interval=3600)


def exchange(port: int, data: bytes) -> list[int]:
    """Send ``data`` on one connection; the final statuses of the answers until the sidecar closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(data)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    out: list[int] = []
    while buf:
        m = re.match(rb"HTTP/1\.1 (\d{3}) [^\r\n]*\r\n", buf)
        assert m, buf[:200]
        head, _, buf = buf.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        n = int(length.group(1)) if length else 0
        if int(m.group(1)) >= 200:
            out.append(int(m.group(1)))
        buf = buf[n:]
    return out


def h2c_offer(method: bytes, path: bytes, framing: bytes, body: bytes) -> bytes:
    return (method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n" + framing + b"\r\n\r\n" + body)


@pytest.mark.parametrize("chunked", [False, True])
def test_h2c_offer_with_a_body_is_forwarded_with_its_body(side: tuple[int, Sidecar], stub: StubApache,
                                                          chunked: bool) -> None:
    """An ``Upgrade: h2c`` offer on a request with a body: the upgrade is ignored and the body is
    the request's own (a parser that switched protocols at the head read the body as a request)."""
    port, _ = side
    path = b"/stage2/h2c-%d" % chunked
    if chunked:
        framing, body = b"Transfer-Encoding: chunked", b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED)
    else:
        framing, body = b"Content-Length: %d" % len(SMUGGLED), SMUGGLED
    after = b"GET /stage2/after-%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % chunked
    before = stub.hits["/stage2/smuggled"]
    assert exchange(port, h2c_offer(b"POST", path, framing, body) + after) == [200, 200]
    assert stub.bodies[path.decode()] == [SMUGGLED]
    assert stub.hits[f"/stage2/after-{int(chunked)}"] == 1
    assert stub.hits["/stage2/smuggled"] == before  # never a request of its own
    sent = dict((k.lower(), v) for k, v in stub.fields[path.decode()][0])
    assert "upgrade" not in sent and "http2-settings" not in sent


def test_websocket_handshake_with_a_body_is_refused(side: tuple[int, Sidecar], stub: StubApache) -> None:
    port, _ = side
    data = (b"GET /stage2/ws-body HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            b"Content-Length: %d\r\n\r\n" % len(SMUGGLED) + SMUGGLED)
    before = stub.hits["/stage2/smuggled"]
    assert exchange(port, data) == [400]
    assert stub.hits["/stage2/ws-body"] == 0 and stub.hits["/stage2/smuggled"] == before


@pytest.mark.parametrize(("name", "data"), [
    ("no_host", b"GET /stage2/no-host HTTP/1.1\r\n\r\n"),
    ("two_hosts", b"GET /stage2/two-hosts HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
    ("two_hosts_10", b"GET /stage2/two-hosts-10 HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n"),
    ("http_2_0", b"GET /stage2/http2 HTTP/2.0\r\nHost: x\r\n\r\n"),
    ("http_0_9", b"GET /stage2/http09\r\n\r\n"),
    ("te_on_10", b"POST /stage2/te10 HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED)),
    # an Upgrade offer ends llhttp's head before its own check of the codings
    *[(f"h2c_te_{i}", h2c_offer(b"POST", f"/stage2/h2c-te-{i}".encode(), b"Transfer-Encoding: " + te,
                                b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED)))
      for i, te in enumerate((b"identity", b"chunked, identity", b"xchunked", b"chunked\x0b"))],
])
def test_rfc_9112_violations_are_400_and_never_forwarded(side: tuple[int, Sidecar], stub: StubApache, name: str,
                                                          data: bytes) -> None:
    port, _ = side
    path = data.split(b" ")[1].decode()
    before = stub.hits["/stage2/smuggled"]
    assert exchange(port, data) == [400], name
    assert stub.hits[path] == 0 and stub.hits["/stage2/smuggled"] == before


def test_http_10_without_host_is_served(side: tuple[int, Sidecar], stub: StubApache) -> None:
    port, _ = side
    assert exchange(port, b"GET /stage2/old-client HTTP/1.0\r\n\r\n") == [200]
    assert stub.hits["/stage2/old-client"] == 1


def test_chunked_trailers_are_not_forwarded_as_header_fields(side: tuple[int, Sidecar], stub: StubApache) -> None:
    """A trailer is not a header: merged into the head it would add a second Host (or a forged
    X-Forwarded-For) to what Apache sees."""
    port, _ = side
    data = (b"POST /stage2/trailer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            b"5\r\nhello\r\n0\r\nHost: evil\r\nX-Forwarded-For: 6.6.6.6\r\n\r\n")
    assert exchange(port, data) == [200]
    fields = stub.fields["/stage2/trailer"][0]
    assert [v for k, v in fields if k.lower() == "host"] == ["x"]
    assert "6.6.6.6" not in dict((k.lower(), v) for k, v in fields)["x-forwarded-for"]
    assert stub.bodies["/stage2/trailer"] == [b"hello"]
