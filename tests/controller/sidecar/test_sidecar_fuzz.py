"""A bounded fuzz of the sidecar's HTTP/1.1 request parsing (controller/sidecar/http1.py).

What was used: hypothesis (``derandomize=True``, so CI runs the same 300 connections every time;
no example database), driving raw bytes over loopback TCP into a sidecar running in-process on
its own event-loop thread, in front of ``service_helpers.StubApache`` as the capture backend
(it records every path it is asked for). Each generated connection pipelines one to four
requests in a single write: random methods, stage and passthrough paths, random extra header
fields, bodies framed by Content-Length or chunked (random chunk sizes, extensions, trailers),
``Expect: 100-continue``, an ``Upgrade: h2c`` offer (ignored by the sidecar: llhttp stops at the
head of an upgrade, so a body must still be read as the request's), and bodies that hold a
complete request (a smuggling probe). At most one request of a connection carries a defect that
RFC 9112 makes a framing or syntax error: Content-Length with Transfer-Encoding, two different
Content-Lengths, a non-decimal or overflowing Content-Length, a transfer coding other than a
final ``chunked``, a bad chunk size, chunk data without its CRLF, obs-fold, a bare LF,
whitespace before the colon, a bad field name, NUL or CR in a value, a space in the
request-target, no ``Host`` or two, a request line other than HTTP/1.0 or 1.1,
Transfer-Encoding in HTTP/1.0, a WebSocket handshake with a body, or a body cut short by the
client's EOF.

Invariants, per connection:

* every response is a valid status line and framing (interim 100s allowed); the requests before
  the defective one are each answered 200 by the backend, in order; the defective one gets one
  4xx/501 and the connection closes (or, for a body cut short, no answer and a close);
* the backend saw each request before the defect once, with exactly the body the client framed,
  and nothing else: never the defective one, any request after it, or the request hidden in a
  body (its count of requests grew by exactly the number answered 200);
* the sidecar keeps serving (``/-/healthz``), and its counters return to 0: requests inside
  Apache, stage threads and queues, passthrough, open client connections.
"""

from __future__ import annotations

import itertools
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.service_helpers import StubApache, sidecar_in_thread

from overtake.controller.sidecar.service import Sidecar

_ids = itertools.count()
_TOKEN = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~"
_VCHAR = "".join(chr(c) for c in range(0x21, 0x7F))
#: names the generator sets itself (framing, hop-by-hop, steering): never drawn as extras
_RESERVED = {"host", "content-length", "transfer-encoding", "expect", "connection", "upgrade", "te", "trailer",
             "keep-alive", "proxy-connection", "x-overtake-phase", "x-overtake-next-phase", "x-overtake-class",
             "http2-settings"}
DEFECTS = ("cl_te", "dup_cl", "bad_cl", "bad_te", "bad_chunk_size", "chunk_no_crlf", "obs_fold", "bare_lf",
           "space_before_colon", "bad_name", "ctl_in_value", "bad_target", "no_host", "dup_host", "bad_version",
           "te_on_10", "ws_body", "truncated")
H2C = [b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c", b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"]
WS = [b"Connection: Upgrade", b"Upgrade: websocket", b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
      b"Sec-WebSocket-Version: 13"]


@dataclass
class Req:
    data: bytes
    marker: str  # the path the backend would see
    defect: str | None
    smuggled: str | None  # the path of a request hidden in the body
    body: bytes  # what the backend must receive as its body


@pytest.fixture(scope="module")
def sidecar(stub: StubApache, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Sidecar]]:
    stages = Path(tmp_path_factory.mktemp("fuzz")) / "stages.yaml"
    stages.write_text("stages: [{name: stage1, path: '^/s1/'}, {name: stage2, path: '^/s2/'}]\n"
                      "passthrough: {cap: 4}\nlimits: {max_inflight: 8}\n")
    yield from sidecar_in_thread(stages, policy="pi(2)", apache=stub.url, status_interval=3600)


def _chunked(draw: st.DrawFn, body: bytes) -> bytes:
    out, i = b"", 0
    while i < len(body):
        n = draw(st.integers(1, max(1, len(body) - i)))
        size = f"{n:x}"
        size = size.upper() if draw(st.booleans()) else size
        ext = draw(st.sampled_from([b"", b";x=1", b';name="q v"']))
        out += size.encode() + ext + b"\r\n" + body[i:i + n] + b"\r\n"
        i += n
    trailer = draw(st.sampled_from([b"", b"X-Trailer: t\r\n"]))
    return out + b"0\r\n" + trailer + b"\r\n"


@st.composite
def request(draw: st.DrawFn, conn: int, index: int, last: bool, defect: str | None) -> Req:
    method = draw(st.sampled_from(["GET", "POST", "PUT"]))
    marker = f"/{draw(st.sampled_from(['s1', 's2', 'pt']))}/fz{conn}-{index}"
    query = draw(st.sampled_from(["", "?q=1", "?a=b&c=%20d"]))
    target = marker + query
    lines: list[bytes] = [f"Host: {draw(st.sampled_from(['h', 'example.org:8080']))}".encode()]
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.text(_TOKEN, min_size=1, max_size=12))
        if name.lower() in _RESERVED:
            continue
        value = draw(st.text(_VCHAR + " \t", max_size=30)).strip(" \t")
        lines.append(f"{name}: {value}".encode())
    smuggled = None
    framing = draw(st.sampled_from(["none", "length", "chunked"]))
    body = b""
    if framing != "none":
        if draw(st.booleans()):
            smuggled = f"/pt/fz{conn}-{index}-smuggled"
            body = f"GET {smuggled} HTTP/1.1\r\nHost: h\r\n\r\n".encode()
        else:
            body = draw(st.binary(max_size=300))
        if body and draw(st.booleans()):
            lines.append(b"Expect: 100-continue")
    if defect in ("cl_te", "bad_te", "bad_chunk_size", "chunk_no_crlf", "te_on_10"):
        framing = "chunked"
        body = body or b"hello"
    if defect in ("dup_cl", "bad_cl", "truncated"):
        framing = "length"
        body = body or b"hello"
    if defect == "ws_body":
        framing = "length" if framing == "none" else framing
        body = body or b"hello"
        lines += WS
    elif draw(st.booleans()):
        lines += H2C
    payload = b""
    if framing == "length":
        lines.append(b"Content-Length: %d" % len(body))
        payload = body
    elif framing == "chunked":
        lines.append(b"Transfer-Encoding: chunked")
        payload = _chunked(draw, body)
    if last and defect is None:
        lines.append(b"Connection: close")

    if defect == "cl_te":
        lines.append(b"Content-Length: %d" % len(payload))
    elif defect == "dup_cl":
        lines.append(b"Content-Length: %d" % (len(body) + draw(st.integers(1, 5))))
    elif defect == "bad_cl":
        lines = [ln for ln in lines if not ln.startswith(b"Content-Length")]
        lines.append(b"Content-Length: " + draw(st.sampled_from(
            [b"1a", b"-1", b"+5", b"5 5", b"0x5", b"5,6", b"99999999999999999999999999"])))
    elif defect == "bad_te":
        lines = [ln for ln in lines if not ln.startswith(b"Transfer-Encoding")]
        lines.append(b"Transfer-Encoding: " + draw(st.sampled_from(
            [b"xchunked", b"chunked, identity", b"identity", b"chunked\x0b", b"chunk"])))
    elif defect == "bad_chunk_size":
        size = draw(st.sampled_from([b"zz", b"-1", b"0x5", b"fffffffffffffffffffffff", b"", b" 5"]))
        payload = size + b"\r\nhello\r\n0\r\n\r\n"
    elif defect == "chunk_no_crlf":
        payload = b"5\r\nhelloXX\r\n0\r\n\r\n"
    elif defect == "obs_fold":
        lines.insert(draw(st.integers(1, len(lines))), b"X-Folded: a\r\n  continued")
    elif defect == "space_before_colon":
        lines.insert(draw(st.integers(1, len(lines))), draw(st.sampled_from([b"X-Space : 1", b"Content-Length : 0"])))
    elif defect == "bad_name":
        lines.insert(draw(st.integers(1, len(lines))), draw(st.sampled_from(
            [b"X Bad: 1", b"X(bad): 1", b"X\x00: 1", b": empty", b"X\x7fdel: 1"])))
    elif defect == "ctl_in_value":
        lines.insert(draw(st.integers(1, len(lines))), draw(st.sampled_from([b"X-Nul: a\x00b", b"X-Cr: a\rb"])))
    elif defect == "bad_target":
        target = draw(st.sampled_from([marker + " x", marker + "\x01", marker + "\x7f"]))
    elif defect == "no_host":
        lines = lines[1:]
    elif defect == "dup_host":
        lines.insert(draw(st.integers(1, len(lines))), draw(st.sampled_from([b"Host: h", b"Host: other"])))
    version = "HTTP/1.1"
    if defect == "bad_version":
        version = draw(st.sampled_from(["HTTP/2.0", "HTTP/3.0", "HTTP/1.2", "HTTP/0.9"]))
    elif defect == "te_on_10":
        version = "HTTP/1.0"
    eol = b"\n" if defect == "bare_lf" else b"\r\n"
    head = f"{method} {target} {version}".encode() + eol + eol.join(lines) + eol + eol
    if defect == "truncated":
        payload = payload[: draw(st.integers(0, len(payload) - 1))]
    return Req(head + payload, marker, defect, smuggled, body)


@st.composite
def connection(draw: st.DrawFn) -> list[Req]:
    conn = next(_ids)
    n = draw(st.integers(1, 4))
    bad = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    defects = [None] * n
    if bad is not None:
        kinds = DEFECTS if bad == n - 1 else DEFECTS[:-1]  # a body is cut short only by the last request
        defects[bad] = draw(st.sampled_from(kinds))
    return [draw(request(conn, i, i == n - 1, defects[i])) for i in range(n)]


_STATUS = re.compile(rb"HTTP/1\.1 ([1-5]\d\d) [^\r\n]*\r\n")


def _responses(data: bytes) -> list[int]:
    """Final statuses of a stream of HTTP/1.1 responses; AssertionError on anything malformed."""
    out: list[int] = []
    while data:
        m = _STATUS.match(data)
        assert m, f"not a status line: {data[:80]!r}"
        status = int(m.group(1))
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"unterminated head: {head[:200]!r}"
        if status < 200:
            continue
        fields = [ln.split(b":", 1) for ln in head.split(b"\r\n")[1:]]
        lengths = [int(v) for k, v in fields if k.strip().lower() == b"content-length"]
        chunked = any(k.strip().lower() == b"transfer-encoding" for k, _ in fields)
        if chunked:
            while True:
                size, _, data = data.partition(b"\r\n")
                n = int(size.split(b";")[0], 16)
                data = data[n + 2:]
                if n == 0:
                    break
        else:
            assert len(lengths) <= 1, head
            n = lengths[0] if lengths else len(data)
            assert len(data) >= n, f"body cut: {len(data)} of {n}"
            data = data[n:]
        out.append(status)
    return out


def _exchange(port: int, reqs: list[Req]) -> bytes:
    # a failure-detection timeout: a correct exchange ends in milliseconds
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(b"".join(r.data for r in reqs))
        if reqs[-1].defect == "truncated":
            s.shutdown(socket.SHUT_WR)  # the client gives up mid-body
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                pytest.fail(f"no answer and no close within 15 s: {[r.data[:60] for r in reqs]}")
            except ConnectionResetError:
                break
            if not chunk:
                return out
            out += chunk
    return out


def _settled(side: Sidecar) -> dict[str, int]:
    lim, gw = side.limiter, side.gateway
    return {"inflight": lim.inflight_total, "passthrough": lim.pt_inflight, "pt_queue": len(lim.pt_queue),
            "waiting": sum(lim.stage_waiting), "threads": sum(lim.threads), "connections": len(gw._conns)}


@pytest.mark.slow  # 300 connections' exchanges
@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(reqs=connection())
def test_parser_fuzz(sidecar: tuple[int, Sidecar], stub: StubApache, reqs: list[Req]) -> None:
    port, side = sidecar
    event(f"defect {next((r.defect for r in reqs if r.defect), None)}")
    before = sum(n for path, n in stub.hits.items() if path != "/server-status")
    statuses = _responses(_exchange(port, reqs))
    k = next((i for i, r in enumerate(reqs) if r.defect is not None), len(reqs))
    assert statuses[:k] == [200] * k, (statuses, [r.data for r in reqs])
    if k < len(reqs):
        if reqs[k].defect == "truncated":
            assert len(statuses) == k, statuses
        else:
            assert len(statuses) == k + 1 and (400 <= statuses[k] < 500 or statuses[k] == 501), \
                (reqs[k].defect, statuses, reqs[k].data)
    for i, r in enumerate(reqs):
        assert stub.hits[r.marker] == (1 if i < k else 0), (r.defect, r.marker, r.data)
        if i < k:
            assert stub.bodies[r.marker] == [r.body], r.data  # exactly its body: no desync
        if r.smuggled is not None:
            assert stub.hits[r.smuggled] == 0, r.data
    assert sum(n for path, n in stub.hits.items() if path != "/server-status") - before == k  # nothing else
    # counters settle once the connection is closed on both ends (a bounded poll, not a timing check)
    t0 = time.monotonic()
    while any(_settled(side).values()):
        assert time.monotonic() - t0 < 10, _settled(side)
        time.sleep(0.005)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /-/healthz HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 200 ")
