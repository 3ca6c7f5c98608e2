"""Paths, listen addresses and ``httpd.conf`` rendering for the private Apache.

The template is ``apache-conf/httpd.conf.in``, installed with the package as
:mod:`overtake.apache_conf` (a wheel carries it, so this works outside the checkout); pass
``conf_dir=`` to use another copy. ``@TOKEN@`` placeholders are filled by :func:`render_config`.
"""

from __future__ import annotations

import os
import re
import socket
from importlib import resources
from pathlib import Path

from overtake.controller.errors import ApacheInputError
from overtake.controller.harness.apache.cpu_priority import CpuPriority, config_tokens
from overtake.controller.log_format import LOG_FORMAT

__all__ = [
    "APACHE_BIN",
    "DEFAULT_CONF_DIR",
    "LOG_FORMAT",
    "LUA_INCLUDE_DIR",
    "MIME_TYPES",
    "MODULES_DIR",
    "MPMS",
    "check_max_workers",
    "check_mpm",
    "connect_host",
    "format_listen",
    "mpm_tokens",
    "parse_listen",
    "render_config",
    "resolve_conf_dir",
]

APACHE_BIN = "/usr/sbin/apache2"
MODULES_DIR = "/usr/lib/apache2/modules"
LUA_INCLUDE_DIR = "/usr/include/lua5.3"
MIME_TYPES = "/etc/mime.types"
#: The templates of ``apache-conf/``, installed as package data (:mod:`overtake.apache_conf`).
DEFAULT_CONF_DIR = Path(str(resources.files("overtake.apache_conf")))

_TOKEN = re.compile(r"@([A-Z_]+)@")
_MAX_WORKERS_LIMIT = 20000  # Apache's hard ThreadLimit ceiling for mpm_event
#: the MPMs a private instance can run (both ship in Debian's apache2-bin)
MPMS = ("event", "prefork")


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


def format_listen(host: str, port: int) -> str:
    """``HOST:PORT``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect_host(host: str) -> str:
    """The address a client dials for ``host``: a wildcard listener is reached through loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def resolve_conf_dir(conf_dir: str | os.PathLike[str] | None) -> Path:
    """``conf_dir`` or :data:`DEFAULT_CONF_DIR`, checked to hold ``httpd.conf.in``."""
    d = Path(conf_dir) if conf_dir is not None else DEFAULT_CONF_DIR
    if not (d / "httpd.conf.in").is_file():
        raise ApacheInputError(
            f"conf_dir: {d} has no httpd.conf.in; reinstall overtake-server (its wheel carries "
            "apache-conf/) or pass conf_dir= pointing at a copy of apache-conf/"
        )
    return d


def check_max_workers(max_workers: int) -> None:
    """``max_workers`` must be an int in 1..20000 (mpm_event's ThreadLimit ceiling)."""
    if isinstance(max_workers, bool) or not isinstance(max_workers, int):
        raise ApacheInputError(f"max_workers: must be an integer, got {max_workers!r}")
    if not 1 <= max_workers <= _MAX_WORKERS_LIMIT:
        raise ApacheInputError(
            f"max_workers: must be in 1..{_MAX_WORKERS_LIMIT} (policy's max threads plus "
            f"margin), got {max_workers}"
        )


def check_mpm(mpm: str, max_workers: int, threads_per_child: int | None) -> None:
    """``mpm`` is event or prefork; ``threads_per_child`` (event only) divides ``max_workers``,
    as Apache would otherwise round MaxRequestWorkers down to a multiple of it."""
    if mpm not in MPMS:
        raise ApacheInputError(f"mpm: expected one of {', '.join(MPMS)}, got {mpm!r}")
    if threads_per_child is None:
        return
    if mpm != "event":
        raise ApacheInputError(f"threads_per_child: only for mpm event (prefork runs one thread per process), got mpm {mpm}")
    if isinstance(threads_per_child, bool) or not isinstance(threads_per_child, int) or not (
            1 <= threads_per_child <= max_workers and max_workers % threads_per_child == 0):
        raise ApacheInputError(f"threads_per_child: must divide max_workers = {max_workers} (Apache would round "
                               f"MaxRequestWorkers down otherwise), got {threads_per_child!r}")


def mpm_tokens(mpm: str, max_workers: int, threads_per_child: int | None) -> dict[str, str]:
    """The template's MPM values: event with one child of ``max_workers`` threads (or children of
    ``threads_per_child``), or prefork with a few spare processes of at most ``max_workers``."""
    tpc = threads_per_child or max_workers
    return {
        "MPM": mpm,
        "THREADS_PER_CHILD": str(tpc),
        "SERVER_LIMIT": str(max_workers // tpc),
        "PREFORK_SPARE_MIN": str(min(5, max_workers)),
        "PREFORK_SPARE_MAX": str(min(10, max_workers)),
    }


def render_config(
    workdir: str | os.PathLike[str],
    *,
    listen: str,
    max_workers: int,
    run_user: str = "www-data",
    run_group: str = "www-data",
    graceful_timeout: int = 5,
    conf_dir: str | os.PathLike[str] | None = None,
    cpu_priority: CpuPriority | None = None,
    mpm: str = "event",
    threads_per_child: int | None = None,
    max_connections_per_child: int = 0,
    extra_conf: str = "",
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
        ``MaxRequestWorkers``: the policy's maximum number of threads plus a margin; under
        mpm_event by default the ``ThreadsPerChild`` of its single child.
    run_user, run_group : str
        Account of the worker child when started as root (Apache refuses root).
    graceful_timeout : int
        ``GracefulShutdownTimeout`` in seconds: how long :func:`stop` lets in-flight
        requests finish.
    conf_dir : path, optional
        Directory holding ``httpd.conf.in``; default :data:`DEFAULT_CONF_DIR`.
    cpu_priority : CpuPriority, optional
        Load mod_overtake_prio with these settings (see :mod:`.cpu_priority`); None leaves
        it out.
    mpm : str
        ``event`` (default) or ``prefork`` (one process per worker, a few started: what a stock
        Debian Apache with mod_php runs).
    threads_per_child : int, optional
        mpm_event only: children of this many threads (it must divide ``max_workers``), started
        on demand, instead of one child holding them all.
    max_connections_per_child : int
        ``MaxConnectionsPerChild``: a child exits after this many connections (0: never).
    extra_conf : str
        Apache directives added as they are (e.g. a ``proxy_fcgi`` handler for PHP-FPM).

    Returns
    -------
    str
        The configuration text.
    """
    _check_render_args(max_workers, mpm, threads_per_child, max_connections_per_child)
    host, port = parse_listen(listen)
    if graceful_timeout < 0:
        raise ApacheInputError(f"graceful_timeout: must be >= 0 s, got {graceful_timeout}")
    template = (resolve_conf_dir(conf_dir) / "httpd.conf.in").read_text()
    values = {
        **_instance_tokens(workdir, host, port, run_user, run_group),
        "MAX_WORKERS": str(max_workers),
        "MAX_SPARE_THREADS": str(2 * max_workers),
        "GRACEFUL_TIMEOUT": str(int(graceful_timeout)),
        **config_tokens(cpu_priority),
        **mpm_tokens(mpm, max_workers, threads_per_child),
        "MAX_CONNECTIONS_PER_CHILD": str(max_connections_per_child),
        "EXTRA_CONF": extra_conf or "# none",
    }
    return _substitute(template, values)


def _check_render_args(max_workers: int, mpm: str, threads_per_child: int | None,
                       max_connections_per_child: int) -> None:
    check_max_workers(max_workers)
    n = max_connections_per_child
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ApacheInputError(f"max_connections_per_child: an integer >= 0 (0: children never exit), got {n!r}")
    check_mpm(mpm, max_workers, threads_per_child)


def _instance_tokens(workdir: str | os.PathLike[str], host: str, port: int, run_user: str,
                     run_group: str) -> dict[str, str]:
    """The tokens that place the instance: its folder, address, account, and Debian's files."""
    return {
        "APACHE_DIR": str(Path(workdir).resolve()),
        "LISTEN": format_listen(host, port),
        "SERVER_NAME": connect_host(host) if ":" not in host else "localhost",
        "RUN_USER": run_user,
        "RUN_GROUP": run_group,
        "MODULES_DIR": MODULES_DIR,
        "MIME_TYPES": MIME_TYPES,
        # Inside a quoted Apache directive argument, quotes are backslash-escaped.
        "LOG_FORMAT": LOG_FORMAT.replace("\\", "\\\\").replace('"', '\\"'),
    }


def _substitute(template: str, values: dict[str, str]) -> str:
    """``template`` with every ``@TOKEN@`` replaced; an unknown token is the conf_dir's error."""

    def substitute(m: re.Match[str]) -> str:
        try:
            return values[m.group(1)]
        except KeyError:
            raise ApacheInputError(
                f"conf_dir: httpd.conf.in uses unknown token @{m.group(1)}@; "
                f"known: {', '.join(sorted(values))}"
            ) from None

    return _TOKEN.sub(substitute, template)
