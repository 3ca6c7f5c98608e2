"""`overtake sidecar` in front of a real private Apache (controller.harness.apache).

Concurrency limits are verified with Apache's own access log (request begin + %D per request id),
not with the sidecar's counters. Needs Debian's apache2 (see tests/controller/harness/test_apache.py);
skips otherwise.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.service_helpers import ADMIN_TOKEN, admin_token_file, is_admin_path

from overtake.controller.harness import apache
from overtake.controller.harness.loadgen import request
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.mdp import Stage, TandemModel, Truncation, solve

REPO = Path(__file__).resolve().parents[3]

STAGES = """
stages:
  - name: stage1
    path: "^/stage1$"
  - name: stage2
    path: "^/stage2$"
    queue_cap: 2
    queue_timeout: 0.6
limits: {max_inflight: 4, queue_cap: 100, queue_timeout: 20, max_body_bytes: 100000, response_buffer_bytes: 4096}
"""


def _tmpdir() -> Path:
    return scratch_dir("overtake-sidecar-test-")


def _apache_core() -> int | None:
    cores = sorted(os.sched_getaffinity(0))
    return cores[-1] if len(cores) > 1 else None


def _start_apache(parent: Path, port: int | None = None) -> apache.ApacheInstance:
    return apache.start(parent / "wd", f"127.0.0.1:{port or free_port()}", cpu=_apache_core(), max_workers=32)


@pytest.fixture(scope="module")
def inst(apache_available: None) -> Iterator[apache.ApacheInstance]:
    parent = _tmpdir()
    i = _start_apache(parent)
    try:
        yield i
    finally:
        apache.stop(i.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


def _raise_autogroup(pid: int) -> None:
    """Give a process started in its own session the priority Apache gets (root only; a shared
    machine's other jobs otherwise starve it: ``nice`` only ranks threads inside one autogroup)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("-20")
    except OSError:
        pass


class SidecarProc:
    """`python -m api.cli sidecar ...` as a subprocess."""

    def __init__(self, apache_url: str, stages: str, policy: str, workdir: Path, *extra: str) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.stages = workdir / f"stages-{self.port}.yaml"
        self.stages.write_text(stages)
        self.log = workdir / f"sidecar-{self.port}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "overtake.api.cli", "sidecar", "--policy", policy, "--apache", apache_url,
                 "--listen", f"127.0.0.1:{self.port}", "--stages", str(self.stages),
                 "--admin-listen", f"127.0.0.1:{self.admin_port}", "--admin-token-file", str(admin_token_file(workdir)),
                 *extra],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        _raise_autogroup(self.proc.pid)
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.get("/-/healthz")[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sidecar did not start: {self.log.read_text()}")
            time.sleep(0.1)

    def request(self, method: str, path: str, *, headers: dict[str, str] | None = None,
                body: bytes | None = None, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
        """Admin paths go to the admin listener, a PUT there with the admin token."""
        port = self.admin_port if is_admin_path(path) else self.port
        if method == "PUT" and is_admin_path(path):
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", **(headers or {})}
        return request(method, port, path, body=body, headers=headers, timeout=timeout)

    def get(self, path: str, rid: str | None = None, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        h = dict(kw.pop("headers", {}) or {})
        if rid:
            h["X-Request-Id"] = rid
        return self.request("GET", path, headers=h, **kw)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for fam in text_string_to_metric_families(self.get("/-/metrics")[2].decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def put_policy(self, body: bytes) -> tuple[int, bytes]:
        code, _, text = self.request("PUT", "/-/policy", body=body)
        return code, text

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def m(metrics: dict[Any, float], metric: str, /, **labels: str) -> float:
    return metrics.get((metric, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two solved H2 policies (different loads: different tables and hashes)."""
    d = tmp_path_factory.mktemp("policies")
    out = {}
    a, T = np.array([0.91, 0.09]), np.diag(-1.0 / np.array([0.55, 5.45]))
    for name, lam in (("rho06", 0.3), ("rho04", 0.2)):
        model = TandemModel(arrival_rate=lam, stages=(Stage("stage1", a, T), Stage("stage2", a, T)))
        solve(model, truncation=Truncation(8, 3)).policy.save(d / f"{name}.npz")
        out[name] = d / f"{name}.npz"
    one = TandemModel(arrival_rate=0.3, stages=(Stage("other", a, T),))
    solve(one, truncation=Truncation(8, 3)).policy.save(d / "mismatch.npz")
    out["mismatch"] = d / "mismatch.npz"
    return out


@pytest.fixture(scope="module")
def side(inst: apache.ApacheInstance, policies: dict[str, Path]) -> Iterator[SidecarProc]:
    work = _tmpdir()
    live = work / "live.npz"
    shutil.copy(policies["rho06"], live)
    s = SidecarProc(inst.base_url, STAGES, str(live), work)
    s.live_policy = live  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        s.stop()
        shutil.rmtree(work, ignore_errors=True)


def _records(inst: apache.ApacheInstance, rids: list[str], timeout: float = 3.0) -> list[apache.AccessRecord]:
    deadline = time.monotonic() + timeout
    while True:
        by = {r.request_id: r for r in apache.read_access_log(inst.workdir)}
        if all(r in by for r in rids) or time.monotonic() > deadline:
            return [by[r] for r in rids if r in by]
        time.sleep(0.02)


def _max_overlap(recs: list[apache.AccessRecord], slack_us: int = 3000) -> int:
    """Most requests inside Apache at once by Apache's own clock. ``slack_us`` trims each end:
    Apache logs a request just after sending its response, when the sidecar may already have
    released the next one."""
    ev = []
    for r in recs:
        ev.append((r.begin_us, 1))
        ev.append((r.begin_us + max(r.duration_us - slack_us, 1), -1))
    ev.sort(key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best


def _burst(s: SidecarProc, paths: list[str], **kw: Any) -> tuple[list[str], list[int]]:
    rids = [uuid.uuid4().hex for _ in paths]
    codes = [0] * len(paths)

    def one(i: int) -> None:
        c, _, b = s.get(paths[i], rids[i], **kw)
        codes[i] = c
        if c != 200:
            print("burst", paths[i], c, b)

    th = [threading.Thread(target=one, args=(i,)) for i in range(len(paths))]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return rids, codes


def _wait_idle(s: SidecarProc, timeout: float = 5.0) -> dict[Any, float]:
    deadline = time.monotonic() + timeout
    while True:
        mm = s.metrics()
        if m(mm, "overtake_inflight") == 0 or time.monotonic() > deadline:
            return mm


# --------------------------------------------------------------------------- enforcement


@pytest.mark.parametrize(("policy", "cap"), [("pi(2)", 2), ("passthrough", 4)])
def test_apache_never_runs_more_than_the_policy_allows(side: SidecarProc, inst: apache.ApacheInstance,
                                                        policy: str, cap: int) -> None:
    # passthrough = pi(inf): then the stages file's hard cap (max_inflight 4) is what binds
    assert side.put_policy(policy.encode())[0] == 200
    rids, codes = _burst(side, ["/stage1?work=0.03"] * 10)
    assert codes == [200] * 10
    recs = _records(inst, rids)
    assert len(recs) == 10
    assert _max_overlap(recs) == cap  # reached, never exceeded (Apache's clock)
    mm = _wait_idle(side)
    assert m(mm, "overtake_inflight_max") <= 4


def test_per_stage_caps(side: SidecarProc, inst: apache.ApacheInstance) -> None:
    assert side.put_policy(b"pi(1,1)")[0] == 200
    rids, codes = _burst(side, ["/stage1?work=0.03"] * 5 + ["/stage2?work=0.03"] * 2)
    assert codes == [200] * 7
    recs = _records(inst, rids)
    s1 = [r for r in recs if r.stage == "1"]
    s2 = [r for r in recs if r.stage == "2"]
    assert len(s1) == 5 and len(s2) == 2
    assert _max_overlap(s1) == 1 and _max_overlap(s2) == 1
    assert _max_overlap(recs) == 2


def test_table_policy_admits_and_completes(side: SidecarProc, inst: apache.ApacheInstance, policies: dict[str, Path]) -> None:
    assert side.put_policy(policies["rho06"].read_bytes())[0] == 200
    paths = ["/stage1?work=0.01"] * 10 + ["/stage2?work=0.01"] * 2  # stage2's queue_cap is 2
    rids, codes = _burst(side, paths, headers={"X-Overtake-Phase": "1"})
    assert codes == [200] * 12
    assert _max_overlap(_records(inst, rids)) <= 3  # the table's thread truncation (max_threads 3)
    mm = _wait_idle(side)
    adm = sum(m(mm, "overtake_stage_admitted_total", stage=f"stage{i}", phase="1") for i in (1, 2))
    assert adm >= 12
    assert m(mm, "overtake_policy_guard_admissions_total") == 0


# --------------------------------------------------------------------------- admission control


def test_queue_full_and_queue_timeout_answer_503(side: SidecarProc, inst: apache.ApacheInstance) -> None:
    assert side.put_policy(b"pi(1,1)")[0] == 200
    before = side.metrics()
    blocker = threading.Thread(target=side.get, args=("/stage2?work=1.0",))
    blocker.start()
    time.sleep(0.2)
    results: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def queued(rid: str) -> None:
        results[rid] = side.get("/stage2?work=0.001", rid)

    waiting = [uuid.uuid4().hex for _ in range(2)]
    th = [threading.Thread(target=queued, args=(r,)) for r in waiting]
    for t in th:
        t.start()
    time.sleep(0.15)
    full_rid = uuid.uuid4().hex
    code, hdrs, body = side.get("/stage2?work=0.001", full_rid)
    assert code == 503 and hdrs["retry-after"] == "1" and b"queue full" in body
    for t in th:
        t.join()
    blocker.join()
    for r in waiting:
        assert results[r][0] == 503 and b"queue timeout" in results[r][2]
    time.sleep(0.3)
    logged = {r.request_id for r in apache.read_access_log(inst.workdir)}
    assert not logged & {*waiting, full_rid}  # rejected requests never reached Apache
    after = _wait_idle(side)
    d = lambda reason: m(after, "overtake_stage_rejected_total", stage="stage2", reason=reason) - m(  # noqa: E731
        before, "overtake_stage_rejected_total", stage="stage2", reason=reason)
    assert d("queue_full") == 1 and d("queue_timeout") == 2


def test_client_disconnect_while_queued_is_never_sent(side: SidecarProc, inst: apache.ApacheInstance) -> None:
    assert side.put_policy(b"pi(1,1)")[0] == 200
    before = side.metrics()
    blocker = threading.Thread(target=side.get, args=("/stage1?work=0.5",))
    blocker.start()
    time.sleep(0.15)
    rid = uuid.uuid4().hex
    with socket.create_connection(("127.0.0.1", side.port)) as c:
        c.sendall(f"GET /stage1?work=0.001 HTTP/1.1\r\nHost: x\r\nX-Request-Id: {rid}\r\n\r\n".encode())
        time.sleep(0.15)
        mid = side.metrics()
        assert m(mid, "overtake_stage_queued", stage="stage1", phase="1") == 1
    blocker.join()
    time.sleep(0.3)
    assert rid not in {r.request_id for r in apache.read_access_log(inst.workdir)}
    after = _wait_idle(side)
    assert m(after, "overtake_stage_queued", stage="stage1", phase="1") == 0
    gone = m(after, "overtake_stage_rejected_total", stage="stage1", reason="client_gone") - m(
        before, "overtake_stage_rejected_total", stage="stage1", reason="client_gone")
    assert gone == 1


def test_bad_requests_get_4xx_and_others_are_unaffected(side: SidecarProc) -> None:
    assert side.put_policy(b"pi(2)")[0] == 200
    good: list[int] = []
    th = [threading.Thread(target=lambda: good.append(side.get("/stage1?work=0.05")[0])) for _ in range(4)]
    for t in th:
        t.start()

    def raw(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", side.port), timeout=10) as c:
            c.sendall(data)
            return c.recv(4096)

    assert raw(b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431 ")
    assert raw(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n" + b"a" * 150000).startswith(b"HTTP/1.1 413 ")
    assert side.put_policy(side.live_policy.read_bytes())[0] == 200  # type: ignore[attr-defined]
    code, _, body = side.get("/stage1?work=0", headers={"X-Overtake-Phase": "9"})
    assert code == 400 and b"X-Overtake-Phase: must name a phase of stage 1: 1..2 or short, long" in body
    for t in th:
        t.join()
    assert good == [200] * 4


def test_proxy_semantics(side: SidecarProc) -> None:
    """Bodies, HEAD, keep-alive, hop-by-hop removal; 16 kB > response_buffer_bytes (4 kB) takes
    the streaming path and arrives intact."""
    want = (REPO / "apache-conf" / "htdocs" / "static" / "16k.txt").read_bytes()
    conn = http.client.HTTPConnection("127.0.0.1", side.port, timeout=10)
    try:
        for _ in range(3):  # keep-alive: one connection, several requests
            conn.request("GET", "/static/16k.txt", headers={"Connection": "keep-alive, X-Secret", "X-Secret": "1"})
            r = conn.getresponse()
            assert r.status == 200 and r.read() == want
            assert r.getheader("Keep-Alive") is None and r.getheader("Content-Length") == str(len(want))
        conn.request("HEAD", "/static/16k.txt")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b"" and r.getheader("Content-Length") == str(len(want))
        conn.request("POST", "/stage1?work=0", body=b"x" * 5000)
        r = conn.getresponse()
        assert r.status == 200 and r.read().startswith(b"ok stage=1")
    finally:
        conn.close()


# --------------------------------------------------------------------------- hot swap


def test_policy_swaps_and_refusals(side: SidecarProc, policies: dict[str, Path]) -> None:
    live: Path = side.live_policy  # type: ignore[attr-defined]
    assert side.put_policy(live.read_bytes())[0] == 200
    info = side.get("/-/policy")[2]
    h06 = __import__("json").loads(info)["hash"]
    # corrupt bytes and a mismatched model are refused, the old policy stays
    code, text = side.put_policy(b"PK\x03\x04garbage")
    assert code == 422 and b"refused, old policy kept" in text and b"not an overtake policy file" in text
    code, text = side.put_policy(policies["mismatch"].read_bytes())
    assert code == 422 and b"solved for stages ['other']" in text
    code, text = side.put_policy(b"pi(1,2,3)")
    assert code == 422 and b"per-stage caps" in text
    mm = side.metrics()
    meta = __import__("json").loads(side.get("/-/policy")[2])
    assert meta["hash"] == h06 and meta["name"].startswith("upload-") and meta["swaps"] >= 1 and meta["refused"] >= 3
    assert m(mm, "overtake_policy_info", name=meta["name"], version=meta["version"], hash=h06, phase_info="full",
             chosen=meta["name"], reason="") == 1
    # file watch: a new policy written over the file is picked up; a corrupt one is refused
    tmp = live.with_suffix(".tmp")
    shutil.copy(policies["rho04"], tmp)
    os.replace(tmp, live)
    deadline = time.monotonic() + 5
    while __import__("json").loads(side.get("/-/policy")[2])["hash"] == h06:
        assert time.monotonic() < deadline, "file change not picked up"
        time.sleep(0.1)
    h04 = __import__("json").loads(side.get("/-/policy")[2])["hash"]
    refused0 = m(side.metrics(), "overtake_policy_refused_total")
    live.write_bytes(b"not a policy at all")
    deadline = time.monotonic() + 5
    while m(side.metrics(), "overtake_policy_refused_total") == refused0:
        assert time.monotonic() < deadline, "corrupt file not noticed"
        time.sleep(0.1)
    assert __import__("json").loads(side.get("/-/policy")[2])["hash"] == h04
    assert side.get("/stage1?work=0")[0] == 200  # still serving with the old policy
    shutil.copy(policies["rho06"], live)
    # structured logs: one JSON object a line, swaps and refusals with their source
    events = [__import__("json").loads(ln) for ln in side.log.read_text().splitlines() if ln.strip()]
    kinds = {(e.get("event"), e.get("source")) for e in events}
    assert {("start", None), ("policy_swap", "admin"), ("policy_refused", "admin"),
            ("policy_swap", "file_watch"), ("policy_refused", "file_watch")} <= kinds


def test_swap_under_load_drops_nothing(side: SidecarProc) -> None:
    specs = [b"pi(1)", b"passthrough", b"pi(2,1)", side.live_policy.read_bytes()]  # type: ignore[attr-defined]
    stop = threading.Event()

    def swapper() -> None:
        i = 0
        while not stop.is_set():
            assert side.put_policy(specs[i % len(specs)])[0] == 200
            i += 1
            time.sleep(0.02)

    sw = threading.Thread(target=swapper)
    sw.start()
    try:
        _, codes = _burst(side, ["/stage1?work=0.005"] * 28 + ["/stage2?work=0.005"] * 2)
    finally:
        stop.set()
        sw.join()
    assert codes == [200] * 30
    mm = _wait_idle(side)
    assert m(mm, "overtake_inflight") == 0


# --------------------------------------------------------------------------- metrics


def test_one_scrape_shows_sidecar_and_apache(side: SidecarProc) -> None:
    side.get("/static/hello.txt")
    mm = side.metrics()
    assert m(mm, "apache_up") == 1
    assert m(mm, "apache_accesses_total") > 0
    assert m(mm, "apache_workers", state="busy") >= 1  # the status request itself
    assert m(mm, "apache_workers", state="busy") + m(mm, "apache_workers", state="idle") == 32
    assert sum(v for (n, _), v in mm.items() if n == "apache_scoreboard") >= 32
    assert m(mm, "overtake_inflight_limit") == 4
    assert m(mm, "overtake_stage_duration_seconds_count", stage="passthrough", phase="all") >= 1
    admitted = sum(v for (n, _), v in mm.items() if n == "overtake_stage_admitted_total")
    ended = sum(v for (n, _), v in mm.items() if n == "overtake_stage_completed_total")
    assert admitted == ended + m(mm, "overtake_inflight")


# --------------------------------------------------------------------------- failures


STAGES_NEXT = """
stages:
  - name: stage1
    path: "^/stage1$"
    next: stage2
  - name: stage2
    path: "^/stage2$"
limits: {max_inflight: 4, follow_up_timeout: 0.4}
"""


def _keepalive_get(c: http.client.HTTPConnection, path: str, rid: str) -> int:
    c.request("GET", path, headers={"X-Request-Id": rid})
    r = c.getresponse()
    r.read()
    return r.status


@pytest.mark.parametrize("follow_up", ["sent", "never"])
def test_next_stage_reservation_orders_apache_like_the_model(inst: apache.ApacheInstance, follow_up: str) -> None:
    """pi(1) with stage1 -> next: stage2. A's stage-2 follow-up runs before B's stage-1 request,
    which waited while A's stage 1 ran (the model's tandem); if A never sends it, B gets the
    thread when the reservation lapses (follow_up_timeout), not before."""
    work = _tmpdir()
    s = SidecarProc(inst.base_url, STAGES_NEXT, "pi(1)", work)
    try:
        a1, a2, b1 = (uuid.uuid4().hex for _ in range(3))
        a = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        b_done: list[float] = []
        a.connect()

        def b() -> None:
            time.sleep(0.1)
            assert s.get("/stage1?work=0.05", b1)[0] == 200
            b_done.append(time.monotonic())

        th = threading.Thread(target=b)
        th.start()
        assert _keepalive_get(a, "/stage1?work=0.3", a1) == 200
        t_answer = time.monotonic()
        if follow_up == "sent":
            assert _keepalive_get(a, "/stage2?work=0.05", a2) == 200
        th.join()
        a.close()
        if follow_up == "sent":
            recs = {r.request_id: r for r in _records(inst, [a1, a2, b1])}
            assert recs[a2].begin_us < recs[b1].begin_us, "B's stage-1 request overtook A's follow-up"
        else:
            # B could only start once the 0.4 s reservation lapsed (its own run takes 0.05 s)
            assert b_done[0] - t_answer >= 0.4
        # B closes after its stage 1: its reservation ends at the close; A's only if never used
        time.sleep(0.1)
        text = _wait_idle(s)
        unused = m(text, "overtake_stage_completed_total", stage="stage2", phase="1", outcome="unused")
        assert unused == (1 if follow_up == "sent" else 2)
        # the client's round trip between its answer and the follow-up, only for the one that came
        gaps = m(text, "overtake_follow_up_gap_seconds_count", stage="stage2")
        assert gaps == (1 if follow_up == "sent" else 0)
        if follow_up == "sent":
            assert 0 < m(text, "overtake_follow_up_gap_seconds_sum", stage="stage2") < 0.4
    finally:
        s.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_shutdown_with_idle_busy_and_queued_clients_is_clean(inst: apache.ApacheInstance) -> None:
    """SIGTERM while one client idles on keep-alive, one request runs in Apache and one waits in
    its queue: exit status 0 and no traceback (each waiting handler used to print one)."""
    work = _tmpdir()
    s = SidecarProc(inst.base_url, STAGES, "pi(1,1)", work)
    try:
        idle = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
        idle.request("GET", "/stage2?work=0")
        assert idle.getresponse().read().startswith(b"ok")
        held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(2)]
        for c in held:  # the first runs in Apache (0.5 s), the second queues behind it under pi(1,1)
            c.sendall(b"GET /stage1?work=0.5 HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 5
        while m(s.metrics(), "overtake_stage_queued", stage="stage1", phase="1") != 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(15) == 0
        log = s.log.read_text()
        assert "Traceback" not in log and "CancelledError" not in log, log
        for c in held:
            c.close()
        idle.close()
    finally:
        if s.proc.poll() is None:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


def _apache_up(s: SidecarProc, want: float = 0, timeout: float = 8.0) -> float:
    """apache_up once it reads ``want``, or at the timeout (the sidecar below scrapes mod_status
    every 0.5 s; by default every 5 s)."""
    deadline = time.monotonic() + timeout
    while (v := m(s.metrics(), "apache_up")) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return v


def test_apache_killed_mid_load(apache_available: None) -> None:
    parent = _tmpdir()
    inst2 = _start_apache(parent)
    port = apache.parse_listen(inst2.listen)[1]
    s = SidecarProc(inst2.base_url, STAGES.replace("max_inflight: 4", "max_inflight: 16"), "passthrough", parent,
                    "--status-interval", "0.5")  # apache_up follows Apache within a second, not five
    try:
        assert s.get("/stage1?work=0")[0] == 200
        codes: list[int] = []
        th = [threading.Thread(target=lambda: codes.append(s.get("/stage1?work=5")[0])) for _ in range(4)]
        for t in th:
            t.start()
        time.sleep(0.5)
        assert m(s.metrics(), "overtake_inflight") == 4
        apache.stop(inst2.workdir, graceful=False)
        for t in th:
            t.join()
        assert codes == [502] * 4
        mm = _wait_idle(s)
        assert m(mm, "overtake_inflight") == 0 and _apache_up(s) == 0
        assert m(mm, "overtake_stage_completed_total", stage="stage1", phase="1", outcome="failed") == 4
        assert s.get("/stage1?work=0")[0] == 502  # Apache down: fails fast, not queued forever
        shutil.rmtree(parent / "wd" / "logs", ignore_errors=True)
        inst2 = apache.start(parent / "wd", f"127.0.0.1:{port}", cpu=_apache_core(), max_workers=32)
        assert s.get("/stage1?work=0")[0] == 200  # service resumes
        mm = _wait_idle(s)
        adm = m(mm, "overtake_stage_admitted_total", stage="stage1", phase="1")
        done = sum(m(mm, "overtake_stage_completed_total", stage="stage1", phase="1", outcome=o) for o in ("completed", "failed"))
        assert adm == done == 7 and _apache_up(s, 1) == 1
    finally:
        s.stop()
        apache.stop(inst2.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(900)  # 105,000 requests through the sidecar
@pytest.mark.slow
def test_1e5_requests_conserve_and_do_not_grow(inst: apache.ApacheInstance) -> None:
    ab = shutil.which("ab")
    if ab is None:
        pytest.skip("ab (apache2-utils) not installed")
    work = _tmpdir()
    stages = STAGES.replace("max_inflight: 4", "max_inflight: 64")
    s = SidecarProc(inst.base_url, stages, "passthrough", work)
    try:
        url = f"http://127.0.0.1:{s.port}/static/hello.txt"

        def run(n: int) -> str:
            p = subprocess.Popen([ab, "-q", "-k", "-n", str(n), "-c", "32", url], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
            _raise_autogroup(p.pid)
            out, err = p.communicate()
            assert p.returncode == 0, err
            return out

        run(5_000)  # warm-up: pools, histograms, allocator
        rss0 = _rss_kb(s.proc.pid)
        out = run(100_000)
        assert "Complete requests:      100000" in out and "Failed requests:        0" in out
        rss1 = _rss_kb(s.proc.pid)
        mm = _wait_idle(s)
        adm = m(mm, "overtake_stage_admitted_total", stage="passthrough", phase="all")
        ok = m(mm, "overtake_stage_completed_total", stage="passthrough", phase="all", outcome="completed")
        failed = m(mm, "overtake_stage_completed_total", stage="passthrough", phase="all", outcome="failed")
        assert adm == 105_000 and ok + failed == adm and failed == 0
        assert m(mm, "overtake_inflight") == 0
        assert m(mm, "overtake_stage_queued", stage="passthrough", phase="all") == 0
        assert rss1 - rss0 < 20_000, f"RSS grew {rss1 - rss0} kB over 1e5 requests"
    finally:
        s.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_learned_phases_follow_apache_cpu(inst: apache.ApacheInstance, policies: dict[str, Path]) -> None:
    """Learned mode: /stage1 always burns 50 ms (5 model units: the H2's slow phase 2), /stage2
    burns 2 ms (fast phase 1); after the first completion of each route, its requests queue in
    the phase with the highest posterior (the demand comes from Apache's X-Stage-CPU-us)."""
    work = _tmpdir()
    stages = STAGES + "classifier: {mode: learned, time_unit: 0.01}\n"
    s = SidecarProc(inst.base_url, stages, str(policies["rho06"]), work)
    try:
        for _ in range(4):
            assert s.get("/stage1?work=0.05")[0] == 200
            assert s.get("/stage2?work=0.002")[0] == 200
        mm = _wait_idle(s)
        adm = lambda st, ph: m(mm, "overtake_stage_admitted_total", stage=st, phase=ph)  # noqa: E731
        assert (adm("stage1", "1"), adm("stage1", "2")) == (1, 3)  # prior first, then learned slow
        assert (adm("stage2", "1"), adm("stage2", "2")) == (4, 0)
    finally:
        s.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_learned_keys_by_query_parameter_and_transaction_link(inst: apache.ApacheInstance,
                                                               policies: dict[str, Path]) -> None:
    """Stages as real sites have them: one path whose cost depends on a query parameter (keyed
    ``param:k``), and a stage-2 request whose cost follows the stage-1 request it completes the
    transaction of (keyed ``link``). With the default key (method and path) the two kinds share
    one history and cannot be told apart; with these keys, after each kind's first completion its
    requests queue in their own learned phase (50 ms: the H2's slow phase 2; 2 ms: phase 1), the
    follow-up predicted when its thread is reserved."""
    work = _tmpdir()
    stages = """
stages:
  - name: stage1
    routes: [{path: "^/stage1$", key: ["param:k"]}]
    next: stage2
  - name: stage2
    routes: [{path: "^/stage2$", key: [link]}]
limits: {max_inflight: 4, follow_up_timeout: 2.0}
classifier: {mode: learned, time_unit: 0.01}
"""
    s = SidecarProc(inst.base_url, stages, str(policies["rho06"]), work)
    try:
        for _ in range(4):
            for k, w1, w2 in (("big", 0.05, 0.05), ("small", 0.002, 0.002)):
                c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
                for path in (f"/stage1?k={k}&work={w1}", f"/stage2?work={w2}"):  # one connection: one transaction
                    c.request("GET", path)
                    r = c.getresponse()
                    r.read()
                    assert r.status == 200
                c.close()
        mm = _wait_idle(s)
        adm = lambda st, ph: m(mm, "overtake_stage_admitted_total", stage=st, phase=ph)  # noqa: E731
        # per kind: the first request of each learns under the prior (phase 1 here), then its own phase
        assert (adm("stage1", "1"), adm("stage1", "2")) == (5, 3)
        assert (adm("stage2", "1"), adm("stage2", "2")) == (5, 3)
    finally:
        s.stop()
        shutil.rmtree(work, ignore_errors=True)
