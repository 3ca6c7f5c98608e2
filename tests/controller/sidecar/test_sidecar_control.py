"""The sidecar's control endpoints under hostile input: body caps before reading,
policy uploads that cannot block or exhaust the event loop, the policy token kept to its origin,
malformed policy metadata, and the Apache status scrape kept off the request path.

The sidecar runs as a subprocess (its memory is read from /proc) in front of a stub upstream on
loopback (tests/support/service_helpers.py), its control endpoints on their own loopback
listener with an admin token; a "remote" client is one that connects from 127.0.0.2.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import select
import shutil
import socket
import threading
import time
import zipfile
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from support.service_helpers import (
    ADMIN_TOKEN,
    STAGES,
    QuietHandler,
    SidecarProc,
    StubApache,
    free_port,
    inflating_archive,
    sidecar_in_thread,
    small_policy,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def policy_file(work: Path) -> Path:
    return small_policy(work / "small.npz")


@pytest.fixture(scope="module")
def side(work: Path, stub: StubApache) -> Iterator[SidecarProc]:
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url])
    try:
        yield s
    finally:
        s.stop()


def _stream_body(port: int, head: bytes, *, source: str, send_max: int) -> tuple[bytes, int]:
    """Send ``head`` then zeros until the sidecar answers or closes (or ``send_max`` bytes);
    (the answer, body bytes sent before it)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    sent, chunk, answer = 0, b"\0" * 65536, b""
    try:
        s.sendall(head)
        while sent < send_max:
            readable, writable, _ = select.select([s], [s], [], 5)
            if readable:
                break
            if writable:
                try:
                    sent += s.send(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    break
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if not select.select([s], [], [], 1)[0]:
                continue
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            answer += data
            if b"\r\n\r\n" in answer:
                break
    finally:
        s.close()
    return answer, sent


# ---- 1. control-endpoint bodies: who may send one, and how large --------------------------------
def test_remote_control_bodies_are_refused_before_reading(side: SidecarProc) -> None:
    """Four parallel 250 MB PUTs to the public listener from a non-loopback client: each is
    answered 403 after its header block (control endpoints are not served there), with at most a
    few MB taken off the wire, and the sidecar's memory stays put."""
    before = side.rss_kb()
    head = b"PUT /-/policy HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (250 * MiB)
    results: list[tuple[bytes, int]] = []

    def one() -> None:
        results.append(_stream_body(side.port, head, source="127.0.0.2", send_max=48 * MiB))

    th = [threading.Thread(target=one) for _ in range(4)]
    for t in th:
        t.start()
    for t in th:
        t.join(60)
    grown = side.rss_kb() - before
    assert grown < 30 * 1024, f"RSS grew by {grown} kB; sent {[n for _, n in results]}"
    for answer, sent in results:
        assert answer.startswith(b"HTTP/1.1 403 "), (answer[:200], sent)
        assert sent < 8 * MiB, sent
    assert b"not served on this listener" in results[0][0]
    assert side.request("GET", "/-/healthz")[0] == 200


def test_admin_control_bodies_are_capped_at_1_mib(side: SidecarProc) -> None:
    head = b"PUT /-/policy HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 * MiB)
    answer, sent = _stream_body(side.admin_port, head, source="127.0.0.1", send_max=64 * MiB)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert sent < 8 * MiB
    assert b"1048576" in answer and b"URL" in answer  # names the cap and the way around it
    chunked = b"PUT /-/policy HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", side.admin_port), timeout=10) as s:
        s.sendall(chunked)
        piece = b"%x\r\n%s\r\n" % (64 * 1024, b"a" * 64 * 1024)
        out = b""
        for _ in range(40):  # 2.5 MB in all, unless answered first
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([s], [], [], 0.01)[0]:
                break
        s.settimeout(5)
        try:
            out = s.recv(4096)
        except ConnectionResetError:
            pass
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]
    # a small body is still read: a baseline spec swaps
    code, _, body = side.request("PUT", "/-/policy", body=b"pi(3)")
    assert code == 200 and json.loads(body)["name"] == "pi(3)"
    assert side.request("PUT", "/-/policy", body=b"pi(2)")[0] == 200


# ---- 2. PUT /-/policy cannot block or exhaust the event loop -------------------------------------
def test_put_policy_refuses_fifo_and_devices_at_once(side: SidecarProc, work: Path) -> None:
    fifo = work / "policy.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    t0 = time.monotonic()
    code, _, body = side.request("PUT", "/-/policy", body=str(fifo).encode(), timeout=5)
    assert code == 422 and b"not a regular file" in body, body
    code, _, body = side.request("PUT", "/-/policy", body=b"/dev/zero", timeout=5)
    assert code == 422 and b"not a regular file" in body, body
    assert time.monotonic() - t0 < 3
    assert side.request("GET", "/-/healthz", timeout=2)[0] == 200


def test_put_policy_refuses_a_file_over_the_size_cap(work: Path, stub: StubApache, policy_file: Path) -> None:
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url, "--policy-max-bytes", "1000"])
    try:
        code, _, body = s.request("PUT", "/-/policy", body=str(policy_file).encode(), timeout=5)
        assert code == 422 and b"policy_max_bytes" in body and b"1000" in body, body
    finally:
        s.stop()


def _zip_bomb(n_bytes: int) -> bytes:
    """An .npz whose keys.npy declares and inflates to ``n_bytes`` of zeros (about 1000:1)."""
    buf = io.BytesIO()
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False, "shape": (n_bytes // 8,)})
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("keys.npy", "w", force_zip64=True) as f:
            f.write(header.getvalue())
            zero = bytes(8 * MiB)
            for _ in range(n_bytes // len(zero)):
                f.write(zero)
        meta = io.BytesIO()  # a well-formed header: what is refused must be the size alone
        np.save(meta, np.frombuffer(json.dumps({"format": "overtake-policy"}).encode(), dtype=np.uint8))
        z.writestr("meta.npy", meta.getvalue())
    return buf.getvalue()


def test_zip_bomb_is_refused_without_blocking_or_memory(side: SidecarProc) -> None:
    """A ~400 KB .npz that inflates to 400 MB: refused from the zip directory (member sizes)
    before anything is decompressed; health checks keep answering meanwhile."""
    bomb = _zip_bomb(400 * MiB)
    assert len(bomb) < 1 * MiB
    before = side.rss_kb()
    lat: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                side.request("GET", "/-/healthz", timeout=10)
            except OSError:
                pass
            lat.append(time.monotonic() - t)
            time.sleep(0.02)

    th = threading.Thread(target=probe)
    th.start()
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        code, _, body = side.request("PUT", "/-/policy", body=bomb, timeout=30)
        took = time.monotonic() - t0
        time.sleep(0.1)
    finally:
        stop.set()
        th.join()
    grown = side.rss_kb() - before
    numbers = f"PUT took {took:.2f} s, slowest healthz {max(lat):.2f} s, RSS grew by {grown} kB: {body[:200]!r}"
    assert took < 1.0 and max(lat) < 0.5 and grown < 50 * 1024, numbers
    assert code == 422 and b"keys.npy" in body and b"policy_max_array_bytes" in body, body
    assert body.count(b"policy:") == 1 and body.count(b"\n") == 1, body  # one line, not wrapped twice


def test_concurrent_inflating_uploads_keep_the_memory_bounded(work: Path, stub: StubApache) -> None:
    """15 concurrent uploads of a 400 KB .npz whose three members declare 127 MiB each (under
    the per-member cap, 381 MiB in all): each is refused from the zip directory, naming
    policy_max_inflated_bytes (or, beyond the loads the sidecar takes at once, answered 503), and
    the sidecar's peak RSS hardly moves (on main each upload inflated its 127 MiB meta.npy: the
    peak rose by hundreds of MB)."""
    bomb = inflating_archive(127 * MiB)
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url])
    try:
        peak0 = s.rss_kb("VmHWM")
        out: list[tuple[int, bytes]] = []

        def put() -> None:
            code, _, body = s.request("PUT", "/-/policy", body=bomb, timeout=60)
            out.append((code, body))

        th = [threading.Thread(target=put) for _ in range(15)]
        for t in th:
            t.start()
        for t in th:
            t.join(90)
        grown = s.rss_kb("VmHWM") - peak0
        refused = [body for code, body in out if code == 422]
        busy = [body for code, body in out if code == 503]  # beyond one load running and four waiting
        assert len(refused) + len(busy) == 15 and refused, out
        assert all(b"policy_max_inflated_bytes" in body for body in refused), refused
        assert all(b"policy load(s) running" in body for body in busy), busy
        assert grown < 48 * 1024, f"peak RSS grew by {grown} kB"
    finally:
        s.stop()


def test_policy_loads_are_bounded_by_their_threads(work: Path, stub: StubApache,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that hangs (a fault injected into load_policy) past policy_load_timeout keeps its
    slot until its thread ends: of 12 PUTs at once one gets the 422 of its deadline, the others
    503 naming the running load, and at most one load thread ever runs. On main the swap lock was
    released at each deadline and every PUT started another thread (12 at once)."""
    from overtake.controller.harness.loadgen import request
    from overtake.controller.sidecar import policy_in_force as sidecar_module

    real = sidecar_module.load_policy
    release, lock = threading.Event(), threading.Lock()
    running, most = [0], [0]

    def hung(spec: str, names: object, **kw: object) -> object:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            release.wait(30)
            return real(spec, names, **kw)  # type: ignore[arg-type]
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(sidecar_module, "load_policy", hung)
    stages = work / "stages-loads.yaml"
    stages.write_text(STAGES)
    gen = sidecar_in_thread(stages, policy="pi(2)", apache=stub.url, policy_load_timeout=0.5)
    _, side = next(gen)
    try:
        admin = side.admin_addr[1]
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        out: list[tuple[int, bytes]] = []

        def put() -> None:
            code, _, body = request("PUT", admin, "/-/policy", body=b"pi(1)", headers=auth, timeout=30)
            out.append((code, body))

        th = [threading.Thread(target=put) for _ in range(12)]
        for t in th:
            t.start()
        for t in th:
            t.join(30)
        assert most[0] == 1, f"{most[0]} load threads ran at once"
        codes = sorted(code for code, _ in out)
        assert codes == [422] + [503] * 11, out
        assert all(b"policy load" in body or b"load slot" in body for code, body in out if code == 503), out
        release.set()
        deadline = time.monotonic() + 10
        while side.loads.threads:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        code, _, body = request("PUT", admin, "/-/policy", body=b"pi(1)", headers=auth, timeout=30)
        assert code == 200 and json.loads(body)["name"] == "pi(1)", body
    finally:
        release.set()
        gen.close()


def test_put_policy_url_must_be_allow_listed(side: SidecarProc) -> None:
    other = StubApache()
    try:
        code, _, body = side.request("PUT", "/-/policy", body=f"{other.url}/v1/models/x/policy.npz".encode())
        assert code == 403 and b"admin_policy_urls" in body, body
        assert sum(other.hits.values()) == 0  # never contacted
    finally:
        other.close()


@pytest.mark.parametrize(("url", "ok"), [
    ("http://api:8000/v1/models/x/policy.npz", True),    # policy_url's origin
    ("http://api:8000/anything", True),
    ("http://API:8000/v1/models/y", True),               # host names are case-insensitive
    ("https://api:8000/v1/models/x", False),             # another scheme is another origin
    ("http://api:8001/v1/models/x", False),
    ("http://files/policies/a.npz", True),               # under an allowed prefix
    ("http://files:80/policies/a.npz", True),            # the default port made explicit
    ("http://files/policies", True),
    ("http://files/policiesX/a.npz", False),             # a prefix is a path segment, not a string
    ("http://files.evil/policies/a.npz", False),
    ("http://api:8000@evil/policies/a.npz", False),      # userinfo: the host is evil
    ("file:///etc/passwd", False),
])
def test_url_allow_list(url: str, ok: bool) -> None:
    from overtake.controller.sidecar.policy_fetch import url_allowed

    assert url_allowed(url, ["http://files/policies"], "http://api:8000/v1/models/m1") is ok


# ---- 3. the policy token goes only to the policy URL's origin ------------------------------------
class PolicyServer:
    """Serves a policy artifact and records each request's path and Authorization header;
    ``/redirect`` answers 302 to ``redirect_to``."""

    def __init__(self, artifact: bytes) -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.redirect_to = ""
        srv = self

        class H(QuietHandler):
            def do_GET(self) -> None:
                srv.seen.append((self.path, self.headers.get("Authorization")))
                if self.path.startswith("/redirect"):
                    self.send_response(302)
                    self.send_header("Location", srv.redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("ETag", '"a1"')
                self.send_header("Content-Length", str(len(artifact)))
                self.end_headers()
                self.wfile.write(artifact)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_policy_token_stays_with_its_origin(work: Path, stub: StubApache, policy_file: Path) -> None:
    api, other = PolicyServer(policy_file.read_bytes()), PolicyServer(policy_file.read_bytes())
    other_url = other.url.replace("127.0.0.1", "localhost")  # another origin, allow-listed
    api.redirect_to = f"{other_url}/v1/models/r/policy.npz"
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url, "--policy-url", f"{api.url}/v1/models/m1",
                           "--policy-token", "s3cret", "--admin-policy-url", other_url])
    try:
        assert api.seen and all(auth == "Bearer s3cret" for _, auth in api.seen)
        # a PUT URL on another (allow-listed) origin gets the artifact without the token
        code, _, body = s.request("PUT", "/-/policy", body=f"{other_url}/v1/models/x/policy.npz".encode())
        assert code == 200, body
        assert other.seen and all(auth is None for _, auth in other.seen), other.seen
        # a redirect from the policy URL's origin to another origin drops Authorization
        n = len(other.seen)
        code, _, body = s.request("PUT", "/-/policy", body=f"{api.url}/redirect".encode())
        assert code == 200, body
        assert api.seen[-1] == ("/redirect", "Bearer s3cret")
        assert len(other.seen) == n + 1 and other.seen[-1] == ("/v1/models/r/policy.npz", None), other.seen
    finally:
        s.stop()
        api.close()
        other.close()


def test_a_redirect_cannot_leave_the_allow_list(work: Path, stub: StubApache, policy_file: Path) -> None:
    """``PUT /-/policy`` with a URL on the policy URL's origin that redirects to an origin on no
    list: refused (422, naming admin_policy_urls) before the redirect target is contacted, the
    old policy kept (on main the redirect was followed and its policy installed)."""
    api, other = PolicyServer(policy_file.read_bytes()), PolicyServer(policy_file.read_bytes())
    api.redirect_to = f"{other.url.replace('127.0.0.1', 'localhost')}/v1/models/r/policy.npz"
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url, "--policy-url", f"{api.url}/v1/models/m1"])
    try:
        code, _, body = s.request("PUT", "/-/policy", body=f"{api.url}/redirect".encode())
        assert code == 422 and b"redirected (302)" in body and b"admin_policy_urls" in body, body
        assert other.seen == [], other.seen
        assert json.loads(s.request("GET", "/-/policy")[2])["name"] == "policy-m1.npz"
    finally:
        s.stop()
        api.close()
        other.close()


def test_get_policy_redacts_credentials_in_the_policy_url(work: Path, stub: StubApache, policy_file: Path) -> None:
    """A ``policy_url`` with a query-string token: ``GET /-/policy`` does not show it (on main it
    was echoed verbatim); userinfo is redacted the same way (test_redact_url)."""
    api = PolicyServer(policy_file.read_bytes())
    url = api.url + "/v1/models/m1/policy.npz?token=s3cret"
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url, "--policy-url", url])
    try:
        raw = s.request("GET", "/-/policy")[2]
        info = json.loads(raw)
        assert b"s3cret" not in raw, raw
        shown = api.url + "/v1/models/m1/policy.npz?REDACTED"
        assert info["policy_url"] == shown and info["source"] == shown, info
        assert api.seen and api.seen[0][0].endswith("?token=s3cret")  # the real URL is still used
    finally:
        s.stop()
        api.close()


def test_redact_url() -> None:
    from overtake.controller.sidecar.policy_fetch import redact_url

    assert redact_url("https://u:p@h:8/a/b?x=1#f") == "https://REDACTED@h:8/a/b?REDACTED"
    assert redact_url("http://h/v1/models/m/policy.npz") == "http://h/v1/models/m/policy.npz"
    assert redact_url("/etc/overtake/policy.npz") == "/etc/overtake/policy.npz"
    assert redact_url("pi(2)") == "pi(2)"


# ---- 4. policy metadata that is not a mapping ----------------------------------------------------
def _bad_meta_policy(path: Path, meta: bytes) -> Path:
    buf = io.BytesIO()
    np.savez_compressed(buf, keys=np.arange(3, dtype=np.int64), spawn=np.zeros((3, 4), dtype=np.int16),
                        meta=np.frombuffer(meta, dtype=np.uint8))
    path.write_bytes(buf.getvalue())
    return path


@pytest.mark.parametrize("meta", [b"[1,2]", b"null"])
def test_policy_metadata_must_be_a_mapping(side: SidecarProc, work: Path, meta: bytes) -> None:
    bad = _bad_meta_policy(work / "bad-meta.npz", meta)
    code, _, body = side.request("PUT", "/-/policy", body=bad.read_bytes(), timeout=10)
    assert code == 422 and b"meta" in body and b"mapping" in body, body
    code, _, body = side.request("PUT", "/-/policy", body=str(bad).encode(), timeout=10)
    assert code == 422 and b"meta" in body, body


def test_file_watcher_survives_bad_metadata(work: Path, stub: StubApache, policy_file: Path) -> None:
    live = work / "live.npz"
    shutil.copy(policy_file, live)
    s = SidecarProc(work, ["--policy", str(live), "--apache", stub.url, "--watch-interval", "0.2"])
    try:
        first = json.loads(s.request("GET", "/-/policy")[2])["hash"]
        for meta in (b"[1,2]", b"null"):
            _bad_meta_policy(work / "tmp.npz", meta).replace(live)
            time.sleep(0.8)
        refused = [e for e in s.events() if e.get("event") == "policy_refused"]
        assert len(refused) == 2 and all("mapping" in e["detail"] for e in refused), refused
        assert s.request("PUT", "/-/policy", body=b"pi(1)")[0] == 200  # then back to the file's policy
        shutil.copy(policy_file, work / "tmp.npz")
        (work / "tmp.npz").replace(live)
        deadline = time.monotonic() + 5
        while json.loads(s.request("GET", "/-/policy")[2])["hash"] != first:
            assert time.monotonic() < deadline, "the watcher stopped after the bad files"
            time.sleep(0.1)
    finally:
        s.stop()


# ---- 5./6. the mod_status scrape ----------------------------------------------------------------
def test_metrics_scrapes_do_not_reach_apache(side: SidecarProc, stub: StubApache) -> None:
    n0 = stub.hits["/server-status"]
    for _ in range(40):
        code, _, body = side.request("GET", "/-/metrics")
        assert code == 200 and b"apache_up 1.0" in body
    assert stub.hits["/server-status"] - n0 <= 2, stub.hits["/server-status"] - n0


def test_apache_without_mod_status(work: Path) -> None:
    bare = StubApache(mod_status=False)
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", bare.url, "--status-interval", "0.2"])
    try:
        assert s.request("GET", "/stage2")[0] == 200
        time.sleep(1.0)  # several scrape periods
        text = s.request("GET", "/-/metrics")[2].decode()
        assert not [ln for ln in text.splitlines() if ln.startswith("apache_")], text
        log = s.text()
        assert "not reachable" not in log, log
        assert sum("mod_status" in (e.get("msg", "") + e.get("detail", "")) for e in s.events()) == 1, log
    finally:
        s.stop()
        bare.close()


def test_unreachable_apache_still_reports_apache_up_0(work: Path) -> None:
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", f"http://127.0.0.1:{free_port()}"])
    try:
        text = s.request("GET", "/-/metrics")[2].decode()
        assert "apache_up 0.0" in text
        assert s.request("GET", "/stage2")[0] == 502
    finally:
        s.stop()


def test_put_policy_answers_are_one_line(side: SidecarProc) -> None:
    code, _, body = side.request("PUT", "/-/policy", body=b"nope")
    assert code == 422 and body.count(b"\n") == 1
    conn = http.client.HTTPConnection("127.0.0.1", side.admin_port, timeout=5)
    conn.request("DELETE", "/-/policy")
    assert conn.getresponse().status == 405
    conn.close()
