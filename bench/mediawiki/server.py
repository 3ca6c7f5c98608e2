"""A private Apache serving the bench's MediaWiki, in one of two PHP stacks, on one core.

* ``prefork``: mpm_prefork + mod_php (Debian's default PHP stack): PHP runs in Apache's children.
* ``fpm``: mpm_event + mod_proxy_fcgi to a private php-fpm master with its own pool (Debian's
  default pool settings unless ``fpm_pool`` overrides them): PHP runs in php-fpm's workers.

Both from :file:`httpd.conf.in` beside this file (Debian's MPM defaults), in a work directory of
their own; nothing touches ``/etc/apache2`` or a system service. Apache and php-fpm are pinned
to ``core`` with ``taskset`` and their scheduler autogroups raised to nice -20, as the harness's
Apache (:mod:`overtake.controller.harness.apache.lifecycle`), so other jobs on the machine do not
share the core. Optional: mod_overtake_prio (``cpu_priority``, built with the harness's
:func:`~overtake.controller.harness.apache.cpu_priority.build_module`) and mod_qos per-stage caps
(``qos_cap``).
"""

from __future__ import annotations

import dataclasses
import errno
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from overtake.controller.harness.apache import CpuPriority, fetch_prio_status
from overtake.controller.harness.apache.config import DEFAULT_CONF_DIR, MODULES_DIR
from overtake.controller.harness.apache.cpu_priority import build_module, config_tokens
from overtake.controller.harness.apache.lifecycle import children, pid_alive
from overtake.controller.harness.apache.lifecycle import stop as stop_apache
from overtake.controller.harness.apache.mod_status import http_get

from .wiki import MEDIAWIKI

__all__ = ["FPM_DEFAULTS", "STACKS", "Server", "ServerError", "php_class_settings", "php_prio_settings", "raise_autogroup", "read_access",
           "start", "stop"]

STACKS = ("prefork", "fpm")
TEMPLATE = Path(__file__).with_name("httpd.conf.in")
APACHE = "/usr/sbin/apache2"
PHP_FPM = "/usr/sbin/php-fpm8.2"
#: Debian 12's pool defaults (/etc/php/8.2/fpm/pool.d/www.conf)
FPM_DEFAULTS = {"pm": "dynamic", "pm.max_children": "5", "pm.start_servers": "2",
                "pm.min_spare_servers": "1", "pm.max_spare_servers": "3"}
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}


class ServerError(RuntimeError):
    """Apache or php-fpm did not start; the message quotes their logs."""


@dataclass
class Server:
    """A running private Apache (and php-fpm for the ``fpm`` stack)."""

    workdir: Path
    php: str
    port: int
    core: int
    apache_pid: int
    fpm: subprocess.Popen[bytes] | None = None
    cpu_priority: CpuPriority | None = None
    qos_cap: int | None = None
    autogroup_nice: int | None = None
    defines: tuple[str, ...] = field(default=())

    def pids(self) -> list[int]:
        """Every process of the stack now: Apache's parent and children, php-fpm's."""
        out = [self.apache_pid, *children(self.apache_pid)]
        if self.fpm is not None:
            out += [self.fpm.pid, *children(self.fpm.pid)]
        return out


def raise_autogroup(pids: list[int], nice: int = -20) -> int | None:
    """Write ``nice`` to each process's scheduler autogroup; None where not permitted."""
    done = None
    for pid in pids:
        try:
            Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")
            done = nice
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EACCES, errno.ENOENT, errno.ESRCH):
                return None
            raise
    return done


def render(workdir: Path, *, port: int, data_dir: Path, cpu_priority: CpuPriority | None,
           qos_cap: int | None) -> str:
    tokens = {"WORKDIR": str(workdir), "LISTEN": f"127.0.0.1:{port}", "MODULES_DIR": MODULES_DIR,
              "MEDIAWIKI": str(MEDIAWIKI), "DATA": str(data_dir), "FPM_SOCKET": str(workdir / "run" / "fpm.sock"),
              "QOS_CAP": str(qos_cap or 1), **config_tokens(cpu_priority)}
    text = TEMPLATE.read_text()
    for k, v in tokens.items():
        text = text.replace(f"@{k}@", v)
    left = re.findall(r"@[A-Z_]+@", text)
    if left:
        raise ServerError(f"{TEMPLATE}: unknown tokens {sorted(set(left))}")
    return text


def _fpm_conf(workdir: Path, pool: dict[str, str]) -> str:
    lines = ["[global]", f"pid = {workdir}/run/php-fpm.pid", f"error_log = {workdir}/logs/php-fpm.log",
             "daemonize = no", "", "[www]", "user = www-data", "group = www-data",
             f"listen = {workdir}/run/fpm.sock", "listen.owner = www-data", "listen.group = www-data"]
    lines += [f"{k} = {v}" for k, v in {**FPM_DEFAULTS, **pool}.items()]
    return "\n".join(lines) + "\n"


def _tail(path: Path, n: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-n:]) or "(empty)"
    except OSError:
        return f"(no {path.name})"


def php_prio_settings(extension: Path, threshold_s: float, stats_file: Path) -> dict[str, str]:
    """php.ini settings loading the overtake_prio extension into the pool: workers demote
    themselves to SCHED_IDLE after ``threshold_s`` of CPU (as the module does in Apache's threads),
    POST/PUT/PATCH/DELETE exempt (MediaWiki's writers hold SQLite's lock)."""
    if threshold_s <= 0:
        raise ValueError(f"threshold_s: CPU seconds before demotion, > 0, got {threshold_s}")
    return {"extension": str(extension), "overtake_prio.threshold_ms": str(max(1, round(threshold_s * 1000))),
            "overtake_prio.idle": "1", "overtake_prio.stats_file": str(stats_file)}


def php_class_settings(extension: Path, stats_file: Path, nice: int = 19) -> dict[str, str]:
    """php.ini settings loading the overtake_prio extension for the sidecar's size class: a request
    marked ``X-Overtake-Class: 1`` starts at nice ``nice`` (bounded, not SCHED_IDLE), no CPU
    threshold; POST/PUT/PATCH/DELETE and the sidecar's exempt requests are never lowered."""
    if not 1 <= nice <= 19:
        raise ValueError(f"nice: the low level, 1..19, got {nice}")
    return {"extension": str(extension), "overtake_prio.threshold_ms": "0", "overtake_prio.class_header": "1",
            "overtake_prio.nice": str(nice), "overtake_prio.idle": "0", "overtake_prio.stats_file": str(stats_file)}


def _start_fpm(workdir: Path, core: int, pool: dict[str, str], php_ini: dict[str, str]) -> subprocess.Popen[bytes]:
    conf = workdir / "php-fpm.conf"
    conf.write_text(_fpm_conf(workdir, pool))
    test = subprocess.run([PHP_FPM, "--fpm-config", str(conf), "-t"], capture_output=True, text=True, env=_ENV)
    if test.returncode != 0:
        raise ServerError(f"php-fpm: config test of {conf} failed: {(test.stderr + test.stdout).strip()}")
    with (workdir / "logs" / "php-fpm.out").open("wb") as out:
        # own session: its own scheduler autogroup, raised like Apache's
        ini = [a for k, v in php_ini.items() for a in ("-d", f"{k}={v}")]
        proc = subprocess.Popen(["taskset", "-c", str(core), PHP_FPM, "--fpm-config", str(conf), "--nodaemonize", *ini],
                                stdout=out, stderr=subprocess.STDOUT, env=_ENV, start_new_session=True)
    sock = workdir / "run" / "fpm.sock"
    deadline = time.monotonic() + 15
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _end(proc)
            raise ServerError(f"php-fpm: no socket {sock}; log: {_tail(workdir / 'logs' / 'php-fpm.log')}")
        time.sleep(0.02)
    return proc


def _end(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGQUIT)  # php-fpm: graceful stop
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_pid(workdir: Path) -> int | None:
    try:
        return int((workdir / "run" / "httpd.pid").read_text())
    except (OSError, ValueError):
        return None


def _wait_ready(workdir: Path, port: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        pid = _read_pid(workdir)
        if pid is not None and not pid_alive(pid):
            raise ServerError(f"apache: exited during start-up; error log: {_tail(workdir / 'logs' / 'error.log')}")
        if pid is not None:
            try:
                code, _, body = http_get("127.0.0.1", port, "/server-status?auto", 2.0)
                if code == 200 and "ServerMPM" in body:
                    return pid
                last = f"/server-status answered {code}"
            except OSError as exc:
                last = str(exc)
        time.sleep(0.05)
    raise ServerError(f"apache: not ready within {timeout} s ({last}); error log: {_tail(workdir / 'logs' / 'error.log')}")


def start(workdir: Path, *, php: str, port: int, core: int, data_dir: Path, cpu_priority: CpuPriority | None = None,
          qos_cap: int | None = None, fpm_pool: dict[str, str] | None = None,
          php_ini: dict[str, str] | None = None, request_times: bool = False) -> Server:
    """Render, test and start the stack; return once Apache answers (and php-fpm listens).
    ``php_ini``: ``-d`` settings of php-fpm's workers (the ``fpm`` stack only); ``request_times``:
    mod_overtake_prio's request-time split in the access log (the module loaded as a meter alone,
    priority off, when ``cpu_priority`` is None)."""
    if php not in STACKS:
        raise ValueError(f"php: one of {', '.join(STACKS)}, got {php!r}")
    if qos_cap is not None and qos_cap < 1:
        raise ValueError(f"qos_cap: requests per stage, >= 1, got {qos_cap}")
    workdir = workdir.resolve()
    for sub in ("", "logs", "run"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
        (workdir / sub).chmod(0o755)
    if cpu_priority is not None and request_times:
        cpu_priority = dataclasses.replace(cpu_priority, request_times=True)
    if cpu_priority is not None or request_times:
        build_module(DEFAULT_CONF_DIR, workdir)
    defines: tuple[str, ...] = ("PREFORK",) if php == "prefork" else ("EVENT",)
    defines += ("OVERTAKE_CPU_PRIO",) * (cpu_priority is not None) + ("QOS",) * (qos_cap is not None)
    defines += ("OVERTAKE_TIMES",) * (request_times and cpu_priority is None)
    conf = workdir / "httpd.conf"
    conf.write_text(render(workdir, port=port, data_dir=data_dir, cpu_priority=cpu_priority, qos_cap=qos_cap))
    dargs = [a for d in defines for a in ("-D", d)]
    test = subprocess.run([APACHE, "-t", "-f", str(conf), *dargs], capture_output=True, text=True, env=_ENV)
    if test.returncode != 0:
        raise ServerError(f"apache: config test of {conf} failed: {(test.stderr + test.stdout).strip()}")
    if php_ini and php != "fpm":
        raise ValueError("php_ini: settings of php-fpm's workers, for php='fpm' only")
    fpm = _start_fpm(workdir, core, fpm_pool or {}, php_ini or {}) if php == "fpm" else None
    try:
        launch = subprocess.run(["taskset", "-c", str(core), APACHE, "-f", str(conf), *dargs, "-k", "start"],
                                capture_output=True, text=True, env=_ENV)
        if launch.returncode != 0:
            raise ServerError(f"apache: start failed (rc {launch.returncode}): {(launch.stderr + launch.stdout).strip()}")
        pid = _wait_ready(workdir, port)
    except BaseException:
        if _read_pid(workdir) is not None:
            stop_apache(workdir, graceful=False)
        if fpm is not None:
            _end(fpm)
        raise
    srv = Server(workdir=workdir, php=php, port=port, core=core, apache_pid=pid, fpm=fpm, cpu_priority=cpu_priority,
                 qos_cap=qos_cap, defines=defines)
    srv.autogroup_nice = raise_autogroup(srv.pids())
    if cpu_priority is not None:
        st = fetch_prio_status("127.0.0.1", port)
        if not st.enabled:
            stop(srv)
            raise ServerError(f"mod_overtake_prio disabled itself (RLIMIT_NICE {st.rlimit_nice}): start as root")
    return srv


def stop(srv: Server) -> None:
    """Stop Apache (at once: the bench has finished its requests) and php-fpm."""
    try:
        stop_apache(srv.workdir, graceful=False)
    finally:
        if srv.fpm is not None:
            _end(srv.fpm)


@dataclass(frozen=True)
class AccessLine:
    """One line of the private Apache's access log (its ``realapp`` format)."""

    begin_us: int
    method: str
    path: str
    status: int
    duration_us: int
    pid: int
    rid: str | None
    #: mod_overtake_prio's split of the handler's time (µs): wall, CPU, run-queue wait, blocked;
    #: None without ``OvertakeRequestTimes``
    times: tuple[int, int, int, int] | None = None


def _times(kv: dict[str, str]) -> tuple[int, int, int, int] | None:
    try:
        w, c, q, b = (int(kv[k]) for k in ("owall", "ocpu", "owait", "oblocked"))
    except (KeyError, ValueError):  # "-": no note (meter off, or the request's end ran elsewhere)
        return None
    return w, c, q, b


def read_access(workdir: Path) -> list[AccessLine]:
    """The access log's lines, in completion order (an unfinished last line left out)."""
    try:
        text = (workdir / "logs" / "access.log").read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n")[:-1]:
        try:
            _, begin, rest = line.split(" ", 2)
            req, tail = rest[1:].split('" ', 1)
            method, target = req.split(" ")[:2]
            f = tail.split()
            kv = dict(x.split("=", 1) for x in f[2:])
            out.append(AccessLine(int(begin), method, target.split("?", 1)[0], int(f[0]), int(kv["D"]),
                                  int(kv["pid"]), None if kv.get("rid", "-") == "-" else kv["rid"], _times(kv)))
        except (ValueError, KeyError, IndexError):
            raise ServerError(f"access log: {workdir}/logs/access.log: unexpected line {line[:200]!r}") from None
    return out
