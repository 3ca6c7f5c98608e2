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
    """A loopback HTTP server standing in for Apache; ``hits`` counts paths (without query)."""

    def __init__(self, *, mod_status: bool = True) -> None:
        self.mod_status = mod_status
        self.hits: collections.Counter[str] = collections.Counter()
        self.headers: list[dict[str, str]] = []
        stub = self

        class Handler(QuietHandler):
            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                path = self.path.split("?", 1)[0]
                stub.hits[path] += 1
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


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


class SidecarProc:
    """``python -m overtake.api.cli sidecar ARGS`` (``--listen`` and ``--stages`` added unless given)."""

    def __init__(self, workdir: Path, args: list[str], *, stages: str = STAGES, ready_port: int | None = None,
                 argv: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.log = workdir / f"sidecar-{self.port}.log"
        if argv is None:
            st = workdir / f"stages-{self.port}.yaml"
            st.write_text(stages)
            argv = [sys.executable, "-m", "overtake.api.cli", "sidecar", "--listen", f"127.0.0.1:{self.port}",
                    "--stages", str(st), "--loop", "asyncio", *args]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)
        self.ready_port = ready_port or self.port
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.request("GET", "/-/healthz", port=self.ready_port, timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sidecar did not start: {self.log.read_text()}")
            time.sleep(0.1)

    def request(self, method: str, path: str, *, body: bytes | None = None, headers: dict[str, str] | None = None,
                port: int | None = None, timeout: float = 30, source: str | None = None) -> tuple[int, dict[str, str], bytes]:
        return request(method, port or self.port, path, body=body, headers=headers, timeout=timeout, source=source)

    def rss_kb(self) -> int:
        return rss_kb(self.proc.pid)

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


def sidecar_in_thread(stages: Path, **options: Any) -> Iterator[tuple[int, Any]]:
    """An in-process :class:`~overtake.controller.sidecar.Sidecar` on its own event-loop thread,
    listening on a free loopback port; yields (port, sidecar), then closes it. ``options`` are
    :class:`~overtake.controller.sidecar.SidecarOptions` fields (``policy``, ``apache``, ...)."""
    import asyncio

    from overtake.controller.sidecar import Sidecar, SidecarOptions
    from overtake.controller.stages import load_stages

    port = free_port()
    opts = SidecarOptions(listen=f"127.0.0.1:{port}", **options)
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
