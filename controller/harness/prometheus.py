"""A private Prometheus server (Debian ``prometheus``) scraping the sidecar and the API on loopback.

:func:`start` writes ``WORKDIR/prometheus.yml`` with one scrape job per kind of target —
``overtake-sidecar`` (the sidecar's admin listener, path ``/metrics``: its ``overtake_*`` series
and Apache's ``apache_*`` series, which the sidecar exports from mod_status under apache_exporter's
names) and ``overtake-api`` (path ``/metrics``) — and runs ``prometheus`` in its own session with its TSDB in
``WORKDIR/data``; :func:`stop` ends it. :meth:`PrometheusInstance.query` asks the HTTP API
(``/api/v1/query``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overtake.controller.errors import ControllerError

__all__ = [
    "BINARY",
    "PrometheusError",
    "PrometheusInstance",
    "PrometheusNotInstalledError",
    "PrometheusUsageError",
    "render_config",
    "start",
    "stop",
]

BINARY = "prometheus"
# Popen objects of the servers this process started: kept so they are reaped on stop, not
# garbage-collected while running
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class PrometheusError(ControllerError, RuntimeError):
    """The private Prometheus could not be started, queried or stopped."""


class PrometheusNotInstalledError(PrometheusError):
    """The Debian package ``prometheus`` is missing (apache-conf/install-debian-packages.sh)."""


class PrometheusUsageError(ControllerError, ValueError):
    """A target or address is malformed; the message names it."""


def _check_addr(what: str, addr: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PrometheusUsageError(f"{what} must be HOST:PORT, got {addr!r}")
    return addr


def render_config(*, sidecars: Sequence[str] = (), apis: Sequence[str] = (), interval: float = 1.0) -> str:
    """``prometheus.yml`` scraping the given loopback targets every ``interval`` seconds."""
    if not sidecars and not apis:
        raise PrometheusUsageError("give at least one target (--sidecar or --api)")
    if not 0.1 <= interval <= 300:
        raise PrometheusUsageError(f"--interval must be in 0.1..300 seconds, got {interval}")
    iv = f"{int(round(interval * 1000))}ms"
    jobs = []
    for name, path, targets in (("overtake-sidecar", "/metrics", sidecars), ("overtake-api", "/metrics", apis)):
        if targets:
            tl = ", ".join(json.dumps(_check_addr(name, t)) for t in targets)
            jobs.append(f"  - job_name: {name}\n    metrics_path: {path}\n    static_configs:\n      - targets: [{tl}]\n")
    return (f"# written by overtake (overtake.controller.harness.prometheus)\nglobal:\n  scrape_interval: {iv}\n"
            f"  evaluation_interval: {iv}\nscrape_configs:\n" + "".join(jobs))


@dataclass(frozen=True)
class PrometheusInstance:
    """A running private Prometheus."""

    workdir: Path
    listen: str
    pid: int

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    def query(self, expr: str, *, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Instant query; the ``data.result`` vector (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        q = urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=timeout) as r:
                doc = json.loads(r.read())
        except (urllib.error.URLError, OSError) as exc:
            raise PrometheusError(f"query {expr!r} failed: {exc}") from None
        if doc.get("status") != "success":
            raise PrometheusError(f"query {expr!r}: {doc.get('error', doc)}")
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def wait_for(self, expr: str, *, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll ``expr`` until it returns a non-empty vector."""
        deadline = time.monotonic() + timeout
        while True:
            res = self.query(expr)
            if res:
                return res
            if time.monotonic() > deadline:
                raise PrometheusError(f"no series for {expr!r} after {timeout} s")
            time.sleep(0.25)


def _pidfile(workdir: Path) -> Path:
    return workdir / "prometheus.pid"


def start(workdir: str | os.PathLike[str], listen: str, *, sidecars: Sequence[str] = (), apis: Sequence[str] = (),
          interval: float = 1.0, timeout: float = 30.0) -> PrometheusInstance:
    """Write the config, start ``prometheus`` in the background and wait until it is ready."""
    binary = shutil.which(BINARY)
    if binary is None:
        raise PrometheusNotInstalledError("prometheus is not installed: run apache-conf/install-debian-packages.sh "
                                          "as root (Debian package prometheus)")
    _check_addr("--listen", listen)
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    cfg = wd / "prometheus.yml"
    cfg.write_text(render_config(sidecars=sidecars, apis=apis, interval=interval))
    log = (wd / "prometheus.log").open("wb")
    with log:
        proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={wd / 'data'}", f"--web.listen-address={listen}",
             "--storage.tsdb.retention.time=1d", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    _CHILDREN[proc.pid] = proc
    _pidfile(wd).write_text(f"{proc.pid}\n")
    inst = PrometheusInstance(wd, listen, proc.pid)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{inst.url}/-/ready", timeout=1.0) as r:
                if r.status == 200:
                    return inst
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(wd)
            tail = (wd / "prometheus.log").read_text(errors="replace")[-2000:]
            raise PrometheusError(f"prometheus did not become ready on {listen} (exit {proc.poll()}):\n{tail}")
        time.sleep(0.1)


def stop(workdir: str | os.PathLike[str], *, timeout: float = 15.0) -> bool:
    """SIGTERM the instance of ``workdir`` and wait; False when none was running."""
    wd = Path(workdir)
    try:
        pid = int(_pidfile(wd).read_text().strip())
    except (FileNotFoundError, ValueError):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        _pidfile(wd).unlink(missing_ok=True)
        return False
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    else:  # started by another process (`overtake prometheus start`): poll for it
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
    _pidfile(wd).unlink(missing_ok=True)
    return True
