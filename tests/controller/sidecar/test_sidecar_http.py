"""HTTP/1.1 proxy semantics of the gateway against a real upstream that reports what it received.

The upstream is a stdlib ThreadingHTTPServer (a real server on a socket): it echoes the request
line, headers and body it got, and can answer with a chunked body of a requested size. The
gateway runs in-process on its own event loop thread. Checked: X-Forwarded-For appended, hop-by-hop
headers (fixed list + those named in Connection) removed both ways, chunked request bodies
de-chunked with Content-Length, Expect: 100-continue answered, chunked responses buffered
(Content-Length to the client) or, beyond response_buffer_bytes, streamed chunked; and a stage
slot is held until Apache's whole response is in.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from support.service_helpers import QuietHandler, sidecar_in_thread

from overtake.controller.sidecar.service import Sidecar


class Echo(QuietHandler):
    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        if self.path.startswith("/chunked/"):
            size = int(self.path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "keep-alive, X-Upstream-Private")
            self.send_header("X-Upstream-Private", "secret")
            self.send_header("Keep-Alive", "timeout=5")
            self.end_headers()
            sent = 0
            while sent < size:
                part = b"z" * min(1000, size - sent)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                sent += len(part)
                time.sleep(0.001)
            self.wfile.write(b"0\r\n\r\n")
            return
        if self.path.startswith("/slow/"):
            time.sleep(float(self.path.rsplit("/", 1)[1]))
        out = json.dumps({
            "line": self.requestline, "headers": [[k, v] for k, v in self.headers.items()],
            "body": body.decode("latin-1"),
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = _answer


@pytest.fixture(scope="module")
def upstream() -> Iterator[int]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield int(srv.server_address[1])
    finally:
        srv.shutdown()
        srv.server_close()


def _serve(upstream: int, d: Path, uplink: str) -> Iterator[tuple[int, Sidecar]]:
    stages = Path(d) / "stages.yaml"
    stages.write_text(
        "stages:\n  - name: stage1\n    path: '^/slow/'\n  - name: stage2\n    path: '^/stage2'\n"
        "limits: {response_buffer_bytes: 4096, max_inflight: 8}\n"
    )
    yield from sidecar_in_thread(stages, policy="pi(1)", apache=f"http://127.0.0.1:{upstream}", uplink=uplink)


@pytest.fixture(scope="module")
def gateway(upstream: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Sidecar]]:
    yield from _serve(upstream, tmp_path_factory.mktemp("gw"), "fair")


def test_uplink_bands_are_on_the_metrics_page(upstream: int, tmp_path: Path) -> None:
    """With an uplink scheduler (here the app-level one, which needs no qdisc) the bytes it wrote
    are on /-/metrics (metrics per band; the app-level scheduler has one band, "app")."""
    gen = _serve(upstream, tmp_path, "app")
    port, side = next(gen)
    try:
        sizes = [3000, 20000, 150000]
        for n in sizes:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", f"/chunked/{n}")
            assert len(conn.getresponse().read()) == n
            conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", side.admin_addr[1], timeout=10)
        conn.request("GET", "/-/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
    finally:
        gen.close()
    sent = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('overtake_uplink_bytes_total{band="app"}'))
    assert sum(sizes) < sent < sum(sizes) + 2000 * len(sizes)  # bodies plus header blocks


def _raw(port: int, data: bytes, *, read_until_close: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(data)
        out = b""
        while True:
            chunk = c.recv(65536)
            if not chunk:
                break
            out += chunk
            if not read_until_close and b"\r\n\r\n" in out:
                head, _, body = out.partition(b"\r\n\r\n")
                n = [int(v) for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:]) if k.lower() == b"content-length"]
                if n and len(body) >= n[0]:
                    break
        return out


def test_forwarded_headers(gateway: tuple[int, Sidecar]) -> None:
    port, _ = gateway
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/echo?q=1", headers={
        "X-Forwarded-For": "10.0.0.7", "Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "1",
        "Keep-Alive": "timeout=9", "TE": "trailers", "Proxy-Connection": "keep-alive", "X-Keep": "yes",
    })
    r = conn.getresponse()
    got = json.loads(r.read())
    conn.close()
    h = {k.lower(): v for k, v in got["headers"]}
    assert got["line"] == "GET /echo?q=1 HTTP/1.1"
    assert h["x-forwarded-for"] == "10.0.0.7, 127.0.0.1"
    assert h["x-keep"] == "yes" and h["host"] == f"127.0.0.1:{port}"
    for hop in ("x-drop-me", "keep-alive", "te", "proxy-connection"):
        assert hop not in h, hop


def test_chunked_request_body_and_expect_continue(gateway: tuple[int, Sidecar]) -> None:
    port, _ = gateway
    body = b"hello chunked world" * 100
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 500]), body[i:i + 500]) for i in range(0, len(body), 500))
    out = _raw(port, b"POST /echo HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n"
               b"Connection: close\r\n\r\n" + chunks + b"0\r\n\r\n", read_until_close=True)
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 ")
    got = json.loads(out.split(b"\r\n\r\n", 2)[2])
    h = {k.lower(): v for k, v in got["headers"]}
    assert got["body"].encode() == body
    assert h["content-length"] == str(len(body)) and "transfer-encoding" not in h and "expect" not in h


@pytest.mark.parametrize(("size", "streamed"), [(3000, False), (50_000, True)])
def test_chunked_response_buffered_or_streamed(gateway: tuple[int, Sidecar], size: int, streamed: bool) -> None:
    port, _ = gateway
    out = _raw(port, f"GET /chunked/{size} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n".encode(), read_until_close=True)
    head, _, body = out.partition(b"\r\n\r\n")
    lines = {ln.split(b":", 1)[0].lower(): ln.split(b":", 1)[1].strip() for ln in head.split(b"\r\n")[1:]}
    assert b"x-upstream-private" not in lines and b"keep-alive" not in lines
    if streamed:  # beyond response_buffer_bytes: passed through chunked
        assert lines[b"transfer-encoding"] == b"chunked"
        data, rest = b"", body
        while True:
            n_hex, _, rest = rest.partition(b"\r\n")
            n = int(n_hex, 16)
            if n == 0:
                break
            data, rest = data + rest[:n], rest[n + 2:]
        assert data == b"z" * size
    else:  # buffered whole: de-chunked with a Content-Length
        assert lines[b"content-length"] == str(size).encode() and body == b"z" * size


def test_stage_slot_held_until_the_response_is_complete(gateway: tuple[int, Sidecar]) -> None:
    """pi(1) on stage1: two 0.3 s upstream answers must run one after the other."""
    port, side = gateway
    t0 = time.monotonic()
    done: list[float] = []

    def one() -> None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/slow/0.3")
        assert c.getresponse().status == 200
        done.append(time.monotonic() - t0)
        c.close()

    th = [threading.Thread(target=one) for _ in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    done.sort()
    assert done[0] >= 0.3 and done[1] >= 0.6  # serialised by the policy
    assert side.limiter.inflight_total == 0 and side.limiter.max_seen_inflight == 1
