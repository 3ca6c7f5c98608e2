"""A normal client's latency and the sidecar's memory while the sidecar is attacked.

A real Apache (pinned to one core) behind ``overtake sidecar`` enforcing a solved π* on two
stages. One client, the normal one, GETs a 13-byte static file on a fresh connection every
20 ms for the whole run. After an idle phase, each attack runs alone for ``--seconds``, from a
separate process at nice 19 (remote attackers do not share the sidecar's core; here they must,
so they yield it), then the bench waits for the sidecar's ``overtake_inflight`` to return to 0:

=================  ==========================================================================
slowloris          300 connections send a request's header one byte a second
slow_readers       32 clients GET a 32 MB file and never read the answer
body_flood         4 streams PUT 250 MB bodies to a stage path and 4 to ``/-/policy``
pipeline_flood     4 connections pipeline 2,000 GETs each and read the answers
bypass_paths       ``//stage1``, ``/./stage1``, ``/%73tage1``, ``/x/../stage1`` with 0.3 s of
                   work, 6 at once (the policy allows fewer in stage 1)
garbage            8 connections write random bytes, then close
expect_upgrade     pipelined ``Expect: 100-continue`` and ``Upgrade: h2c`` requests
stage_tunnels      31 WebSocket handshakes for ``/stage1?work=1`` at once, each renewed when
                   answered (Apache burns the CPU and does not upgrade): the stage's policy
                   must admit them
h2c_body           4 streams of ``POST /stage2`` with an ``Upgrade: h2c`` offer and a body that
                   is itself a request for ``/stage2?work=0.5``, then a GET, on one connection
stalled_bodies     300 connections send 1 MiB - 2 of a 1 MiB body to ``/stage1``, then stall;
                   20 more trickle a body a byte a second
spool_flood        10 clients GET a 100 MiB file and never read the answer
=================  ==========================================================================

The sidecar runs with ``spool_budget_bytes`` 256 MiB, so that the spool flood meets it (the
default is 1 GiB); each phase reports the largest spool on disk seen.

Then a second pair, Apache with mod_overtake_prio's admission gate and ``overtake sidecar
--policy pi(1) --gate FILE``, with four clients looping ``/stage1`` through the sidecar (so that
requests wait in Apache's gate) besides the normal one, under the gate attacks:

=================  ==========================================================================
gate_forged        32 clients GET ``/stage1`` from Apache directly with a waiting slot's
                   ``SLOT GENERATION`` (read from the gate file, as if it had leaked), bare or
                   with a made-up MAC: each must be refused at once, none held
gate_shrink        ``truncate -s 0`` on the gate file every 0.5 s (the first one while
                   requests wait in it)
=================  ==========================================================================

Reported besides: Apache children that died (``exit signal`` in its error log) and the looping
clients' requests that were not answered 200 (both must be 0).

Then ``overtake api`` (no Apache needed) on the same core, its normal client GETting ``/healthz``
every 20 ms on a fresh connection, under the API attacks, each alone as above:

=================  ==========================================================================
json_bodies        2 streams POST 16 MB JSON documents (8 M numbers, just under the cap) to
                   ``/v1/models``, 1 posts ``[`` x 100,000 (nested too deeply)
chunked_fits       2 streams POST 100 MB chunked uploads (no Content-Length) to ``/v1/fits``
slow_work          ``load: 0.999999999``, ``max_threads: 10**9`` and an access-log fit (20,000
                   lines) with the stage regex ``^/(a+)+$`` against ``/aaa...a!`` paths, looped
=================  ==========================================================================

The bench raises its session's scheduler autogroup to -20 (as api_bench.py and apache_table2.py:
another job's autogroup at -20 on Apache's core otherwise owns the tail); the probe, the attackers
and the servers share core 0, Apache has the last core.

Reported per phase: the normal client's p50/p99 and failures, the server's RSS (idle, peak
during, after), and for the sidecar whether ``overtake_inflight`` returned to 0. Targets:
p99 <= 50 ms and peak RSS <= 2x idle under every attack.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _report import add_output_arguments, autogroup_nice, machine, publish

from overtake.controller.harness import apache
from overtake.controller.harness.loadgen import get, sidecar_admin, wait_sidecar
from overtake.controller.harness.scratch import free_port, scratch_dir

REPO = Path(__file__).resolve().parents[1]
STAGES = """stages:
  - {name: stage1, path: "^/stage1$"}
  - {name: stage2, path: "^/stage2$"}
limits: {max_inflight: 64, spool_budget_bytes: 268435456}
"""
SMALL = "/static/hello.txt"
BIG = "/static/big.bin"
HUGE = "/static/huge.bin"  # 100 MiB: the spool flood
MiB = 1 << 20


def _policy(path: Path) -> Path:
    """π* for two H2 stages (Table 1's H2 at load 0.3; a small truncation, solved in a second)."""
    from overtake.mdp import Stage, TandemModel, Truncation, solve

    p, m = np.array([0.91, 0.09]), np.array([0.55, 5.45])
    s1 = Stage("stage1", p, np.diag(-1.0 / m))
    model = TandemModel(arrival_rate=0.3, stages=(s1, Stage("stage2", s1.alpha, s1.T)))
    solve(model, truncation=Truncation(6, 3)).policy.save(path)
    return path


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _gauge(admin: int, name: str) -> float:
    text = get(admin, "/metrics", timeout=5)[1].decode()
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


def _inflight(admin: int) -> float:
    return _gauge(admin, "overtake_inflight")


# ---- attacks: each runs in its own process until ``stop`` (seconds since the epoch) -----------

def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def slowloris(port: int, stop: float) -> None:
    socks = []
    for _ in range(300):
        try:
            s = _connect(port)
            s.sendall(b"GET /static/hello.txt HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        except OSError:
            pass
    while time.time() < stop:
        for s in list(socks):
            try:
                s.sendall(b"X")
            except OSError:
                socks.remove(s)
        time.sleep(1)
    for s in socks:
        s.close()


def _unread_downloads(port: int, stop: float, path: str, clients: int) -> None:
    """``clients`` connections GET ``path`` with a 4 KiB receive buffer and never read the answer."""
    socks = []
    for _ in range(clients):
        try:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            socks.append(s)
        except OSError:
            pass
    time.sleep(max(0.0, stop - time.time()))
    for s in socks:
        s.close()


def slow_readers(port: int, stop: float) -> None:
    _unread_downloads(port, stop, BIG, 32)


def _flood_one(port: int, path: str, stop: float) -> None:
    chunk = b"\0" * MiB
    while time.time() < stop:
        try:
            with _connect(port) as s:
                s.sendall(f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {250 * MiB}\r\n\r\n".encode())
                for _ in range(250):
                    if time.time() >= stop:
                        break
                    s.sendall(chunk)
        except OSError:
            time.sleep(0.05)  # refused or cut: what a capped server does; try again


def body_flood(port: int, stop: float) -> None:
    ts = [threading.Thread(target=_flood_one, args=(port, p, stop)) for p in ["/stage1"] * 4 + ["/-/policy"] * 4]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _pipeline_one(port: int, stop: float) -> None:
    burst = f"GET {SMALL} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * 2000
    while time.time() < stop:
        try:
            with _connect(port) as s:
                s.settimeout(10)
                sender = threading.Thread(target=s.sendall, args=(burst,))
                sender.start()
                got = 0
                while got < 2000 and time.time() < stop:
                    data = s.recv(1 << 16)
                    if not data:
                        break
                    got += data.count(b"HTTP/1.1 ")
                sender.join(5)
        except OSError:
            time.sleep(0.05)


def pipeline_flood(port: int, stop: float) -> None:
    ts = [threading.Thread(target=_pipeline_one, args=(port, stop)) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def bypass_paths(port: int, stop: float) -> None:
    paths = ["//stage1", "/./stage1", "/%73tage1", "/x/../stage1", "//stage1", "/./stage1"]
    _loop(stop, [functools.partial(get, port, f"{p}?work=0.3", timeout=30) for p in paths])


def garbage(port: int, stop: float) -> None:
    rng = random.Random(19)

    def one() -> None:
        while time.time() < stop:
            try:
                with _connect(port) as s:
                    s.sendall(rng.randbytes(rng.randint(1, 65536)))
                    s.settimeout(1)
                    try:
                        s.recv(4096)
                    except OSError:
                        pass
            except OSError:
                time.sleep(0.01)

    ts = [threading.Thread(target=one) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def expect_upgrade(port: int, stop: float) -> None:
    reqs = (f"GET {SMALL} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
            "PUT /stage2?work=0.001 HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello"
            f"GET {SMALL} HTTP/1.1\r\nHost: x\r\n\r\n").encode()
    while time.time() < stop:
        try:
            with _connect(port) as s:
                s.settimeout(5)
                s.sendall(reqs)
                got = b""
                while got.count(b"HTTP/1.1 2") < 3:
                    data = s.recv(1 << 16)
                    if not data:
                        break
                    got += data
        except OSError:
            time.sleep(0.05)


def _hold_open(s: socket.socket, stop: float) -> None:
    """Read what comes until the server closes ``s`` or ``stop``."""
    s.settimeout(0.5)
    while time.time() < stop:
        try:
            if not s.recv(1 << 16):
                return
        except TimeoutError:
            continue


WS_HANDSHAKE = ("GET {} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


def stage_tunnels(port: int, stop: float) -> None:
    def one() -> None:
        with _connect(port) as s:
            s.sendall(WS_HANDSHAKE.format("/stage1?work=1").encode())
            _hold_open(s, stop)

    _loop(stop, [one] * 31)


def h2c_body(port: int, stop: float) -> None:
    smuggled = b"GET /stage2?work=0.5 HTTP/1.1\r\nHost: x\r\n\r\n"
    data = (b"POST /stage2?work=0.001 HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Length: %d\r\n\r\n" % len(smuggled)
            + smuggled + b"GET /stage2?work=0.001 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")

    def one() -> None:
        with _connect(port) as s:
            s.sendall(data)
            _hold_open(s, stop)

    _loop(stop, [one] * 4)


def stalled_bodies(port: int, stop: float) -> None:
    socks = []
    almost = b"\0" * (MiB - 2)
    for i in range(320):
        if time.time() >= stop:
            break
        try:
            s = _connect(port)
            socks.append(s)
            s.sendall(b"PUT /stage1 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % MiB)
            if i < 300:  # refused ones are cut (503 then close): that ends them
                s.settimeout(2)
                s.sendall(almost)
        except OSError:
            pass
    while time.time() < stop:
        for s in socks[300:]:  # the tricklers
            try:
                s.sendall(b"x")
            except OSError:
                pass
        time.sleep(1)
    for s in socks:
        s.close()


def spool_flood(port: int, stop: float) -> None:
    _unread_downloads(port, stop, HUGE, 10)


ATTACKS: dict[str, Callable[[int, float], None]] = {
    f.__name__: f for f in (slowloris, slow_readers, body_flood, pipeline_flood, bypass_paths, garbage, expect_upgrade,
                            stage_tunnels, h2c_body, stalled_bodies, spool_flood)
}


# ---- attacks on the API ----------------------------------------------------------------------

def _exchange(port: int, head: bytes, body: Callable[[], Any] | bytes, stop: float) -> None:
    """One request (``body`` bytes, or an iterator of already framed pieces) and its answer; the
    server may answer and close before the body is all sent (413): that ends it too."""
    with _connect(port) as s:
        s.settimeout(30)
        try:
            s.sendall(head)
            for piece in ([body] if isinstance(body, bytes) else body()):
                if time.time() >= stop:
                    return
                s.sendall(piece)
        except OSError:
            pass
        try:
            while s.recv(1 << 16):
                pass
        except OSError:
            pass


def _post_head(path: str, ctype: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n{framing}\r\nConnection: close\r\n\r\n".encode()


def _loop(stop: float, jobs: list[Callable[[], None]]) -> None:
    def one(job: Callable[[], None]) -> None:
        while time.time() < stop:
            try:
                job()
            except OSError:
                time.sleep(0.05)

    ts = [threading.Thread(target=one, args=(j,)) for j in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


_EXP = '{"name": "a", "service": {"exponential": {"mean": 1.0}}}'


def json_bodies(port: int, stop: float) -> None:
    big = (b'{"load": 0.5, "stages": [' + _EXP.encode() + b'], "pad": ['
           + b"0," * ((16_000_000 - 200) // 2) + b"0]}")
    deep = b"[" * 100_000

    def post(body: bytes) -> Callable[[], None]:
        return lambda: _exchange(port, _post_head("/v1/models", "application/json", len(body)), body, stop)

    _loop(stop, [post(big), post(big), post(deep)])


def chunked_fits(port: int, stop: float) -> None:
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    framed = chunk(b"1.0," * (MiB // 4))

    def body() -> Any:
        yield chunk(b'{"samples": [')
        for _ in range(100):
            yield framed
        yield chunk(b"1.0]}") + b"0\r\n\r\n"

    def post() -> None:
        _exchange(port, _post_head("/v1/fits", "application/json", None), body, stop)

    _loop(stop, [post, post])


def slow_work(port: int, stop: float) -> None:
    near_one = json.dumps({"load": 0.999999999, "stages": [json.loads(_EXP)]}).encode()
    threads = json.dumps({"load": 0.6, "stages": [json.loads(_EXP)], "max_threads": 10**9}).encode()
    line = '127.0.0.1 - - [26/Nov/2026:10:00:00 +0000] "GET /%s! HTTP/1.1" 200 5 1000\n' % ("a" * 40)
    fields = {"kind": "apache-log", "log_format": '%h %l %u %t "%r" %>s %b %D', "stage": "s1=^/(a+)+$"}
    boundary = "overtake-attack"
    form = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                    for k, v in fields.items())
    form += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="access.log"\r\n'
             f"Content-Type: text/plain\r\n\r\n{line * 20_000}\r\n--{boundary}--\r\n").encode()

    def post(path: str, ctype: str, body: bytes) -> Callable[[], None]:
        return lambda: _exchange(port, _post_head(path, ctype, len(body)), body, stop)

    _loop(stop, [post("/v1/models", "application/json", near_one), post("/v1/models", "application/json", threads),
                 post("/v1/fits", f"multipart/form-data; boundary={boundary}", form)])


API_ATTACKS: dict[str, Callable[[int, float], None]] = {f.__name__: f for f in (json_bodies, chunked_fits, slow_work)}


# ---- attacks on the admission gate (mod_overtake_prio's OvertakeGate) -------------------------

GATE_STAGES = """stages:
  - {name: stage1, path: "^/stage1$"}
limits: {max_inflight: 32, queue_timeout: 60}
"""


@dataclass(frozen=True)
class GateTarget:
    """What the gate attacks aim at: Apache's own port and the gate file."""

    apache_port: int
    path: str


def _waiting_slot(path: str, rng: random.Random) -> tuple[int, int]:
    """A slot of the gate file and its generation, as an attacker who can read the file sees them."""
    raw = Path(path).read_bytes()
    n = struct.unpack_from("<I", raw, 8)[0] if len(raw) >= 64 else 0
    if not n or len(raw) < 64 + 4 * n:
        return rng.randrange(64), 1
    slot = rng.randrange(n)
    return slot, struct.unpack_from("<I", raw, 64 + 4 * slot)[0] >> 2


def gate_forged(t: GateTarget, stop: float, tally: Any) -> None:
    """``tally``: [sent, refused within 1 s (400/403), anything else (held, let through, failed)]."""
    def one(i: int) -> None:
        rng = random.Random(i)
        while time.time() < stop:
            slot, gen = _waiting_slot(t.path, rng)
            value = f"{slot} {gen}" if i % 2 else f"{slot} {gen} {rng.randbytes(16).hex()}"
            t0 = time.time()
            try:
                code = get(t.apache_port, "/stage1?work=0.001", {"X-Overtake-Gate": value}, timeout=5)[0]
            except OSError:
                code = 0
            fast = code in (400, 403) and time.time() - t0 < 1.0
            with tally.get_lock():
                tally[0] += 1
                tally[1 if fast else 2] += 1

    ts = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()


def gate_shrink(t: GateTarget, stop: float, tally: Any) -> None:
    """``tally``: [truncations, 0, 0]."""
    while time.time() < stop:
        try:
            os.truncate(t.path, 0)
            with tally.get_lock():
                tally[0] += 1
        except OSError:
            pass
        time.sleep(0.5)


GATE_ATTACKS: dict[str, Callable[[GateTarget, float, Any], None]] = {
    f.__name__: f for f in (gate_forged, gate_shrink)  # in this order: the shrink ends the gate's use
}


def _gate_attacker(name: str, target: GateTarget, stop: float, tally: Any) -> None:
    os.nice(19)
    GATE_ATTACKS[name](target, stop, tally)


class StageLoad(threading.Thread):
    """``clients`` clients looping ``path`` through the sidecar; every answer but 200 is a loss."""

    def __init__(self, port: int, clients: int = 4, path: str = "/stage1?work=0.002") -> None:
        super().__init__(daemon=True)
        self.port, self.clients, self.path = port, clients, path
        self.sent = self.lost = 0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def _one(self) -> None:
        while not self.done.is_set():
            try:
                ok = get(self.port, self.path, timeout=60)[0] == 200
            except OSError:
                ok = False
            with self._lock:
                self.sent += 1
                self.lost += not ok

    def run(self) -> None:
        ts = [threading.Thread(target=self._one) for _ in range(self.clients)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()


def _gate_phase(name: str, seconds: float, port: int, pid: int, probe: Probe, target: GateTarget,
                err_log: Path, admin: int) -> dict[str, Any]:
    """One phase against the gated pair: the attack (or idle) with the stage load, then the drain."""
    crashes = err_log.read_text(errors="replace").count("exit signal")
    tally = mp.get_context("fork").Array("l", 3)
    load = StageLoad(port)
    t0 = time.time()
    load.start()
    proc = None
    if name != "idle":
        proc = mp.get_context("fork").Process(target=_gate_attacker, args=(name, target, t0 + seconds, tally),
                                              daemon=True)
        proc.start()
    peak = _rss_kb(pid)
    while time.time() < t0 + seconds:
        peak = max(peak, _rss_kb(pid))
        time.sleep(0.1)
    t1 = time.time()
    load.done.set()
    load.join(90)
    if proc is not None:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    deadline, inflight = time.time() + 30, float("nan")
    while time.time() < deadline:
        peak = max(peak, _rss_kb(pid))
        inflight = _inflight(admin)
        if inflight == 0:
            break
        time.sleep(0.5)
    return {"target": "sidecar+gate", "attack": name, **probe.window(t0, t1), "rss_peak_kb": peak,
            "rss_after_kb": _rss_kb(pid), "inflight_after": inflight, "drain_s": time.time() - t1,
            "stage_requests": load.sent, "stage_lost": load.lost, "attack_tally": list(tally),
            "apache_crashes": err_log.read_text(errors="replace").count("exit signal") - crashes}


def run_gate(names: list[str], seconds: float) -> list[dict[str, Any]]:
    """The gated pair (``overtake apache start --gate``, ``overtake sidecar --policy pi(1) --gate``):
    idle, then each gate attack in GATE_ATTACKS' order."""
    cores = sorted(os.sched_getaffinity(0))
    server_core, proxy_core = cores[-1], cores[0]
    tmp = scratch_dir("overtake-gate-attack-")
    path = f"/dev/shm/overtake-gate-attack-{os.getpid()}"
    inst = apache.start(tmp / "apache", f"127.0.0.1:{free_port()}", cpu=server_core, max_workers=64,
                        cpu_priority=apache.CpuPriority(levels=(3600.0,), nice=("idle",), age=False, gate=path))
    os.sched_setaffinity(0, {proxy_core})
    side = None
    try:
        (tmp / "stages.yaml").write_text(GATE_STAGES)
        port = free_port()
        admin, admin_flags, _ = sidecar_admin(tmp / "admin-token")
        argv = ["taskset", "-c", str(proxy_core), sys.executable, "-m", "overtake.api.cli", "sidecar",
                "--apache", inst.base_url, "--listen", f"127.0.0.1:{port}", "--stages", str(tmp / "stages.yaml"),
                "--policy", "pi(1)", "--gate", path, "--gate-slots", "16", "--status-interval", "0.2", *admin_flags]
        with (tmp / "sidecar.log").open("wb") as log:
            side = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        wait_sidecar(port, side, tmp / "sidecar.log")
        deadline = time.time() + 20
        while b"\novertake_gate_enabled 1.0" not in get(admin, "/metrics", timeout=5)[1]:
            if time.time() > deadline:
                raise RuntimeError(f"the sidecar never paired with Apache's gate: {(tmp / 'sidecar.log').read_text()[-2000:]}")
            time.sleep(0.2)
        target = GateTarget(apache.parse_listen(inst.listen)[1], path)
        err_log = Path(inst.workdir) / "logs" / "error.log"
        probe = Probe(port)
        probe.start()
        order = [n for n in GATE_ATTACKS if n in names]
        phases = [_gate_phase(n, seconds, port, side.pid, probe, target, err_log, admin)
                  for n in ["idle", *order]]
        probe.done.set()
        _judge(phases)
        for ph in phases:
            held = ph["attack"] == "gate_forged" and ph["attack_tally"][2] > 0
            ph["ok"] = bool(ph["ok"] and ph["apache_crashes"] == 0 and ph["stage_lost"] == 0 and not held)
        phases[-1]["sidecar_alive"] = side.poll() is None
        phases[-1]["ok"] = bool(phases[-1]["ok"] and phases[-1]["sidecar_alive"])
        return phases
    finally:
        if side is not None and side.poll() is None:
            side.terminate()
            side.wait(30)
        apache.stop(inst.workdir, graceful=False)
        for left in (path, path + ".key"):
            Path(left).unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.sched_setaffinity(0, set(cores))


def _attacker(name: str, port: int, stop: float) -> None:
    os.nice(19)
    (ATTACKS | API_ATTACKS)[name](port, stop)


# ---- the normal client and the sampler -------------------------------------------------------

class Probe(threading.Thread):
    """The normal client: GET ``path`` on a fresh connection every 20 ms; latencies in ms, failures."""

    def __init__(self, port: int, path: str = SMALL) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.path = path
        self.samples: list[tuple[float, float | None]] = []  # (time, ms or None on failure)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            t0 = time.perf_counter()
            try:
                code = get(self.port, self.path, timeout=10)[0]
                ms: float | None = (time.perf_counter() - t0) * 1e3 if code == 200 else None
            except OSError:
                ms = None
            self.samples.append((time.time(), ms))
            time.sleep(max(0.0, 0.02 - (time.perf_counter() - t0)))

    def window(self, t0: float, t1: float) -> dict[str, float]:
        got = [ms for t, ms in self.samples if t0 <= t < t1]
        ok = [ms for ms in got if ms is not None]
        return {"requests": len(got), "failed": len(got) - len(ok),
                "p50_ms": statistics.median(ok) if ok else float("nan"),
                "p99_ms": float(np.percentile(ok, 99)) if ok else float("nan")}


def _phase(name: str, seconds: float, port: int, pid: int, probe: Probe, sidecar: bool = True,
           admin: int = 0) -> dict[str, Any]:
    t0 = time.time()
    proc = None
    if name != "idle":
        proc = mp.get_context("fork").Process(target=_attacker, args=(name, port, t0 + seconds), daemon=True)
        proc.start()
    peak = _rss_kb(pid)
    spool, ticks = 0.0, 0
    while time.time() < t0 + seconds:
        peak = max(peak, _rss_kb(pid))
        if sidecar and ticks % 5 == 0:  # twice a second: the largest spool on disk
            spool = max(spool, _gauge(admin, "overtake_response_spool_bytes"))
        ticks += 1
        time.sleep(0.1)
    t1 = time.time()
    if proc is not None:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    # drained: every request the attack left in the sidecar ends (deadlines included) within 30 s
    deadline, inflight = time.time() + 30, (float("nan") if sidecar else None)
    while sidecar and time.time() < deadline:
        peak = max(peak, _rss_kb(pid))
        inflight = _inflight(admin)
        if inflight == 0:
            break
        time.sleep(0.5)
    if not sidecar:
        time.sleep(2)  # what the attack left running (a body being parsed) ends
        peak = max(peak, _rss_kb(pid))
    return {"target": "sidecar" if sidecar else "api", "attack": name, **probe.window(t0, t1), "rss_peak_kb": peak,
            "rss_after_kb": _rss_kb(pid), "inflight_after": inflight, "drain_s": time.time() - t1,
            "spool_peak_bytes": spool if sidecar else None}


def _judge(phases: list[dict[str, Any]]) -> None:
    """Each phase against its server's idle RSS and the targets."""
    if not phases:
        return
    idle_rss = phases[0]["rss_peak_kb"]
    for ph in phases:
        ph["rss_peak_over_idle"] = ph["rss_peak_kb"] / idle_rss
        ph["ok"] = bool(ph["p99_ms"] <= 50 and ph["rss_peak_over_idle"] <= 2
                        and (ph["target"] == "api" or ph["inflight_after"] == 0))


def run_api(names: list[str], seconds: float) -> list[dict[str, Any]]:
    """The API phases: ``overtake api`` on core 0 (with its one solver process), idle then each attack."""
    tmp = scratch_dir("overtake-api-attack-")
    port = free_port()
    argv = ["taskset", "-c", str(sorted(os.sched_getaffinity(0))[0]), sys.executable, "-m", "overtake.api.cli", "api",
            "--listen", f"127.0.0.1:{port}", "--db", str(tmp / "api.db"), "--log-level", "warning"]
    api = None
    try:
        with (tmp / "api.log").open("wb") as log:
            api = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        deadline = time.time() + 60
        while True:
            try:
                if get(port, "/healthz", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if api.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"overtake api did not start: {(tmp / 'api.log').read_text()[-2000:]}")
            time.sleep(0.2)
        probe = Probe(port, "/healthz")
        probe.start()
        phases = [_phase(n, seconds, port, api.pid, probe, sidecar=False) for n in ["idle", *names]]
        probe.done.set()
        _judge(phases)
        return phases
    finally:
        if api is not None and api.poll() is None:
            api.terminate()
            api.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    chosen = args.attacks.split(",") if args.attacks else [*ATTACKS, *API_ATTACKS, *GATE_ATTACKS]
    side_names = [n for n in chosen if n in ATTACKS]
    api_names = [n for n in chosen if n in API_ATTACKS]
    gate_names = [n for n in chosen if n in GATE_ATTACKS]
    phases = run_sidecar(side_names, args.seconds) if side_names else []
    if gate_names:
        phases += run_gate(gate_names, args.seconds)
    if api_names:
        phases += run_api(api_names, args.seconds)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "seconds": args.seconds, "phases": phases, "autogroup_nice": autogroup_nice(),
            "load_average": os.getloadavg()[0], "all_ok": all(p["ok"] for p in phases)}


def run_sidecar(names: list[str], seconds: float) -> list[dict[str, Any]]:
    cores = sorted(os.sched_getaffinity(0))
    server_core, proxy_core = cores[-1], cores[0]
    tmp = scratch_dir("overtake-attack-")
    inst = apache.start(tmp / "apache", f"127.0.0.1:{free_port()}", cpu=server_core, max_workers=64)
    os.sched_setaffinity(0, {proxy_core})  # the probe and the attackers too: Apache's core is Apache's
    side = None
    try:
        big = tmp / "apache" / "htdocs" / "static" / "big.bin"
        big.write_bytes(os.urandom(32 * MiB))
        big.chmod(0o644)
        if "spool_flood" in names:
            huge = tmp / "apache" / "htdocs" / "static" / "huge.bin"
            with huge.open("wb") as f:
                for _ in range(100):
                    f.write(os.urandom(MiB))
            huge.chmod(0o644)
        (tmp / "stages.yaml").write_text(STAGES)
        port = free_port()
        admin, admin_flags, _ = sidecar_admin(tmp / "admin-token")
        argv = ["taskset", "-c", str(proxy_core), sys.executable, "-m", "overtake.api.cli", "sidecar",
                "--apache", inst.base_url, "--listen", f"127.0.0.1:{port}", "--stages", str(tmp / "stages.yaml"),
                "--policy", str(_policy(tmp / "pi.npz")), *admin_flags]
        with (tmp / "sidecar.log").open("wb") as log:
            side = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        wait_sidecar(port, side, tmp / "sidecar.log")
        probe = Probe(port)
        probe.start()
        phases = [_phase(n, seconds, port, side.pid, probe, admin=admin) for n in ["idle", *names]]
        probe.done.set()
        _judge(phases)
        return phases
    finally:
        if side is not None and side.poll() is None:
            side.terminate()
            side.wait(30)
        apache.stop(inst.workdir, graceful=False)
        shutil.rmtree(tmp, ignore_errors=True)
        os.sched_setaffinity(0, set(cores))  # a caller (the CI test's pytest) gets its cores back


def section(res: dict[str, Any], command: str) -> str:
    rows = [f"| {p['target']}: {p['attack']} | {p['requests']} | {p['failed']} | {p['p50_ms']:.1f} | "
            f"{p['p99_ms']:.1f} | {p['rss_peak_kb'] / 1024:.0f} ({p['rss_peak_over_idle']:.2f}×) | "
            f"{'–' if p['target'] == 'api' else format(p['inflight_after'], '.0f')} | "
            f"{'yes' if p['ok'] else '**no**'} |" for p in res["phases"]]
    return "\n".join([
        "## sidecar-attack: a normal client while the sidecar or the API is attacked",
        f"`{command}`, {res['date']}, {res['machine']}, autogroup {res['autogroup_nice']}. A real Apache (one core) behind the "
        "sidecar enforcing π*, its normal "
        "client GETting a 13-byte file every 20 ms on a fresh connection; then `overtake api`, its normal client "
        f"GETting `/healthz` likewise. Each attack runs alone from a nice-19 process for {res['seconds']:g} s "
        "(the script's docstring lists them); RSS is the server's, peak over its idle phase. Raw runs: "
        "`bench/results/sidecar_attack.jsonl`. "
        f"Conclusion: {'every target met' if res['all_ok'] else 'NOT all targets met (rows marked no)'}.",
        "| server: attack | normal requests | failed | p50 ms | p99 ms | peak RSS MB | inflight after | "
        "p99 ≤ 50 ms, RSS ≤ 2× |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        *rows,
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each attack phase")
    ap.add_argument("--attacks", default="",
                    help=f"comma-separated subset of: {', '.join([*ATTACKS, *API_ATTACKS, *GATE_ATTACKS])} "
                    f"({', '.join(API_ATTACKS)}: the API; {', '.join(GATE_ATTACKS)}: Apache's admission gate)")
    add_output_arguments(ap)
    args = ap.parse_args()
    bad = set(filter(None, args.attacks.split(","))) - set(ATTACKS) - set(API_ATTACKS) - set(GATE_ATTACKS)
    if bad:
        ap.error(f"--attacks: unknown {', '.join(sorted(bad))}; choose from "
                 f"{', '.join([*ATTACKS, *API_ATTACKS, *GATE_ATTACKS])}")
    try:  # as bench/api_bench.py and apache_table2.py: other jobs' autogroups (at -20) would own the cores' tails
        Path("/proc/self/autogroup").write_text("-20")
    except OSError:
        pass
    res = run(args)
    command = f"python bench/sidecar_attack.py --seconds {args.seconds:g}" + (f" --attacks {args.attacks}" if args.attacks else "")
    publish(args, "sidecar-attack", section(res, command), res, command=command)
    return 0 if res["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
