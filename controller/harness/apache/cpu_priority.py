"""Per-request CPU priority of Apache's worker threads: mod_overtake_prio for the launcher.

The C module (``apache-conf/mod_overtake_prio/``) lowers a worker thread's CPU priority
while its request runs: by attained thread CPU (age-based demotion, a few levels of
multilevel processor sharing approximating least-attained-service) or from a starting
class the sidecar sends in a request header (known-phase short-first, route class). Level
0 is the thread's own priority; level k >= 1 starts when the request's thread CPU reaches
``levels[k-1]`` seconds and runs at its own nice value plus ``nice[k-1]`` (or, for ``"idle"``,
``SCHED_IDLE``). The thread gets its priority back when the request ends.

Why: for service times with a decreasing hazard rate, least-attained-service beats processor
sharing among blind policies (Aalto, Ayesta and Righter, *On the Gittins index in the M/G/1
queue*, Queueing Systems 2009), while no admission limit does (Nuyens and van der Weij,
*Monotonicity in the limited processor sharing queue*).

This module holds what :func:`~overtake.controller.harness.apache.lifecycle.start` needs for
it (the ``cpu_priority=`` option): the settings (:class:`CpuPriority`), the ``apxs`` build
(:func:`build_module`), the ``httpd.conf`` tokens (:func:`config_tokens`, used by
:func:`~overtake.controller.harness.apache.config.render_config`) and, re-exported from
:mod:`~overtake.controller.harness.apache.prio_status`, the module's counters at
``/overtake-prio-status`` (:func:`parse_prio_status`, :func:`fetch_prio_status`).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from overtake.controller.errors import (
    ApacheInputError,
    ApacheNotInstalledError,
)
from overtake.controller.harness.apache.prio_status import (
    STATUS_PATH,
    PrioStatus,
    fetch_prio_status,
    parse_prio_status,
)

__all__ = [
    "DEFAULT_CLASS_HEADER",
    "DEFAULT_EXEMPT_HEADER",
    "MODULE_CFLAGS",
    "MODULE_DIR",
    "MODULE_HEADERS",
    "MODULE_SOURCES",
    "STATUS_PATH",
    "CpuPriority",
    "PrioStatus",
    "build_module",
    "config_tokens",
    "fetch_prio_status",
    "parse_prio_status",
]

#: Request header whose integer value (0..levels) is the request's starting level.
DEFAULT_CLASS_HEADER = "X-Overtake-Class"
#: Request header that exempts a request from demotion (the sidecar sends it for a stage's exempt methods).
DEFAULT_EXEMPT_HEADER = "X-Overtake-Exempt"
#: The module's folder, relative to the ``apache-conf/`` templates.
MODULE_DIR = Path("mod_overtake_prio")
#: The files ``apxs`` compiles into the one module (``SOURCES`` in ``MODULE_DIR/Makefile``).
MODULE_SOURCES = (
    "mod_overtake_prio.c",
    "op_directives.c",
    "op_prio.c",
    "op_monitor.c",
    "op_gate.c",
    "op_gate_key.c",
    "op_status.c",
    "op_guard.c",
    "op_pure.c",
    "op_guard_pure.c",
    "op_control.c",
    "op_times.c",
    "op_times_pure.c",
    "op_stage.c",
    "op_stage_conf.c",
    "op_stage_decide.c",
    "op_stage_fast.c",
    "op_stage_follow.c",
    "op_stage_child.c",
    "op_stage_status.c",
)
#: The headers they include (``HEADERS`` in the Makefile).
MODULE_HEADERS = ("mod_overtake_prio.h", "op_pure.h", "op_guard.h", "op_guard_pure.h", "og_fault.h", "og_hmac.h",
                  "oc_table.h", "op_times.h", "op_times_pure.h", "os_table.h", "op_stage.h")
#: Compiler flags (``WARNINGS`` and ``-O2`` in the Makefile): a warning fails the build.
MODULE_CFLAGS = (
    "-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wmissing-prototypes", "-Werror", "-O2",
)

_APXS = "apxs"
_METHOD = re.compile(r"[A-Z_-]{1,32}")
_STAGE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,31}")
_MAX_LEVELS = 8  # OP_MAX_LEVELS in the C module
_INSTALL_HINT = (
    "install it with apache-conf/install-debian-packages.sh or `apt-get install apache2-dev`"
)


def _default_nice(n: int) -> tuple[int | str, ...]:
    return (*([10] * (n - 1)), "idle")


@dataclass(frozen=True)
class CpuPriority:
    """Settings of mod_overtake_prio (the ``OvertakePrio*`` directives).

    Parameters
    ----------
    levels : tuple of float
        Thread-CPU seconds at which a request enters level 1, 2, ... (strictly increasing,
        > 0; at most 8). ``OvertakePrioLevels``.
    nice : tuple of int or "idle", optional
        Priority of each level: a nice increment 1..19 over the thread's own nice value
        (non-decreasing; the result is capped at 19) or ``"idle"``
        (``SCHED_IDLE``, last level only). Default: nice 10 for every level but the last,
        ``"idle"`` for the last. ``OvertakePrioNice``.
    interval : float
        Period of the monitor thread in seconds, 0.0001..1. ``OvertakePrioInterval``.
    cpu_resolution : float
        A worker thread reads its CPU clock (a system call) at most once per this many
        seconds, 0..0.1; a request's attained CPU is then overcounted by less than this
        (0: read at every request start). ``OvertakePrioCpuResolution``.
    age : bool
        Demote by attained thread CPU. False: only the class header sets a level (class
        priority). ``OvertakePrioAge``.
    class_header : str or None
        Request header with the starting level (an integer 0..len(levels)); None ignores
        headers. ``OvertakePrioClassHeader``.
    cap_sys_nice : {"auto", "on", "off"}
        Keep ``CAP_SYS_NICE`` (only) for the worker user so that it can restore demoted
        threads: ``"auto"`` when ``RLIMIT_NICE`` cannot be raised to 20 (a root without
        ``CAP_SYS_RESOURCE``), ``"off"`` never (the module then disables itself if
        ``RLIMIT_NICE`` is too low). ``OvertakePrioCapSysNice``.
    gate : str, optional
        Absolute path of the sidecar's admission-gate file (its ``--gate``): requests carrying
        ``X-Overtake-Gate`` wait in Apache until the sidecar admits them. ``OvertakeGate``.
        Each waiting request holds a worker: give ``max_workers`` room for ``gate_slots`` more.
    control_file : str, optional
        Absolute path of the sidecar's control file (its ``control_file``): the age thresholds
        of the sidecar's policy, in force instead of ``levels`` while the file is valid.
        ``OvertakeControlFile``.
    gate_timeout : float
        Seconds a gated request waits for a gate that never opens before it is let through
        (0.001..3600; keep it above the sidecar's queue timeout). ``OvertakeGateTimeout``.
    exempt_methods : tuple of str
        Requests of these methods are never demoted (they may hold a lock others wait for);
        ``"unsafe"`` stands for every method but GET and HEAD. ``OvertakePrioExemptMethods``.
    exempt_paths : tuple of str
        Requests under these URL paths (``/api`` covers ``/api`` and ``/api/...``) are never
        demoted. ``OvertakePrioExemptPath``.
    exempt_header : str or None
        Requests carrying this header are never demoted (the sidecar sends it for a stage's
        exempt methods); None ignores it. ``OvertakePrioExemptHeader``.
    demotion_limit : float
        Seconds of wall time a request may stay below its original priority before it gets it
        back for good (0..3600; 0: no limit), so that a demoted lock holder always finishes.
        ``OvertakePrioDemotionLimit``.
    request_times : bool
        Split each request's handler time into CPU, run-queue wait and blocked time, as the
        request notes the access log's ``LOG_FORMAT`` reads (the serialisation detector's
        input). ``OvertakeRequestTimes``.
    stages : tuple of (str, str)
        Module mode: ``(name, regex)`` pairs, each a ``<LocationMatch "regex">`` with
        ``OvertakeStage name``; the control file's count table holds the requests of each stage.
    stage_prefixes : tuple of (str, str) or (str, str, str)
        Module mode without sections: ``(name, prefix)`` or ``(name, prefix, method)``, each an
        ``OvertakeStagePrefix prefix name [method]`` at server level (a literal URL-path prefix
        ending at a segment boundary; the longest wins, and of equal ones the one naming the
        request's method; name ``none``: no stage). Apache then merges no section per request:
        the cheaper way to say which URLs are a stage. A request matched by ``stages`` is of that
        stage whatever its prefix.
    stage_hold : float
        Seconds a request waits at most for its stage's turn before it runs anyway
        (0.001..3600). ``OvertakeStageHold``.
    stage_next : tuple of (str, str)
        Module mode's tandem routing: ``(first, second)`` pairs of stage names; a request of
        ``first`` that ends on a kept-alive connection reserves a turn of ``second`` for the
        connection's next request. ``OvertakeStageNext``.
    stage_follow_up : float
        Seconds a reservation waits for the connection's next request (0.0001..60).
        ``OvertakeStageFollowUp``.
    stage_abort_on_close : bool
        Drop a held request whose client half-closed the connection, as one whose client reset
        it always is (False: serve it). ``OvertakeStageAbortOnClose``.
    stage_lifo_after : float
        Seconds a stage's queue stands (never empty) before its starts go to its newest waiting
        requests (0..3600; 0: always the oldest first). ``OvertakeStageLifoAfter``.
    """

    levels: tuple[float, ...] = (0.005, 0.05)
    nice: tuple[int | str, ...] | None = None
    interval: float = 0.001
    cpu_resolution: float = 0.001
    age: bool = True
    class_header: str | None = DEFAULT_CLASS_HEADER
    cap_sys_nice: str = "auto"
    gate: str | None = None
    gate_timeout: float = 60.0
    exempt_methods: tuple[str, ...] = ()
    exempt_paths: tuple[str, ...] = ()
    exempt_header: str | None = DEFAULT_EXEMPT_HEADER
    demotion_limit: float = 0.0
    control_file: str | None = None
    request_times: bool = False
    stages: tuple[tuple[str, str], ...] = ()
    stage_prefixes: tuple[tuple[str, ...], ...] = ()
    stage_hold: float = 30.0
    stage_next: tuple[tuple[str, str], ...] = ()
    stage_follow_up: float = 0.005
    stage_abort_on_close: bool = True
    stage_lifo_after: float = 0.0
    priorities: tuple[int | str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        levels = tuple(self.levels)
        if not 1 <= len(levels) <= _MAX_LEVELS:
            raise ApacheInputError(
                f"cpu_priority.levels: give 1..{_MAX_LEVELS} thread-CPU thresholds in seconds, "
                f"e.g. (0.005, 0.05); got {self.levels!r}"
            )
        prev = 0.0
        for v in levels:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ApacheInputError(f"cpu_priority.levels: {v!r} is not a number of seconds")
            if not prev < v <= 3600:
                raise ApacheInputError(
                    f"cpu_priority.levels: thresholds must be > 0, <= 3600 s and strictly "
                    f"increasing; got {levels!r}"
                )
            prev = float(v)
        nice = _default_nice(len(levels)) if self.nice is None else tuple(self.nice)
        if len(nice) != len(levels):
            raise ApacheInputError(
                f"cpu_priority.nice: one value per level ({len(levels)}), got {len(nice)}: {nice!r}"
            )
        last = 0
        for i, p in enumerate(nice):
            if p == "idle":
                if i != len(nice) - 1:
                    raise ApacheInputError(
                        f"cpu_priority.nice: 'idle' (SCHED_IDLE) can only be the last level; got {nice!r}"
                    )
                continue
            if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 19:
                raise ApacheInputError(
                    f"cpu_priority.nice: {p!r} must be a nice increment 1..19 or 'idle'"
                )
            if p < last:
                raise ApacheInputError(
                    f"cpu_priority.nice: levels must not rise in priority; got {nice!r}"
                )
            last = p
        if not isinstance(self.interval, (int, float)) or not 0.0001 <= self.interval <= 1.0:
            raise ApacheInputError(
                f"cpu_priority.interval: monitor period must be 0.0001..1 s, got {self.interval!r}"
            )
        res = self.cpu_resolution
        if isinstance(res, bool) or not isinstance(res, (int, float)) or not 0.0 <= res <= 0.1:
            raise ApacheInputError(
                f"cpu_priority.cpu_resolution: seconds in 0..0.1 (0 reads the thread CPU clock at "
                f"every request), got {res!r}"
            )
        hdr = self.class_header
        if hdr is not None and (
            not hdr or hdr.lower() == "none" or any(c in hdr for c in ' \t\r\n:"')
        ):
            raise ApacheInputError(
                f"cpu_priority.class_header: {hdr!r} is not a header name; use None to ignore "
                "headers"
            )
        if self.cap_sys_nice not in ("auto", "on", "off"):
            raise ApacheInputError(
                f"cpu_priority.cap_sys_nice: must be 'auto', 'on' or 'off', got {self.cap_sys_nice!r}"
            )
        if self.gate is not None and (not isinstance(self.gate, str) or not self.gate.startswith("/")
                                      or any(c in self.gate for c in ' \t\r\n"')):
            raise ApacheInputError(
                f"cpu_priority.gate: {self.gate!r} must be an absolute path without spaces, the "
                "sidecar's --gate file (e.g. /dev/shm/overtake-gate)"
            )
        cf = self.control_file
        if cf is not None and (not isinstance(cf, str) or not cf.startswith("/")
                               or any(c in cf for c in ' \t\r\n"')):
            raise ApacheInputError(
                f"cpu_priority.control_file: {cf!r} must be an absolute path without spaces, the "
                "sidecar's control_file (e.g. /run/overtake/control)"
            )
        if not isinstance(self.request_times, bool):
            raise ApacheInputError(f"cpu_priority.request_times: True or False, got {self.request_times!r}")
        gt = self.gate_timeout
        if isinstance(gt, bool) or not isinstance(gt, (int, float)) or not 0.001 <= gt <= 3600:
            raise ApacheInputError(f"cpu_priority.gate_timeout: seconds in 0.001..3600, got {gt!r}")
        self._check_guard()
        self._check_stages()
        object.__setattr__(self, "levels", tuple(float(v) for v in levels))
        object.__setattr__(self, "priorities", nice)


    def _check_stages(self) -> None:
        for pair in self.stages:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ApacheInputError(f"cpu_priority.stages: {pair!r} is not a (name, regex) pair")
            name, regex = pair
            if not (isinstance(name, str) and _STAGE_NAME.fullmatch(name)):
                raise ApacheInputError(f"cpu_priority.stages: stage name {name!r} must be 1..31 letters, digits, "
                                       "'_', '.', '-' (OvertakeStage)")
            if not isinstance(regex, str) or not regex or any(c in regex for c in '"\r\n'):
                raise ApacheInputError(f"cpu_priority.stages: {regex!r} must be a URL-path regex without quotes "
                                       "or line breaks, e.g. ^/stage1$")
        self._check_stage_prefixes()
        if (self.stages or self.stage_prefixes) and not self.control_file:
            raise ApacheInputError("cpu_priority.stages: the count table comes from the control file; give "
                                   "control_file too")
        hold = self.stage_hold
        if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0.001 <= hold <= 3600:
            raise ApacheInputError(f"cpu_priority.stage_hold: seconds in 0.001..3600, got {hold!r}")
        names = {e[0] for e in (*self.stages, *self.stage_prefixes)} - {"none"}
        for pair in self.stage_next:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(p in names for p in pair) and pair[0] != pair[1]):
                raise ApacheInputError(f"cpu_priority.stage_next: {pair!r} must be a (first, second) pair of two "
                                       f"different names of cpu_priority.stages ({sorted(names)})")
        follow = self.stage_follow_up
        if isinstance(follow, bool) or not isinstance(follow, (int, float)) or not 0.0001 <= follow <= 60:
            raise ApacheInputError(f"cpu_priority.stage_follow_up: seconds in 0.0001..60, got {follow!r}")
        lifo = self.stage_lifo_after
        if isinstance(lifo, bool) or not isinstance(lifo, (int, float)) or not 0 <= lifo <= 3600:
            raise ApacheInputError(f"cpu_priority.stage_lifo_after: seconds in 0..3600 (0: never), got {lifo!r}")
        if not isinstance(self.stage_abort_on_close, bool):
            raise ApacheInputError(f"cpu_priority.stage_abort_on_close: True or False, got {self.stage_abort_on_close!r}")

    def _check_stage_prefixes(self) -> None:
        seen: set[tuple[str, ...]] = set()
        for entry in self.stage_prefixes:
            if not (isinstance(entry, tuple) and len(entry) in (2, 3)):
                raise ApacheInputError(f"cpu_priority.stage_prefixes: {entry!r} is not a (name, prefix) pair or a "
                                       "(name, prefix, method) triple")
            name, prefix = entry[:2]
            if len(entry) == 3 and not (isinstance(entry[2], str) and _METHOD.fullmatch(entry[2])):
                raise ApacheInputError(f"cpu_priority.stage_prefixes: {entry[2]!r} is not an HTTP method (upper "
                                       "case, e.g. POST)")
            if not (isinstance(name, str) and _STAGE_NAME.fullmatch(name)):
                raise ApacheInputError(f"cpu_priority.stage_prefixes: stage name {name!r} must be 1..31 letters, "
                                       "digits, '_', '.', '-' (OvertakeStagePrefix)")
            if not isinstance(prefix, str) or not prefix.startswith("/") or any(c in prefix for c in ' \t\r\n"?#'):
                raise ApacheInputError(f"cpu_priority.stage_prefixes: {prefix!r} must be a literal URL path that "
                                       "starts with '/' and has no query, e.g. /static/")
            if entry[1:] in seen:
                raise ApacheInputError(f"cpu_priority.stage_prefixes: prefix {' '.join(entry[1:])!r} given twice; "
                                       "a prefix (and method) names one stage")
            seen.add(entry[1:])

    def _check_guard(self) -> None:
        for m in self.exempt_methods:
            if m != "unsafe" and not (isinstance(m, str) and _METHOD.fullmatch(m)):
                raise ApacheInputError(
                    f"cpu_priority.exempt_methods: {m!r} is not an HTTP method (upper case, e.g. POST) "
                    "or 'unsafe' (every method but GET and HEAD)"
                )
        for p in self.exempt_paths:
            if not isinstance(p, str) or not p.startswith("/") or any(c in p for c in ' \t\r\n"?#'):
                raise ApacheInputError(
                    f"cpu_priority.exempt_paths: {p!r} must be a URL path that starts with '/' and has no "
                    "query, e.g. /api.php"
                )
        hdr = self.exempt_header
        if hdr is not None and (not hdr or hdr.lower() == "none" or any(c in hdr for c in ' \t\r\n:"')):
            raise ApacheInputError(
                f"cpu_priority.exempt_header: {hdr!r} is not a header name; use None to ignore it"
            )
        lim = self.demotion_limit
        if isinstance(lim, bool) or not isinstance(lim, (int, float)) or not 0 <= lim <= 3600:
            raise ApacheInputError(
                f"cpu_priority.demotion_limit: seconds in 0..3600 (0: no limit), got {lim!r}"
            )


def _stage_lines(cp: CpuPriority) -> str:
    staged = cp.stages or cp.stage_prefixes
    lines = [f"OvertakeStageHold {float(cp.stage_hold)!r}"] if staged else ["# no stages"]
    lines += [f"OvertakeStageNext {a} {b}" for a, b in cp.stage_next]
    if cp.stage_next:
        lines.append(f"OvertakeStageFollowUp {float(cp.stage_follow_up)!r}")
    if staged and not cp.stage_abort_on_close:
        lines.append("OvertakeStageAbortOnClose Off")
    if staged and cp.stage_lifo_after:
        lines.append(f"OvertakeStageLifoAfter {float(cp.stage_lifo_after)!r}")
    lines += [f'OvertakeStagePrefix "{e[1]}" {" ".join((e[0], *e[2:]))}' for e in cp.stage_prefixes]
    for name, regex in cp.stages:
        lines += [f'<LocationMatch "{regex}">', f"        OvertakeStage {name}", "    </LocationMatch>"]
    return "\n    ".join(lines)


def _guard_lines(cp: CpuPriority) -> str:
    lines = [f"OvertakePrioExemptHeader {cp.exempt_header or 'none'}",
             f"OvertakePrioDemotionLimit {float(cp.demotion_limit)!r}"]
    if cp.exempt_methods:
        lines.append("OvertakePrioExemptMethods " + " ".join(cp.exempt_methods))
    if cp.exempt_paths:
        lines.append("OvertakePrioExemptPath " + " ".join(f'"{p}"' for p in cp.exempt_paths))
    return "\n    ".join(lines)


def config_tokens(cpu_priority: CpuPriority | None) -> dict[str, str]:
    """Values of the ``@CPU_PRIO_*@`` tokens of ``httpd.conf.in``.

    Parameters
    ----------
    cpu_priority : CpuPriority or None
        None leaves the module out (``Define OVERTAKE_CPU_PRIO`` is not rendered; the
        ``<IfDefine>`` block is skipped, its other tokens get inert defaults).

    Returns
    -------
    dict of str to str
        Token name (without at-signs) to text.
    """
    cp = cpu_priority if cpu_priority is not None else CpuPriority()
    return {
        "CPU_PRIO_DEFINE": (
            "Define OVERTAKE_CPU_PRIO" if cpu_priority is not None else "# cpu_priority: off"
        ),
        "CPU_PRIO_LEVELS": " ".join(repr(v) for v in cp.levels),
        "CPU_PRIO_NICE": " ".join(str(p) for p in cp.priorities),
        "CPU_PRIO_INTERVAL": repr(float(cp.interval)),
        "CPU_PRIO_RESOLUTION": repr(float(cp.cpu_resolution)),
        "CPU_PRIO_AGE": "On" if cp.age else "Off",
        "CPU_PRIO_CLASS_HEADER": cp.class_header or "none",
        "CPU_PRIO_CAP_SYS_NICE": cp.cap_sys_nice,
        "CPU_PRIO_GATE": (f'OvertakeGate "{cp.gate}"\n    OvertakeGateTimeout {float(cp.gate_timeout)!r}'
                          if cp.gate else "# no admission gate"),
        "CPU_PRIO_GUARD": _guard_lines(cp),
        "CPU_PRIO_CONTROL": (f'OvertakeControlFile "{cp.control_file}"' if cp.control_file
                             else "# no control file"),
        "CPU_PRIO_TIMES": f"OvertakeRequestTimes {'On' if cp.request_times else 'Off'}",
        "CPU_PRIO_STAGES": _stage_lines(cp),
    }


def build_module(conf_dir: Path, workdir: Path) -> Path:
    """Compile :data:`MODULE_SOURCES` with ``apxs`` into ``workdir/modules``.

    Skipped when the ``.so`` is newer than every source and header. The build runs in
    ``workdir/modules/build`` (apxs/libtool leave objects in the current directory) and the
    result replaces ``workdir/modules/mod_overtake_prio.so`` atomically.

    Parameters
    ----------
    conf_dir : Path
        The ``apache-conf/`` templates.
    workdir : Path
        Absolute instance directory.

    Returns
    -------
    Path
        The shared object, world-readable (Apache's parent loads it as root; fine either way).

    Raises
    ------
    ApacheNotInstalledError
        ``apxs`` (package ``apache2-dev``) is missing or the compilation failed.
    """
    src_dir = conf_dir / MODULE_DIR
    sources = [src_dir / name for name in (*MODULE_SOURCES, *MODULE_HEADERS)]
    mod_dir = workdir / "modules"
    out = mod_dir / "mod_overtake_prio.so"
    if out.exists() and out.stat().st_mtime >= max(f.stat().st_mtime for f in sources):
        return out
    apxs = shutil.which(_APXS)
    if apxs is None:
        raise ApacheNotInstalledError(
            f"apxs: not found (package apache2-dev), needed for cpu_priority=; {_INSTALL_HINT}"
        )
    build = mod_dir / "build"
    build.mkdir(parents=True, exist_ok=True)
    mod_dir.chmod(0o755)
    for f in sources:
        shutil.copyfile(f, build / f.name)
    cmd = [apxs, "-c", "-o", "mod_overtake_prio.la", *(f"-Wc,{f}" for f in MODULE_CFLAGS), *MODULE_SOURCES]
    proc = subprocess.run(cmd, cwd=build, capture_output=True, text=True, check=False)
    built = build / ".libs" / "mod_overtake_prio.so"
    if proc.returncode != 0 or not built.exists():
        raise ApacheNotInstalledError(
            f"mod_overtake_prio: `{' '.join(cmd)}` in {build} failed (rc {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[-800:]}; {_INSTALL_HINT}"
        )
    tmp = mod_dir / f".mod_overtake_prio.{os.getpid()}.so"
    shutil.copyfile(built, tmp)
    tmp.chmod(0o755)
    os.replace(tmp, out)  # atomic: a running Apache never maps a half-written file
    return out
