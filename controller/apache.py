"""Launcher for a private Apache httpd built from Debian's ``apache2`` package.

The instance lives entirely in one work directory and never touches ``/etc/apache2`` or a
system service::

    WORKDIR/httpd.conf        rendered from apache-conf/httpd.conf.in (render_config)
    WORKDIR/instance.json     listen address, cpu, max_workers of the running instance
    WORKDIR/logs/access.log   one line per request, format LOG_FORMAT (read_access_log)
    WORKDIR/logs/error.log
    WORKDIR/run/httpd.pid     PID of Apache's root parent (removed by Apache on exit)
    WORKDIR/lua/stage.lua     stage handler, served at /stage<N>?work=<seconds of CPU>
    WORKDIR/luac/tcpu.so      thread CPU clock for Lua, compiled from apache-conf/lua/tcpu.c
    WORKDIR/htdocs/static/    tiny static files for overhead benchmarks

It serves mod_status at ``/server-status`` (ExtendedStatus on, local clients only) and the
CPU-burning stage handler at ``/stage1``, ``/stage2``, ...: ``GET /stage1?work=0.05`` burns
0.05 s of the worker *thread's* CPU time (``CLOCK_THREAD_CPUTIME_ID``; Lua's ``os.clock()``
is process-wide and wrong under mpm_event) and logs the CPU actually used as ``cpu_us``.

The templates are ``apache-conf/``, installed with the package as :mod:`overtake.apache_conf`
(a wheel carries them, so this works outside the checkout); pass ``conf_dir=`` to use another copy.

For clean processor sharing (PS) between concurrent requests, :func:`start` can pin Apache
to one core (``taskset``) and raise the priority of its scheduler autogroup (write -20 to
``/proc/<pid>/autogroup``; ``nice`` alone does nothing across autogroups). See
``shared/notes/apache_and_net.md`` sections 1-3.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from overtake.controller.errors import (
    ApacheError,
    ApacheInputError,
    ApacheNotInstalledError,
    ApacheNotRunningError,
    ApacheStartError,
    ApacheStopTimeoutError,
    PortInUseError,
)

__all__ = [
    "DEFAULT_CONF_DIR",
    "LOG_FORMAT",
    "SCOREBOARD_STATES",
    "AccessRecord",
    "ApacheInstance",
    "fetch_status",
    "parse_listen",
    "parse_status",
    "read_access_log",
    "render_config",
    "scoreboard_counts",
    "start",
    "status",
    "stop",
]

APACHE_BIN = "/usr/sbin/apache2"
MODULES_DIR = "/usr/lib/apache2/modules"
LUA_INCLUDE_DIR = "/usr/include/lua5.3"
MIME_TYPES = "/etc/mime.types"
#: The templates of ``apache-conf/``, installed as package data (:mod:`overtake.apache_conf`).
DEFAULT_CONF_DIR = Path(str(resources.files("overtake.apache_conf")))

#: Access-log format. ``D`` = microseconds from reading the request line to logging (sojourn
#: in Apache); ``cpu_us`` = thread CPU burnt by the stage handler (``-`` for other URLs);
#: ``begin`` = request start, microseconds since the epoch; ``rid`` = X-Request-Id header.
LOG_FORMAT = (
    '%h %{begin:usec}t "%r" %>s %b D=%D msT=%{ms}T usT=%{us}T '
    "stage=%{stage}n cpu_us=%{stage_cpu_us}n tid=%{tid}P rid=%{X-Request-Id}i"
)

#: mod_status scoreboard characters, named as apache_exporter's ``state`` label.
SCOREBOARD_STATES: dict[str, str] = {
    "_": "idle",
    "S": "startup",
    "R": "read",
    "W": "reply",
    "K": "keepalive",
    "D": "dns",
    "C": "closing",
    "L": "logging",
    "G": "graceful_stop",
    "I": "idle_cleanup",
    ".": "open_slot",
}

_INSTALL_HINT = (
    "install it with `make demo` (runs apache-conf/install-debian-packages.sh) "
    "or `apt-get install apache2 liblua5.3-dev gcc`"
)
# Apache needs no environment; a clean one keeps /etc/apache2/envvars conventions out.
_APACHE_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}
_TOKEN = re.compile(r"@([A-Z_]+)@")
_MAX_WORKERS_LIMIT = 20000  # Apache's hard ThreadLimit ceiling for mpm_event


# --------------------------------------------------------------------------- addresses


def parse_listen(listen: str) -> tuple[str, int]:
    """Split a ``HOST:PORT`` listen address.

    Parameters
    ----------
    listen : str
        ``127.0.0.1:8081``, ``0.0.0.0:8081`` or ``[::1]:8081``.

    Returns
    -------
    tuple of (str, int)
        Host (IPv6 without brackets) and port.

    Raises
    ------
    ApacheInputError
        If the text is not ``HOST:PORT`` with an IP literal and a port in 1..65535.
    """
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([0-9.]+):(\d+)", listen.strip())
    if m is None:
        raise ApacheInputError(
            f"listen: expected IP:PORT such as 127.0.0.1:8081 or [::1]:8081, got {listen!r}"
        )
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    family = socket.AF_INET6 if m.group(1) else socket.AF_INET
    try:
        socket.inet_pton(family, host)
    except OSError:
        raise ApacheInputError(f"listen: {host!r} is not an IP address (in {listen!r})") from None
    if not 1 <= port <= 65535:
        raise ApacheInputError(f"listen: port must be in 1..65535, got {port}")
    return host, port


def _format_listen(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect_host(host: str) -> str:
    # A wildcard listener is reached through loopback.
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Apache sets SO_REUSEADDR too: TIME_WAIT leftovers must not count as "in use".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"listen: port {port} on {host} is already in use; choose another port "
                    f"or stop the process bound to it (`ss -ltnp 'sport = :{port}'`)"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ApacheInputError(
                    f"listen: {host} is not an address of this machine; use 127.0.0.1"
                ) from None
            if exc.errno == errno.EACCES:
                raise ApacheInputError(
                    f"listen: port {port} needs root (ports < 1024); use a port >= 1024"
                ) from None
            raise


# --------------------------------------------------------------------------- config


def _conf_dir(conf_dir: str | os.PathLike[str] | None) -> Path:
    d = Path(conf_dir) if conf_dir is not None else DEFAULT_CONF_DIR
    if not (d / "httpd.conf.in").is_file():
        raise ApacheInputError(
            f"conf_dir: {d} has no httpd.conf.in; reinstall overtake-server (its wheel carries "
            "apache-conf/) or pass conf_dir= pointing at a copy of apache-conf/"
        )
    return d


def _check_max_workers(max_workers: int) -> None:
    if isinstance(max_workers, bool) or not isinstance(max_workers, int):
        raise ApacheInputError(f"max_workers: must be an integer, got {max_workers!r}")
    if not 1 <= max_workers <= _MAX_WORKERS_LIMIT:
        raise ApacheInputError(
            f"max_workers: must be in 1..{_MAX_WORKERS_LIMIT} (policy's max threads plus "
            f"margin), got {max_workers}"
        )


def render_config(
    workdir: str | os.PathLike[str],
    *,
    listen: str,
    max_workers: int,
    run_user: str = "www-data",
    run_group: str = "www-data",
    graceful_timeout: int = 5,
    conf_dir: str | os.PathLike[str] | None = None,
) -> str:
    """Render ``httpd.conf`` for a private instance in ``workdir``.

    Parameters
    ----------
    workdir : path
        Instance directory; made absolute (Apache resolves a relative ``-f`` against
        ``/etc/apache2``).
    listen : str
        ``IP:PORT`` to listen on.
    max_workers : int
        ``MaxRequestWorkers`` = ``ThreadsPerChild`` of the single mpm_event child: the
        policy's maximum number of threads plus a margin.
    run_user, run_group : str
        Account of the worker child when started as root (Apache refuses root).
    graceful_timeout : int
        ``GracefulShutdownTimeout`` in seconds: how long :func:`stop` lets in-flight
        requests finish.
    conf_dir : path, optional
        Directory holding ``httpd.conf.in``; default :data:`DEFAULT_CONF_DIR`.

    Returns
    -------
    str
        The configuration text.
    """
    _check_max_workers(max_workers)
    host, port = parse_listen(listen)
    if graceful_timeout < 0:
        raise ApacheInputError(f"graceful_timeout: must be >= 0 s, got {graceful_timeout}")
    template = (_conf_dir(conf_dir) / "httpd.conf.in").read_text()
    values = {
        "APACHE_DIR": str(Path(workdir).resolve()),
        "LISTEN": _format_listen(host, port),
        "SERVER_NAME": _connect_host(host) if ":" not in host else "localhost",
        "RUN_USER": run_user,
        "RUN_GROUP": run_group,
        "MODULES_DIR": MODULES_DIR,
        "MAX_WORKERS": str(max_workers),
        "MAX_SPARE_THREADS": str(2 * max_workers),
        "GRACEFUL_TIMEOUT": str(int(graceful_timeout)),
        "MIME_TYPES": MIME_TYPES,
        # Inside a quoted Apache directive argument, quotes are backslash-escaped.
        "LOG_FORMAT": LOG_FORMAT.replace("\\", "\\\\").replace('"', '\\"'),
    }

    def substitute(m: re.Match[str]) -> str:
        try:
            return values[m.group(1)]
        except KeyError:
            raise ApacheInputError(
                f"conf_dir: httpd.conf.in uses unknown token @{m.group(1)}@; "
                f"known: {', '.join(sorted(values))}"
            ) from None

    return _TOKEN.sub(substitute, template)


# --------------------------------------------------------------------------- prerequisites


def _check_installed() -> None:
    if not os.access(APACHE_BIN, os.X_OK):
        raise ApacheNotInstalledError(f"apache2: {APACHE_BIN} not found; {_INSTALL_HINT}")
    for mod in ("mod_mpm_event.so", "mod_lua.so", "mod_status.so"):
        if not os.path.exists(os.path.join(MODULES_DIR, mod)):
            raise ApacheNotInstalledError(
                f"apache2: {MODULES_DIR}/{mod} not found (package apache2-bin); {_INSTALL_HINT}"
            )
    if shutil.which("gcc") is None:
        raise ApacheNotInstalledError(
            f"gcc: not found (needed to build the thread CPU clock module); {_INSTALL_HINT}"
        )
    if not os.path.exists(os.path.join(LUA_INCLUDE_DIR, "lua.h")):
        raise ApacheNotInstalledError(
            f"liblua5.3-dev: {LUA_INCLUDE_DIR}/lua.h not found; {_INSTALL_HINT}"
        )


def _searchable_by(path: Path, uid: int, gids: set[int]) -> Path | None:
    """Return the first ancestor of ``path`` that ``uid`` cannot traverse, else None."""
    for d in [*reversed(path.parents), path]:
        st = os.stat(d)
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid in gids:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return d
    return None


def _check_run_user(workdir: Path, run_user: str) -> None:
    if os.geteuid() != 0:
        return  # Apache ignores User/Group and runs workers as us.
    try:
        pw = pwd.getpwnam(run_user)
    except KeyError:
        raise ApacheInputError(
            f"run_user: no account {run_user!r} (Apache's workers cannot run as root); "
            "create it or pass another run_user"
        ) from None
    gids = set(os.getgrouplist(run_user, pw.pw_gid))
    blocked = _searchable_by(workdir, pw.pw_uid, gids)
    if blocked is not None:
        raise ApacheInputError(
            f"workdir: {workdir} is not reachable by the worker user {run_user!r}: "
            f"{blocked} has mode {stat.S_IMODE(os.stat(blocked).st_mode):04o}; it must read "
            f"WORKDIR/lua at request time. Use a workdir under a world-searchable directory "
            f"(e.g. /tmp/overtake-apache) or `chmod o+x {blocked}`"
        )


def _compile_tcpu(conf: Path, luac_dir: Path) -> Path:
    src = conf / "lua" / "tcpu.c"
    out = luac_dir / "tcpu.so"
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    tmp = luac_dir / f".tcpu.{os.getpid()}.so"
    cmd = ["gcc", "-O2", "-Wall", "-shared", "-fPIC", f"-I{LUA_INCLUDE_DIR}", "-o", str(tmp), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ApacheNotInstalledError(
            f"tcpu: compiling {src} failed (rc {proc.returncode}): {proc.stderr.strip()}; "
            f"check gcc and liblua5.3-dev: {_INSTALL_HINT}"
        )
    tmp.chmod(0o755)
    os.replace(tmp, out)  # atomic: a running Apache never sees a half-written module
    return out


def _install_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` into ``dst`` with world-readable modes (workers run as www-data)."""
    dst.mkdir(parents=True, exist_ok=True)
    dst.chmod(0o755)
    for item in src.iterdir():
        target = dst / item.name
        if item.is_dir():
            _install_tree(item, target)
        else:
            shutil.copyfile(item, target)
            target.chmod(0o644)


# --------------------------------------------------------------------------- processes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; only its parent's wait() is missing
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _is_apache(pid: int) -> bool:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return os.path.basename(argv0.decode(errors="replace")) in ("apache2", "httpd")


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return sorted(kids)


def _read_pid(workdir: Path) -> int | None:
    try:
        return int((workdir / "run" / "httpd.pid").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _raise_autogroup(pids: list[int], nice: int) -> int | None:
    """Write ``nice`` to /proc/<pid>/autogroup; None if not permitted or not supported."""
    done = None
    for pid in pids:
        try:
            Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")
            done = nice
        except (PermissionError, FileNotFoundError):
            return None
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EACCES, errno.ESRCH):
                return None
            raise
    return done


def _error_log_tail(workdir: Path, n: int = 8) -> str:
    try:
        lines = (workdir / "logs" / "error.log").read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no error.log)"
    return " | ".join(lines[-n:]) or "(error.log empty)"


# --------------------------------------------------------------------------- HTTP helpers


def _http_get(host: str, port: int, path: str, timeout: float) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection(_connect_host(host), port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", errors="replace")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def parse_status(text: str) -> dict[str, int | float | str]:
    """Parse mod_status ``/server-status?auto`` output.

    Parameters
    ----------
    text : str
        Body of ``?auto``: a first line with the server name, then ``Key: value`` lines.

    Returns
    -------
    dict
        ``{"ServerName": ..., "Total Accesses": 319, "Load1": 7.48, "Scoreboard": "__W_", ...}``;
        values are int, float or str as they parse. ``Total Duration`` is the sum of
        per-request milliseconds; ``BusyWorkers`` the number of requests in Apache.
    """
    out: dict[str, int | float | str] = {}
    for i, line in enumerate(text.splitlines()):
        key, sep, value = line.partition(":")
        if not sep:
            if i == 0 and line.strip():
                out["ServerName"] = line.strip()
            continue
        value = value.strip()
        parsed: int | float | str
        if key == "Scoreboard":
            parsed = value  # "...." or "_" must not be read as numbers
        elif re.fullmatch(r"[+-]?\d+", value):
            parsed = int(value)
        elif re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+)([eE][+-]?\d+)?|[+-]?\d+[eE][+-]?\d+", value):
            parsed = float(value)
        else:
            parsed = value
        out[key.strip()] = parsed
    return out


def scoreboard_counts(scoreboard: str) -> dict[str, int]:
    """Count scoreboard slots per state (apache_exporter's ``state`` names).

    Parameters
    ----------
    scoreboard : str
        The ``Scoreboard`` value of :func:`parse_status`.

    Returns
    -------
    dict of str to int
        Every state of :data:`SCOREBOARD_STATES`, zero included.
    """
    counts = dict.fromkeys(SCOREBOARD_STATES.values(), 0)
    for ch in scoreboard:
        if ch in SCOREBOARD_STATES:
            counts[SCOREBOARD_STATES[ch]] += 1
    return counts


def fetch_status(listen: str, *, timeout: float = 2.0) -> dict[str, int | float | str]:
    """GET ``/server-status?auto`` from an Apache at ``listen`` and parse it.

    Parameters
    ----------
    listen : str
        ``IP:PORT`` the Apache listens on.
    timeout : float
        Socket timeout in seconds.

    Returns
    -------
    dict
        See :func:`parse_status`.

    Raises
    ------
    ApacheNotRunningError
        If nothing answers or the answer is not mod_status.
    """
    host, port = parse_listen(listen)
    try:
        code, _, body = _http_get(host, port, "/server-status?auto", timeout)
    except OSError as exc:
        raise ApacheNotRunningError(
            f"listen: no Apache answers at {listen} ({exc}); start it with "
            "`overtake apache start --workdir DIR --listen ...`"
        ) from None
    if code != 200 or "ServerMPM" not in body:
        raise ApacheNotRunningError(
            f"listen: {listen}/server-status?auto answered {code} without mod_status fields; "
            "is that an instance started by `overtake apache start`?"
        )
    return parse_status(body)


# --------------------------------------------------------------------------- instance


@dataclass(frozen=True)
class ApacheInstance:
    """A running private Apache, as recorded in ``WORKDIR/instance.json``.

    Attributes
    ----------
    workdir : str
        Absolute instance directory.
    listen : str
        ``IP:PORT`` it listens on.
    pid : int
        PID of the root parent process.
    child_pids : tuple of int
        Worker child processes at start (one for the config used).
    cpu : int or None
        Core Apache is pinned to, or None.
    max_workers : int
        ``MaxRequestWorkers``.
    autogroup_nice : int or None
        Nice value written to the autogroup, or None when not raised (not requested, not
        root, or kernel without autogroups).
    """

    workdir: str
    listen: str
    pid: int
    child_pids: tuple[int, ...]
    cpu: int | None
    max_workers: int
    autogroup_nice: int | None

    @property
    def base_url(self) -> str:
        """``http://host:port`` for clients."""
        host, port = parse_listen(self.listen)
        return f"http://{_format_listen(_connect_host(host), port)}"

    @property
    def access_log(self) -> Path:
        """Path of the access log (format :data:`LOG_FORMAT`)."""
        return Path(self.workdir) / "logs" / "access.log"

    @property
    def error_log(self) -> Path:
        """Path of the error log."""
        return Path(self.workdir) / "logs" / "error.log"


def _existing_workdir(workdir: str | os.PathLike[str]) -> Path:
    path = Path(workdir).resolve()
    if not path.is_dir():
        raise ApacheInputError(
            f"workdir: {path} does not exist or is not a directory; was "
            f"`overtake apache start --workdir {workdir}` run?"
        )
    return path


def _load_instance(workdir: Path) -> ApacheInstance:
    try:
        data = json.loads((workdir / "instance.json").read_text())
        data["child_pids"] = tuple(data["child_pids"])
        return ApacheInstance(**data)
    except FileNotFoundError:
        raise ApacheNotRunningError(
            f"workdir: {workdir} has no instance.json; start Apache with "
            f"`overtake apache start --workdir {workdir} --listen 127.0.0.1:PORT`"
        ) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ApacheError(f"workdir: {workdir}/instance.json is corrupt ({exc}); stop and restart") from None


def start(
    workdir: str | os.PathLike[str],
    listen: str,
    *,
    cpu: int | None = None,
    max_workers: int = 64,
    raise_priority: bool = True,
    run_user: str = "www-data",
    run_group: str = "www-data",
    graceful_timeout: int = 5,
    ready_timeout: float = 15.0,
    conf_dir: str | os.PathLike[str] | None = None,
) -> ApacheInstance:
    """Render, test and start a private Apache; return once it serves requests.

    Steps: check the Debian packages; validate the arguments and that the port is free;
    create ``workdir`` (and parents) if needed; copy the stage handler and static files;
    compile ``tcpu.so``; ``apache2 -t``; ``[taskset -c CPU] apache2 -f ABS -k start``; wait
    until ``/server-status?auto`` and ``/stage1?work=0`` answer 200; raise the autogroup
    priority of the parent and its children.

    Parameters
    ----------
    workdir : path
        Instance directory (see the module docstring). When started as root, every ancestor
        must be searchable by ``run_user``.
    listen : str
        ``IP:PORT``, e.g. ``127.0.0.1:8081``.
    cpu : int, optional
        Pin Apache (all processes and threads) to this core with ``taskset``.
    max_workers : int
        ``MaxRequestWorkers``: the policy's maximum threads plus a margin.
    raise_priority : bool
        Write -20 to ``/proc/<pid>/autogroup`` of the parent and children (needs root;
        silently skipped otherwise, see :attr:`ApacheInstance.autogroup_nice`). Without it a
        loaded machine inflates PS sojourn times 1.3-2.7x.
    run_user, run_group : str
        Worker account when started as root.
    graceful_timeout : int
        Seconds in-flight requests get on :func:`stop`.
    ready_timeout : float
        Seconds to wait for readiness.
    conf_dir : path, optional
        Template directory; default :data:`DEFAULT_CONF_DIR`.

    Returns
    -------
    ApacheInstance
        PIDs, address and settings of the running instance.

    Raises
    ------
    ApacheNotInstalledError
        apache2, mod_lua, gcc or liblua5.3-dev missing.
    ApacheInputError
        Bad ``listen``, ``cpu``, ``max_workers``, ``run_user`` or unreachable ``workdir``;
        :class:`PortInUseError` if the port is taken; an instance already runs in ``workdir``.
    ApacheStartError
        The config test, the launch or the readiness wait failed (message quotes the error log).
    """
    _check_installed()
    host, port = parse_listen(listen)
    listen = _format_listen(host, port)
    _check_max_workers(max_workers)
    if cpu is not None:
        allowed = sorted(os.sched_getaffinity(0))
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu not in allowed:
            raise ApacheInputError(f"cpu: core {cpu!r} is not available; usable cores: {allowed}")
        if shutil.which("taskset") is None:
            raise ApacheNotInstalledError("taskset: not found (package util-linux); needed for cpu=")
    conf = _conf_dir(conf_dir)
    wd = Path(workdir).resolve()
    if wd.exists() and not wd.is_dir():
        raise ApacheInputError(f"workdir: {wd} exists and is not a directory")
    old_pid = _read_pid(wd) if wd.is_dir() else None
    if old_pid is not None and _pid_alive(old_pid) and _is_apache(old_pid):
        raise ApacheInputError(
            f"workdir: an Apache (pid {old_pid}) already runs in {wd}; "
            f"stop it first with `overtake apache stop --workdir {wd}`"
        )
    _check_port_free(host, port)

    wd.mkdir(parents=True, exist_ok=True)
    wd.chmod(0o755)
    _check_run_user(wd, run_user)  # run_group is checked by `apache2 -t`
    for sub in ("logs", "run", "luac"):
        (wd / sub).mkdir(exist_ok=True)
        (wd / sub).chmod(0o755)
    (wd / "run" / "httpd.pid").unlink(missing_ok=True)  # stale: its PID is not Apache
    (wd / "instance.json").unlink(missing_ok=True)
    _install_tree(conf / "lua", wd / "lua")
    _install_tree(conf / "htdocs", wd / "htdocs")
    _compile_tcpu(conf, wd / "luac")
    conf_path = wd / "httpd.conf"
    conf_path.write_text(
        render_config(
            wd,
            listen=listen,
            max_workers=max_workers,
            run_user=run_user,
            run_group=run_group,
            graceful_timeout=graceful_timeout,
            conf_dir=conf,
        )
    )

    test = subprocess.run(
        [APACHE_BIN, "-t", "-f", str(conf_path)], env=_APACHE_ENV, capture_output=True, text=True
    )
    if test.returncode != 0:
        raise ApacheStartError(
            f"config test: `apache2 -t -f {conf_path}` failed: {(test.stderr + test.stdout).strip()}"
        )

    cmd = [APACHE_BIN, "-f", str(conf_path), "-k", "start"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    launch = subprocess.run(cmd, env=_APACHE_ENV, capture_output=True, text=True)
    if launch.returncode != 0:
        out = (launch.stderr + launch.stdout).strip()
        if "Address already in use" in out:
            raise PortInUseError(f"listen: port {port} on {host} is already in use: {out}")
        raise ApacheStartError(f"start: `{' '.join(cmd)}` failed (rc {launch.returncode}): {out}")

    try:
        pid, kids = _wait_ready(wd, host, port, ready_timeout)
    except ApacheStartError:
        _kill_quietly(wd)
        raise
    nice = _raise_autogroup([pid, *kids], -20) if raise_priority else None
    inst = ApacheInstance(
        workdir=str(wd),
        listen=listen,
        pid=pid,
        child_pids=tuple(kids),
        cpu=cpu,
        max_workers=max_workers,
        autogroup_nice=nice,
    )
    (wd / "instance.json").write_text(json.dumps(asdict(inst), indent=2) + "\n")
    return inst


def _wait_ready(wd: Path, host: str, port: int, timeout: float) -> tuple[int, list[int]]:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        pid = _read_pid(wd)
        if pid is not None and not _pid_alive(pid):
            raise ApacheStartError(
                f"start: Apache (pid {pid}) exited during start-up; error log: {_error_log_tail(wd)}"
            )
        if pid is not None:
            try:
                code, _, body = _http_get(host, port, "/server-status?auto", 1.0)
                if code != 200 or "ServerMPM" not in body:
                    last = f"/server-status?auto answered {code}"
                else:
                    # Exercises mod_lua + tcpu.so end to end (fails if the module cannot load).
                    code, headers, body = _http_get(host, port, "/stage1?work=0", 2.0)
                    if code == 200 and "x-stage-cpu-us" in headers:
                        kids = _children(pid)
                        if kids:
                            return pid, kids
                        last = "no worker child yet"
                    else:
                        raise ApacheStartError(
                            f"start: stage handler /stage1?work=0 answered {code}: "
                            f"{body.strip()[:300]}; error log: {_error_log_tail(wd)}"
                        )
            except OSError as exc:
                last = str(exc)
        time.sleep(0.02)
    raise ApacheStartError(
        f"start: Apache not ready within {timeout} s ({last}); error log: {_error_log_tail(wd)}"
    )


def _kill_quietly(wd: Path) -> None:
    pid = _read_pid(wd)
    if pid is not None and _pid_alive(pid) and _is_apache(pid):
        os.kill(pid, signal.SIGTERM)
        _wait_gone([pid], time.monotonic() + 5.0)


def _wait_gone(pids: list[int], deadline: float) -> bool:
    while True:
        if not any(_pid_alive(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def stop(workdir: str | os.PathLike[str], *, timeout: float = 15.0, graceful: bool = True) -> bool:
    """Stop the instance in ``workdir`` and wait until its processes have exited.

    Graceful (default): SIGWINCH (``graceful-stop``: in-flight requests finish, at most
    ``GracefulShutdownTimeout`` s; the parent notices idle children within about 1 s), then
    SIGTERM if the parent is still alive after that. Returns once the parent and its children
    are gone, so the port can be reused at once.

    Parameters
    ----------
    workdir : path
        Instance directory given to :func:`start`.
    timeout : float
        Seconds to wait for the processes to exit.
    graceful : bool
        False sends SIGTERM at once (in-flight requests are cut; faster).

    Returns
    -------
    bool
        True if an instance was running and has stopped; False if none was running.

    Raises
    ------
    ApacheInputError
        ``workdir`` does not exist.
    ApacheStopTimeoutError
        A process was still alive after ``timeout`` seconds.
    """
    wd = _existing_workdir(workdir)
    pid = _read_pid(wd)
    if pid is None or not _pid_alive(pid) or not _is_apache(pid):
        # Stale pidfile (crash, reboot, PID reuse): never signal a PID that is not Apache.
        (wd / "run" / "httpd.pid").unlink(missing_ok=True)
        return False
    procs = [pid, *_children(pid)]
    start_t = time.monotonic()
    try:
        os.kill(pid, 0)
    except PermissionError:
        raise ApacheError(
            f"stop: not permitted to signal Apache pid {pid} in {wd} (started by another "
            "user); run the stop as that user or as root"
        ) from None
    if graceful:
        os.kill(pid, signal.SIGWINCH)
        grace = start_t + min(timeout, _graceful_timeout(wd) + 1.5)
    else:
        grace = start_t
    if not _wait_gone([pid], grace):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if not _wait_gone(procs, start_t + timeout):
        alive = [p for p in procs if _pid_alive(p)]
        raise ApacheStopTimeoutError(
            f"stop: Apache in {wd} still running after {timeout} s (SIGWINCH, then SIGTERM); "
            f"alive pids {alive}; end them with `kill -9 {' '.join(map(str, alive))}`"
        )
    return True


def _graceful_timeout(wd: Path) -> float:
    try:
        text = (wd / "httpd.conf").read_text()
    except OSError:
        return 5.0
    m = re.search(r"^GracefulShutdownTimeout\s+(\d+)", text, re.M)
    return float(m.group(1)) if m else 5.0


def status(workdir: str | os.PathLike[str], *, timeout: float = 2.0) -> dict[str, int | float | str]:
    """Fetch and parse ``/server-status?auto`` of the instance in ``workdir``.

    Parameters
    ----------
    workdir : path
        Instance directory given to :func:`start`.
    timeout : float
        Socket timeout in seconds.

    Returns
    -------
    dict
        See :func:`parse_status`.

    Raises
    ------
    ApacheInputError
        ``workdir`` does not exist.
    ApacheNotRunningError
        No instance recorded in ``workdir`` or it does not answer.
    """
    wd = _existing_workdir(workdir)
    return fetch_status(_load_instance(wd).listen, timeout=timeout)


# --------------------------------------------------------------------------- access log


@dataclass(frozen=True)
class AccessRecord:
    """One access-log line (format :data:`LOG_FORMAT`).

    Attributes
    ----------
    begin_us : int
        Request start, microseconds since the epoch.
    method, path, query : str
        From the request line; ``query`` without the ``?``.
    status : int
        Final HTTP status.
    bytes_sent : int
        Response body bytes (0 for none).
    duration_us : int
        ``%D``: reading the request line to logging, microseconds.
    stage : str or None
        Stage number for ``/stage<N>`` requests.
    cpu_us : int or None
        Thread CPU burnt by the stage handler, microseconds.
    tid : int
        Worker thread id (pthread_t, as Apache's ``%{tid}P``).
    request_id : str or None
        ``X-Request-Id`` request header.
    """

    begin_us: int
    method: str
    path: str
    query: str
    status: int
    bytes_sent: int
    duration_us: int
    stage: str | None
    cpu_us: int | None
    tid: int
    request_id: str | None


def read_access_log(workdir: str | os.PathLike[str]) -> list[AccessRecord]:
    """Parse ``WORKDIR/logs/access.log``.

    A last line without its newline (being written) is left out; any other line that does
    not match :data:`LOG_FORMAT` raises.

    Parameters
    ----------
    workdir : path
        Instance directory given to :func:`start`.

    Returns
    -------
    list of AccessRecord
        In log order (request completion order).
    """
    path = _existing_workdir(workdir) / "logs" / "access.log"
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return list(_parse_lines(text, path))


def _parse_lines(text: str, path: Path) -> Iterator[AccessRecord]:
    # Imported here: start/stop/status (the CLI) need nothing beyond the standard library.
    import apachelogs  # type: ignore[import-untyped]  # no stubs upstream

    parser = apachelogs.LogParser(LOG_FORMAT)
    lines = text.split("\n")
    for lineno, line in enumerate(lines[:-1], 1):  # lines[-1] is "" or an unfinished line
        if not line:
            continue
        try:
            e = parser.parse(line).directives
        except apachelogs.InvalidEntryError:
            raise ApacheError(
                f"access log: {path}:{lineno} does not match LOG_FORMAT: {line[:200]!r}"
            ) from None
        method, _, rest = str(e["%r"]).partition(" ")
        target = rest.rsplit(" ", 1)[0]
        p, _, q = target.partition("?")
        cpu = e["%{stage_cpu_us}n"]
        yield AccessRecord(
            begin_us=int(e["%{begin:usec}t"]),
            method=method,
            path=p,
            query=q,
            status=int(e["%>s"]),
            bytes_sent=int(e["%b"] or 0),
            duration_us=int(e["%D"]),
            stage=e["%{stage}n"],
            cpu_us=int(cpu) if cpu is not None else None,
            tid=int(e["%{tid}P"]),
            request_id=e["%{X-Request-Id}i"],
        )
