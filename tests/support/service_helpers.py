"""Shared by test_sidecar_control.py and test_sidecar_service.py: a stub upstream and the sidecar
as a subprocess (so its memory can be measured and it can be signalled like a service).

The stub upstream is a real HTTP server on a loopback socket (stdlib ThreadingHTTPServer). It
counts the paths it was asked for, answers ``/server-status?auto`` like mod_status (or 404, as
an Apache without mod_status does), sleeps on ``/slow/SECONDS`` and echoes the request headers
as JSON otherwise. A small ``.npz`` policy solved for its two stages is made on demand.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from overtake.controller.harness.loadgen import request
from overtake.controller.harness.scratch import free_port

REPO = Path(__file__).resolve().parents[2]

STAGES = """
stages: [{name: stage1, path: "^/slow/"}, {name: stage2, path: "^/stage2"}]
limits: {max_inflight: 8, queue_cap: 200, queue_timeout: 30, response_buffer_bytes: 65536}
"""

MOD_STATUS = (b"127.0.0.1\nServerVersion: Apache/2.4.99 (Debian)\nServerMPM: event\nTotal Accesses: 7\n"
              b"Total kBytes: 3\nUptime: 12\nBusyWorkers: 1\nIdleWorkers: 31\nScoreboard: W_______\n")


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 (keep-alive) and no request log on stderr: the base of the tests' stub servers."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass


class StubApache:
    """A loopback HTTP server standing in for Apache; ``hits`` counts paths (without query),
    ``bodies`` the bodies received per path and ``fields`` each request's header lines, in order."""

    def __init__(self, *, mod_status: bool = True) -> None:
        self.mod_status = mod_status
        self.hits: collections.Counter[str] = collections.Counter()
        self.headers: list[dict[str, str]] = []
        self.bodies: collections.defaultdict[str, list[bytes]] = collections.defaultdict(list)
        self.fields: collections.defaultdict[str, list[list[tuple[str, str]]]] = collections.defaultdict(list)
        stub = self

        class Handler(QuietHandler):
            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                path = self.path.split("?", 1)[0]
                stub.hits[path] += 1
                stub.bodies[path].append(body)
                stub.fields[path].append(list(self.headers.items()))
                stub.headers.append({k.lower(): v for k, v in self.headers.items()})
                if path == "/server-status":
                    if stub.mod_status:
                        self._send(200, MOD_STATUS, "text/plain; charset=ISO-8859-1")
                    else:
                        self._send(404, b"<h1>Not Found</h1>\n", "text/html")
                    return
                if path.startswith("/slow/"):
                    time.sleep(float(path.rsplit("/", 1)[1]))
                out = json.dumps({"path": self.path, "headers": [[k, v] for k, v in self.headers.items()]})
                self._send(200, out.encode(), "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_HEAD = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *a: None  # type: ignore[method-assign]  # clients cut by tests
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._th = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._th.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of ``pid`` in kB: now (VmRSS) or its peak so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


#: the admin token SidecarProc gives its sidecars (``--admin-token-file``) and sends with PUTs
ADMIN_TOKEN = "test-admin-token-0123"


def admin_token_file(workdir: Path) -> Path:
    """A file holding :data:`ADMIN_TOKEN` (mode 0600) in ``workdir``."""
    path = workdir / "admin-token"
    if not path.exists():
        path.write_text(ADMIN_TOKEN + "\n")
        path.chmod(0o600)
    return path


def is_admin_path(path: str) -> bool:
    """Paths served on the admin listener only (health checks are answered on both)."""
    return path.startswith(("/-/", "/metrics")) and not path.startswith(("/-/healthz", "/-/livez"))


class SidecarProc:
    """``python -m overtake.api.cli sidecar ARGS``: ``--listen``, ``--stages``, ``--admin-listen``
    (a free port, :attr:`admin_port`) and ``--admin-token-file`` (:data:`ADMIN_TOKEN`) are added
    unless ``argv`` is given (then pass ``admin_port``). :meth:`request` sends admin paths to the
    admin listener and a ``PUT /-/policy`` with the token, unless told otherwise."""

    def __init__(self, workdir: Path, args: list[str], *, stages: str = STAGES, ready_port: int | None = None,
                 argv: list[str] | None = None, env: dict[str, str] | None = None,
                 admin_port: int | None = None) -> None:
        self.port = free_port()
        self.admin_port = admin_port or free_port()
        self.workdir = workdir
        self.log = workdir / f"sidecar-{self.port}.log"
        if argv is None:
            st = workdir / f"stages-{self.port}.yaml"
            st.write_text(stages)
            if "--admin-listen" in args:
                self.admin_port = int(args[args.index("--admin-listen") + 1].rsplit(":", 1)[1])
            argv = [sys.executable, "-m", "overtake.api.cli", "sidecar", "--listen", f"127.0.0.1:{self.port}",
                    "--stages", str(st), "--loop", "asyncio", "--admin-listen", f"127.0.0.1:{self.admin_port}",
                    "--admin-token-file", str(admin_token_file(workdir)), *args]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)
        self.ready_port = ready_port or self.port
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.request("GET", "/-/livez", port=self.ready_port, timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sidecar did not start: {self.log.read_text()}")
            time.sleep(0.1)

    def request(self, method: str, path: str, *, body: bytes | None = None, headers: dict[str, str] | None = None,
                port: int | None = None, timeout: float = 30, source: str | None = None,
                token: str | None = ADMIN_TOKEN) -> tuple[int, dict[str, str], bytes]:
        """One request; ``port`` None: the admin listener for admin paths, else the public one.
        A ``PUT`` to an admin path carries ``token`` (None: no Authorization header)."""
        if port is None:
            port = self.admin_port if is_admin_path(path) else self.port
        if method == "PUT" and is_admin_path(path) and token is not None:
            headers = {"Authorization": f"Bearer {token}", **(headers or {})}
        return request(method, port, path, body=body, headers=headers, timeout=timeout, source=source)

    def rss_kb(self, field: str = "VmRSS") -> int:
        return rss_kb(self.proc.pid, field)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self) -> Iterator[dict[str, Any]]:
        for line in self.text().splitlines():
            try:
                yield json.loads(line)
            except ValueError:
                continue

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


def small_policy(path: Path) -> Path:
    """pi* for two H2 stages named stage1, stage2 (small truncation: solved in a second)."""
    import numpy as np

    from overtake.mdp import Stage, TandemModel, Truncation, solve

    p, m = np.array([0.91, 0.09]), np.array([0.55, 5.45])
    s1 = Stage("stage1", p, np.diag(-1.0 / m))
    s2 = Stage("stage2", s1.alpha, s1.T)
    opt = solve(TandemModel(arrival_rate=0.3, stages=(s1, s2)), truncation=Truncation(6, 3))
    opt.policy.save(path)
    return path


def inflating_archive(member_bytes: int, names: tuple[str, ...] = ("keys.npy", "spawn.npy", "meta.npy")) -> bytes:
    """A small .npz whose members each declare and hold ``member_bytes`` of zeros (deflate
    packs them about 1000:1): three of 127 MiB make a 400 KB upload that inflates to 381 MiB."""
    import io
    import zipfile

    import numpy as np

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in names:
            dtype = "|u1" if name == "meta.npy" else "<i8"
            item = np.dtype(dtype).itemsize
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(head, {"descr": dtype, "fortran_order": False,
                                                        "shape": (member_bytes // item,)})
            with z.open(name, "w") as f:
                f.write(head.getvalue())
                left, zero = member_bytes // item * item, bytes(4 << 20)
                while left:
                    f.write(zero[:min(left, len(zero))])
                    left -= min(left, len(zero))
    return buf.getvalue()


def sidecar_in_thread(stages: Path, **options: Any) -> Iterator[tuple[int, Any]]:
    """An in-process :class:`~overtake.controller.sidecar.service.Sidecar` on its own event-loop thread,
    listening on a free loopback port; yields (port, sidecar), then closes it. ``options`` are
    the config file's keys (``policy``, ``apache``, ...: :meth:`SidecarOptions.from_flat`)."""
    import asyncio

    from overtake.controller.sidecar.options import SidecarOptions
    from overtake.controller.sidecar.service import Sidecar
    from overtake.controller.sidecar.stages import load_stages

    port = free_port()
    options.setdefault("admin_listen", f"127.0.0.1:{free_port()}")
    options.setdefault("admin_token", ADMIN_TOKEN)
    opts = SidecarOptions.from_flat(listen=f"127.0.0.1:{port}", **options)
    loop = asyncio.new_event_loop()
    box: dict[str, Sidecar] = {}
    ready = threading.Event()

    async def run() -> None:
        side = Sidecar(load_stages(stages), opts)
        box["side"] = side
        await side.start()
        ready.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass
        finally:
            await side.close()

    th = threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True)
    th.start()
    assert ready.wait(30), "the sidecar did not start"
    try:
        yield port, box["side"]
    finally:
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        th.join(10)
        loop.close()


def replay_h2_transactions(send: Any, n: int = 150, *, seed: int = 11, unit: float = 0.005,
                           load: float = 0.6) -> tuple[Any, Any, list[int]]:
    """Open-loop Poisson transactions of two stages with Table 1 case 4's H2 demands (phase 1
    w.p. 0.91, mean 0.55 units; phase 2 mean 5.45; ``unit`` seconds of CPU per model unit) at
    ``load`` on one core: ``send(path, headers)`` sends one stage request
    (``/stageK?work=SECONDS`` with ``X-Overtake-Phase``) and returns its status. Returns the
    demands (n x 2, seconds), the phases (n x 2, True = the long phase 2) and the statuses."""
    import numpy as np

    rng = np.random.default_rng(seed)
    probs, means = np.array([0.91, 0.09]), np.array([0.55, 5.45])
    lam = load / (2 * float(probs @ means)) / unit  # transactions per second
    gaps = rng.exponential(1 / lam, n)
    phases = rng.random((n, 2)) < probs[1]
    demands = rng.exponential(np.where(phases, means[1], means[0])) * unit
    codes: list[int] = []

    def transaction(i: int) -> None:
        for s in (0, 1):
            codes.append(send(f"/stage{s + 1}?work={demands[i, s]:.6f}",
                              {"X-Overtake-Phase": str(int(phases[i, s]) + 1)}))

    threads = []
    t0 = time.monotonic()
    for i in range(n):
        time.sleep(max(0.0, t0 + gaps[: i + 1].sum() - time.monotonic()))
        th = threading.Thread(target=transaction, args=(i,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join(60)
    return demands, phases, codes
