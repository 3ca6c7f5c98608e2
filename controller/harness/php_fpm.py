"""A private PHP-FPM pool with the overtake_prio extension, and a FastCGI client to talk to it.

For tests and benches: :func:`build_extension` compiles ``apache-conf/php_overtake_prio`` with
``phpize`` (package ``php8.2-dev``); :func:`start_pool` runs Debian's ``php-fpm8.2`` from a config
of its own (a TCP listener on loopback, ``pm = static``, workers as ``www-data``, no system
php.ini); :func:`fastcgi_get` sends one request the way Apache's ``mod_proxy_fcgi`` would.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from overtake.controller.errors import PhpNotInstalledError
from overtake.controller.harness.apache.config import DEFAULT_CONF_DIR, MODULES_DIR
from overtake.controller.harness.scratch import free_port

__all__ = ["FpmPool", "PhpNotInstalledError", "build_extension", "fastcgi_get", "fpm_status", "php_available",
           "process_nice", "proxy_conf", "start_pool"]

EXTENSION_DIR = DEFAULT_CONF_DIR / "php_overtake_prio"
EXTENSION_SOURCES = ("config.m4", "overtake_prio.c", "op_restorer.c", "op_restorer.h")
PHP_FPM = "php-fpm8.2"


def php_available() -> str | None:
    """None when PHP-FPM and phpize are installed, else what is missing."""
    missing = [p for p, exe in (("php8.2-fpm", PHP_FPM), ("php8.2-dev", "phpize")) if shutil.which(exe) is None]
    return None if not missing else "not installed: " + " ".join(missing)


def build_extension(workdir: Path) -> Path:
    """Compile the extension in ``workdir/build`` and return the path of ``overtake_prio.so``."""
    why = php_available()
    if why is not None:
        raise PhpNotInstalledError(why)
    build = workdir / "build"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    for name in EXTENSION_SOURCES:
        shutil.copy(EXTENSION_DIR / name, build / name)
    for cmd in (["phpize"], ["./configure", "-q"], ["make", "-s"]):
        run = subprocess.run(cmd, cwd=build, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"building overtake_prio: {' '.join(cmd)} failed:\n{run.stdout}{run.stderr}")
    return build / "modules" / "overtake_prio.so"


@dataclass
class FpmPool:
    """A running private pool: its FastCGI address, document root and process."""

    proc: subprocess.Popen[bytes]
    port: int
    docroot: Path
    log: Path
    workdir: Path
    children: int
    settings: dict[str, str] = field(default_factory=dict)

    def worker_pids(self) -> list[int]:
        """The pool's worker processes: the master's children titled ``php-fpm: pool ...`` (the
        extension's restorer, forked before PHP-FPM sets titles, keeps the command line)."""
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        out = []
        try:
            for pid in kids.read_text().split():
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"php-fpm: pool"):
                    out.append(int(pid))
        except OSError:
            pass
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_pool(workdir: Path, extension: Path | None, settings: Mapping[str, str], *, children: int = 1,
               user: str = "www-data", scripts: Mapping[str, str] | None = None,
               cpu: int | None = None, autogroup_nice: int | None = None,
               pool: Mapping[str, str] | None = None) -> FpmPool:
    """Start ``php-fpm8.2`` in the foreground with ``children`` static workers running as ``user``.

    ``settings`` are ``-d`` php.ini settings (``overtake_prio.threshold_ms`` ...); ``scripts``
    are written into the document root; ``cpu`` pins the pool to one core; ``autogroup_nice``
    ranks the pool's scheduler autogroup against other load (-20 as the harness's Apache for
    measurements; root only, else ignored): with autogroups, a worker's nice ranks it only
    among the pool's own workers. ``pool`` adds lines to the pool's section (e.g.
    ``pm.status_path``).
    """
    why = php_available()
    if why is not None:
        raise PhpNotInstalledError(why)
    workdir.mkdir(parents=True, exist_ok=True)
    docroot = workdir / "htdocs"
    docroot.mkdir(exist_ok=True)
    for name, text in (scripts or {}).items():
        (docroot / name).write_text(text)
    port = free_port()
    log = workdir / "php-fpm.log"
    conf = _write_conf(workdir, log, port, user, children, pool or {})
    cmd = _command(conf, extension, settings, cpu)
    env = {**os.environ, "PHP_INI_SCAN_DIR": ""}  # no distribution .ini files beyond the -d settings
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    fpm = FpmPool(proc, port, docroot, log, workdir, children, dict(settings))
    _wait_ready(fpm, time.monotonic() + 20)
    if autogroup_nice is not None:
        with contextlib.suppress(OSError):  # not root, or autogroups off: the pool runs as it is
            Path(f"/proc/{proc.pid}/autogroup").write_text(f"{autogroup_nice}\n")
    return fpm


def _write_conf(workdir: Path, log: Path, port: int, user: str, children: int, pool: Mapping[str, str]) -> Path:
    """The pool's php-fpm.conf: one static pool of ``children`` workers on ``port``."""
    conf = workdir / "php-fpm.conf"
    conf.write_text(f"""[global]
error_log = {log}
daemonize = no
pid = {workdir / "php-fpm.pid"}

[overtake]
user = {user}
group = {user}
listen = 127.0.0.1:{port}
pm = static
pm.max_children = {children}
catch_workers_output = yes
""" + "".join(f"{k} = {v}\n" for k, v in pool.items()))
    return conf


def _command(conf: Path, extension: Path | None, settings: Mapping[str, str], cpu: int | None) -> list[str]:
    """php-fpm in the foreground, without the distribution's php.ini, with ``settings`` as ``-d``."""
    cmd = [PHP_FPM, "-n", "-y", str(conf), "-F"]
    if extension is not None:
        cmd += ["-d", f"extension={extension}"]
    for k, v in settings.items():
        cmd += ["-d", f"{k}={v}"]
    return ["taskset", "-c", str(cpu), *cmd] if cpu is not None else cmd


def _wait_ready(fpm: FpmPool, deadline: float) -> None:
    """Until the pool accepts connections and all its workers are up; stop it and say why if it
    exits or does not listen by ``deadline``."""
    while True:
        try:
            with socket.create_connection(("127.0.0.1", fpm.port), timeout=1):
                break
        except OSError:
            if fpm.proc.poll() is not None or time.monotonic() > deadline:
                fpm.stop()
                text = fpm.log.read_text() if fpm.log.exists() else ""
                raise RuntimeError(f"php-fpm did not start (rc {fpm.proc.returncode}): {text}") from None
            time.sleep(0.05)
    while len(fpm.worker_pids()) < fpm.children and time.monotonic() < deadline:
        time.sleep(0.05)


def proxy_conf(pool: FpmPool, regex: str = r"^(/.*\.php)$") -> str:
    """Apache directives that send the URL paths matching ``regex`` (its group 1: the script's
    path under the pool's document root) to ``pool`` through mod_proxy_fcgi, as Debian's
    mpm_event + PHP-FPM setup does (``ProxyPassMatch``)."""
    return (f"LoadModule proxy_module {MODULES_DIR}/mod_proxy.so\n"
            f"LoadModule proxy_fcgi_module {MODULES_DIR}/mod_proxy_fcgi.so\n"
            f'ProxyPassMatch "{regex}" "fcgi://127.0.0.1:{pool.port}{pool.docroot}$1"\n')


def fpm_status(pool: FpmPool, path: str = "fpm-status") -> dict[str, str]:
    """PHP-FPM's status page (the pool's ``pm.status_path`` = ``/`` + ``path``) as a dict:
    ``accepted conn``, ``listen queue``, ``max listen queue``, ``active processes``, ``max
    active processes``... (the listen queue is sampled by the master about once a second)."""
    status, body = fastcgi_get(pool, path)
    if status != 200:
        raise RuntimeError(f"php-fpm status /{path}: {status} {body[:200]!r}; set pm.status_path = /{path}")
    out = {}
    for line in body.decode().splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


# ---- FastCGI (the FastCGI Specification 1.0, as mod_proxy_fcgi speaks it) -------------------

_BEGIN, _END, _PARAMS, _STDIN, _STDOUT, _STDERR = 1, 3, 4, 5, 6, 7
_RESPONDER = 1


def _record(kind: int, body: bytes, rid: int = 1) -> bytes:
    pad = -len(body) % 8
    return struct.pack("!BBHHBx", 1, kind, rid, len(body), pad) + body + b"\0" * pad


def _pair(name: bytes, value: bytes) -> bytes:
    def size(n: int) -> bytes:
        return struct.pack("!B", n) if n < 128 else struct.pack("!I", n | 0x80000000)
    return size(len(name)) + size(len(value)) + name + value


def fastcgi_get(pool: FpmPool, script: str, query: str = "", *, method: str = "GET", body: bytes = b"",
                headers: Mapping[str, str] | None = None, params: Mapping[str, str] | None = None,
                timeout: float = 30) -> tuple[int, bytes]:
    """Run ``script`` (a file in the pool's document root) and return (HTTP status, response body);
    ``headers`` reach PHP as ``HTTP_*`` variables, as mod_proxy_fcgi passes them; ``params`` are
    further FastCGI parameters as they are (the request's environment, e.g. ``OVERTAKE_STAGE``)."""
    params = {
        "SCRIPT_FILENAME": str(pool.docroot / script), "SCRIPT_NAME": "/" + script, "REQUEST_METHOD": method,
        "QUERY_STRING": query, "REQUEST_URI": "/" + script + ("?" + query if query else ""),
        "SERVER_PROTOCOL": "HTTP/1.1", "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_NAME": "localhost",
        "SERVER_PORT": "80", "REMOTE_ADDR": "127.0.0.1", "CONTENT_LENGTH": str(len(body)),
        "CONTENT_TYPE": "application/x-www-form-urlencoded",
        **{"HTTP_" + k.upper().replace("-", "_"): v for k, v in (headers or {}).items()},
        **(params or {}),
    }
    blob = b"".join(_pair(k.encode(), v.encode()) for k, v in params.items())
    out = _record(_BEGIN, struct.pack("!HB5x", _RESPONDER, 0)) + _record(_PARAMS, blob) + _record(_PARAMS, b"")
    if body:
        out += _record(_STDIN, body)
    out += _record(_STDIN, b"")
    stdout = b""
    with socket.create_connection(("127.0.0.1", pool.port), timeout=timeout) as s:
        s.sendall(out)
        buf = b""
        while True:
            while len(buf) >= 8:
                _, kind, _, n, pad = struct.unpack("!BBHHBx", buf[:8])
                if len(buf) < 8 + n + pad:
                    break
                content, buf = buf[8:8 + n], buf[8 + n + pad:]
                if kind == _STDOUT:
                    stdout += content
                elif kind == _END:
                    return _split(stdout)
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("php-fpm closed the connection before the end of the request")
            buf += chunk


def _split(stdout: bytes) -> tuple[int, bytes]:
    head, _, body = stdout.partition(b"\r\n\r\n")
    status = 200
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"status:"):
            status = int(line.split()[1])
    return status, body


def process_nice(pid: int) -> int:
    """A process's nice value (field 19 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])

