"""Request bodies the sidecar holds in memory before a request is admitted: each has a deadline
(``body_timeout`` plus a second per ``body_min_rate`` bytes), and all together a budget
(``body_budget_bytes``; beyond it 503 + Retry-After before the body is read). A hostile probe held
300 nearly complete 1 MiB bodies (RSS 96 -> 418 MB) and trickled bodies past ``header_timeout``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.service_helpers import StubApache, sidecar_in_thread

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.service import Sidecar
from overtake.controller.sidecar.stages import load_stages

STAGES = ("stages: [{name: stage1, path: '^/s1/'}, {name: stage2, path: '^/stage2'}]\n"
          "limits: {max_inflight: 8, body_timeout: 1, body_min_rate: 1000, max_body_bytes: 200000, "
          "body_budget_bytes: 300000}\n")


@pytest.fixture(scope="module")
def side(stub: StubApache, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Sidecar]]:
    stages = Path(tmp_path_factory.mktemp("bodies")) / "stages.yaml"
    stages.write_text(STAGES)
    yield from sidecar_in_thread(stages, policy="pi(2)", apache=stub.url, status_interval=3600)


def _answer(c: socket.socket) -> bytes:
    got = b""
    while chunk := c.recv(65536):
        got += chunk
    return got


def _head(path: str, length: int) -> bytes:
    return f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


def test_a_stalled_body_gets_408(side: tuple[int, Sidecar], stub: StubApache) -> None:
    """1 s plus 1 s per 1000 bytes: 500 bytes of 100,000 then nothing is cut at about 1.5 s
    (the socket's 15 s is only the test's own guard)."""
    port, _ = side
    with socket.create_connection(("127.0.0.1", port), timeout=15) as c:
        c.sendall(_head("/stage2/stalled", 100_000) + b"x" * 500)
        assert _answer(c).startswith(b"HTTP/1.1 408")
    assert stub.hits["/stage2/stalled"] == 0


def test_a_trickling_body_gets_408(side: tuple[int, Sidecar], stub: StubApache) -> None:
    """A byte every 0.2 s keeps the connection busy but never catches up with 1000 bytes/s."""
    port, _ = side
    with socket.create_connection(("127.0.0.1", port), timeout=15) as c:
        c.sendall(_head("/stage2/trickle", 1000))
        c.settimeout(0.2)
        got = b""
        for _ in range(150):
            try:
                c.sendall(b"x")
                chunk = c.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            got += chunk
            if not chunk or got.endswith(b"\n"):
                break
        assert got.startswith(b"HTTP/1.1 408"), got[:80]
    assert stub.hits["/stage2/trickle"] == 0


def test_a_body_at_the_minimum_rate_is_received(side: tuple[int, Sidecar], stub: StubApache) -> None:
    """3000 bytes in 300-byte pieces every 0.1 s (3000 bytes/s, longer than body_timeout in all)."""
    port, _ = side
    with socket.create_connection(("127.0.0.1", port), timeout=15) as c:
        c.sendall(_head("/stage2/steady", 3000).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        for _ in range(10):
            time.sleep(0.1)
            c.sendall(b"y" * 300)
        assert _answer(c).startswith(b"HTTP/1.1 200")
    assert stub.bodies["/stage2/steady"] == [b"y" * 3000]


def test_bodies_beyond_the_budget_are_refused_before_they_are_read(side: tuple[int, Sidecar],
                                                                    stub: StubApache) -> None:
    """Budget 300,000: one 200,000-byte body being received leaves no room for a second (503 with
    Retry-After at once); once it is answered the room is back; the count returns to 0."""
    port, gw = side
    with socket.create_connection(("127.0.0.1", port), timeout=15) as a:
        a.sendall(_head("/stage2/first", 200_000).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
                  + b"a" * 1000)
        with socket.create_connection(("127.0.0.1", port), timeout=15) as b:
            b.sendall(_head("/stage2/second", 200_000))
            refused = _answer(b)
            assert refused.startswith(b"HTTP/1.1 503") and b"\r\nRetry-After: " in refused
            assert b"limits.body_budget_bytes" in refused
        chunked = (b"POST /stage2/chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + b"%x\r\n%s\r\n" % (150_000, b"c" * 150_000))
        with socket.create_connection(("127.0.0.1", port), timeout=15) as b:
            b.sendall(chunked)  # held as it comes: refused at the piece that does not fit
            assert _answer(b).startswith(b"HTTP/1.1 503")
        a.sendall(b"a" * 199_000)
        assert _answer(a).startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", port), timeout=15) as b:
        b.sendall(_head("/stage2/second", 200_000).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
                  + b"b" * 200_000)
        assert _answer(b).startswith(b"HTTP/1.1 200")
    assert stub.bodies["/stage2/first"] == [b"a" * 200_000] and stub.bodies["/stage2/second"] == [b"b" * 200_000]
    assert stub.hits["/stage2/chunked"] == 0
    deadline = time.monotonic() + 10  # the connections' ends are seen by the sidecar's loop
    budget = gw.gateway.body_budget
    while budget.used:
        assert time.monotonic() < deadline, budget.used
        time.sleep(0.01)


@pytest.mark.parametrize(("limits", "words"), [
    ("body_min_rate: 0", "limits.body_min_rate"),
    ("body_timeout: -1", "limits.body_timeout"),
    ("body_budget_bytes: 1000", "body_budget_bytes (1000) must be at least max_body_bytes"),
])
def test_bad_body_limits_name_the_key(tmp_path: Path, limits: str, words: str) -> None:
    f = tmp_path / "stages.yaml"
    f.write_text(f"stages: [{{name: a, path: '^/a'}}]\nlimits: {{{limits}}}\n")
    with pytest.raises(SidecarInputError, match="greater than 0|must be at least") as err:
        load_stages(f)
    assert words in str(err.value)
