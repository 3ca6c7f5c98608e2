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
    WORKDIR/modules/          mod_overtake_prio.so, built with apxs only for cpu_priority=

It serves mod_status at ``/server-status`` (ExtendedStatus on, local clients only) and the
CPU-burning stage handler at ``/stage1``, ``/stage2``, ...: ``GET /stage1?work=0.05`` burns
0.05 s of the worker *thread's* CPU time (``CLOCK_THREAD_CPUTIME_ID``; Lua's ``os.clock()``
is process-wide and wrong under mpm_event) and logs the CPU actually used as ``cpu_us``.

Modules: :mod:`.config` (paths, listen addresses, ``httpd.conf``), :mod:`.prepare` (packages,
worker user, the work directory's files), :mod:`.lifecycle` (:func:`start`, :func:`stop`,
:func:`status`), :mod:`.instance` (``instance.json``), :mod:`.mod_status` (``?auto``
parsing), :mod:`.access_log` (:func:`read_access_log`) and :mod:`.cpu_priority`
(mod_overtake_prio: per-request CPU priority of the worker threads, ``start(cpu_priority=)``).
"""

from __future__ import annotations

from overtake.controller.harness.apache.access_log import AccessRecord, read_access_log
from overtake.controller.harness.apache.config import DEFAULT_CONF_DIR, LOG_FORMAT, parse_listen, render_config
from overtake.controller.harness.apache.cpu_priority import CpuPriority, PrioStatus, fetch_prio_status
from overtake.controller.harness.apache.instance import ApacheInstance
from overtake.controller.harness.apache.lifecycle import start, status, stop
from overtake.controller.harness.apache.mod_status import SCOREBOARD_STATES, fetch_status, parse_status, scoreboard_counts
from overtake.controller.harness.apache.prepare import check_installed

__all__ = [
    "AccessRecord",
    "ApacheInstance",
    "CpuPriority",
    "DEFAULT_CONF_DIR",
    "LOG_FORMAT",
    "PrioStatus",
    "SCOREBOARD_STATES",
    "check_installed",
    "fetch_prio_status",
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
