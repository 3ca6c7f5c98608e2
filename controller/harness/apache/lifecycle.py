"""Start, stop and ask the private Apache: ``apache2 -f WORKDIR/httpd.conf -k start``.

The instance lives entirely in one work directory and never touches ``/etc/apache2`` or a
system service (see :mod:`overtake.controller.harness.apache`). For clean processor sharing
(PS) between concurrent requests, :func:`start` can pin Apache to one core (``taskset``) and
raise the priority of its scheduler autogroup (write -20 to ``/proc/<pid>/autogroup``): with
autogroups on, ``nice`` only ranks threads inside one autogroup, so it does nothing against
other jobs on the machine. Pinned and raised, k concurrent requests finish together in about k
times one request's time, as under PS; without the autogroup step other load on the machine
stretches them. ``apache2 -k stop`` is asynchronous, so :func:`stop` waits until the
processes are gone before the port is reused.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict
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
from overtake.controller.harness.apache.config import (
    APACHE_BIN,
    MODULES_DIR,
    check_max_workers,
    check_mpm,
    connect_host,
    format_listen,
    parse_listen,
    render_config,
    resolve_conf_dir,
)
from overtake.controller.harness.apache.cpu_priority import CpuPriority, build_module, fetch_prio_status
from overtake.controller.harness.apache.instance import ApacheInstance, existing_workdir, load_instance
from overtake.controller.harness.apache.mod_status import fetch_status, http_get
from overtake.controller.harness.apache.prepare import check_installed, check_run_user, compile_tcpu, install_tree

__all__ = ["children", "pid_alive", "start", "status", "stop"]

# Apache needs no environment; a clean one keeps /etc/apache2/envvars conventions out.
_APACHE_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}


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


def pid_alive(pid: int) -> bool:
    """``pid`` exists and is no zombie (a zombie has exited; only its parent's wait() is missing)."""
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


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (Apache's children), ascending, from ``/proc``."""
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


def _check_start_args(max_workers: int, mpm: str, threads_per_child: int | None, cpu: int | None) -> None:
    check_max_workers(max_workers)
    check_mpm(mpm, max_workers, threads_per_child)
    if not os.path.exists(os.path.join(MODULES_DIR, f"mod_mpm_{mpm}.so")):
        raise ApacheNotInstalledError(f"mpm: {MODULES_DIR}/mod_mpm_{mpm}.so not found (package apache2-bin)")
    if cpu is not None:
        allowed = sorted(os.sched_getaffinity(0))
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu not in allowed:
            raise ApacheInputError(f"cpu: core {cpu!r} is not available; usable cores: {allowed}")
        if shutil.which("taskset") is None:
            raise ApacheNotInstalledError("taskset: not found (package util-linux); needed for cpu=")


def _check_workdir_free(wd: Path) -> None:
    """``wd`` is a directory (or absent) and no Apache runs from it."""
    if wd.exists() and not wd.is_dir():
        raise ApacheInputError(f"workdir: {wd} exists and is not a directory")
    old_pid = _read_pid(wd) if wd.is_dir() else None
    if old_pid is not None and pid_alive(old_pid) and _is_apache(old_pid):
        raise ApacheInputError(
            f"workdir: an Apache (pid {old_pid}) already runs in {wd}; "
            f"stop it first with `overtake apache stop --workdir {wd}`"
        )


def _prepare_workdir(wd: Path, conf: Path, run_user: str, cpu_priority: CpuPriority | None) -> None:
    """The instance's directories, handler, static files, ``tcpu.so`` and (if asked) the priority module."""
    wd.mkdir(parents=True, exist_ok=True)
    wd.chmod(0o755)
    check_run_user(wd, run_user)  # run_group is checked by `apache2 -t`
    for sub in ("logs", "run", "luac"):
        (wd / sub).mkdir(exist_ok=True)
        (wd / sub).chmod(0o755)
    (wd / "run" / "httpd.pid").unlink(missing_ok=True)  # stale: its PID is not Apache
    (wd / "instance.json").unlink(missing_ok=True)
    install_tree(conf / "lua", wd / "lua")
    install_tree(conf / "htdocs", wd / "htdocs")
    compile_tcpu(conf, wd / "luac")
    if cpu_priority is not None:
        build_module(conf, wd)


def _config_test(conf_path: Path) -> None:
    test = subprocess.run(
        [APACHE_BIN, "-t", "-f", str(conf_path)], env=_APACHE_ENV, capture_output=True, text=True
    )
    if test.returncode != 0:
        raise ApacheStartError(
            f"config test: `apache2 -t -f {conf_path}` failed: {(test.stderr + test.stdout).strip()}"
        )


def _launch(conf_path: Path, host: str, port: int, cpu: int | None) -> None:
    cmd = [APACHE_BIN, "-f", str(conf_path), "-k", "start"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    launch = subprocess.run(cmd, env=_APACHE_ENV, capture_output=True, text=True)
    if launch.returncode != 0:
        out = (launch.stderr + launch.stdout).strip()
        if "Address already in use" in out:
            raise PortInUseError(f"listen: port {port} on {host} is already in use: {out}")
        raise ApacheStartError(f"start: `{' '.join(cmd)}` failed (rc {launch.returncode}): {out}")


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
    cpu_priority: CpuPriority | None = None,
    mpm: str = "event",
    threads_per_child: int | None = None,
    max_connections_per_child: int = 0,
    extra_conf: str = "",
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
        silently skipped otherwise, see :attr:`ApacheInstance.autogroup_nice`). Without it other
        load on the machine stretches the PS sojourn times.
    run_user, run_group : str
        Worker account when started as root.
    graceful_timeout : int
        Seconds in-flight requests get on :func:`stop`.
    ready_timeout : float
        Seconds to wait for readiness.
    conf_dir : path, optional
        Template directory; default :data:`DEFAULT_CONF_DIR`.
    cpu_priority : CpuPriority, optional
        Build (``apxs``) and load mod_overtake_prio: per-request CPU priority of the worker
        threads, counters at ``/overtake-prio-status`` (:mod:`.cpu_priority`). Needs
        ``apache2-dev`` and a root start: the parent raises ``RLIMIT_NICE`` (or the workers
        keep ``CAP_SYS_NICE``) so that demoted www-data threads can be restored; raises
        :class:`ApacheStartError` if the module's restore self-test fails.
    mpm : str
        ``event`` (default) or ``prefork`` (:func:`~.config.render_config`).
    threads_per_child : int, optional
        mpm_event: children of this many threads instead of one child of ``max_workers``.
    max_connections_per_child, extra_conf
        ``MaxConnectionsPerChild`` and directives added as they are (:func:`~.config.render_config`).

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
    check_installed()
    host, port = parse_listen(listen)
    listen = format_listen(host, port)
    _check_start_args(max_workers, mpm, threads_per_child, cpu)
    conf = resolve_conf_dir(conf_dir)
    wd = Path(workdir).resolve()
    _check_workdir_free(wd)
    _check_port_free(host, port)
    _prepare_workdir(wd, conf, run_user, cpu_priority)
    conf_path = wd / "httpd.conf"
    conf_path.write_text(render_config(wd, listen=listen, max_workers=max_workers, run_user=run_user, run_group=run_group,
                                       graceful_timeout=graceful_timeout, conf_dir=conf, cpu_priority=cpu_priority,
                                       mpm=mpm, threads_per_child=threads_per_child,
                                       max_connections_per_child=max_connections_per_child, extra_conf=extra_conf))
    _config_test(conf_path)
    _launch(conf_path, host, port, cpu)
    pid, kids = _until_ready(wd, host, port, ready_timeout, cpu_priority)
    nice = _raise_autogroup([pid, *kids], -20) if raise_priority else None
    inst = ApacheInstance(workdir=str(wd), listen=listen, pid=pid, child_pids=tuple(kids), cpu=cpu,
                          max_workers=max_workers, autogroup_nice=nice, mpm=mpm)
    (wd / "instance.json").write_text(json.dumps(asdict(inst), indent=2) + "\n")
    return inst


def _until_ready(wd: Path, host: str, port: int, timeout: float,
                 cpu_priority: CpuPriority | None) -> tuple[int, list[int]]:
    """The parent's and children's pids once Apache serves; a failed start is killed before it raises."""
    try:
        pid, kids = _wait_ready(wd, host, port, timeout)
        if cpu_priority is not None:
            _check_cpu_priority(wd, host, port)
    except ApacheStartError:
        _kill_quietly(wd)
        raise
    return pid, kids


def _wait_ready(wd: Path, host: str, port: int, timeout: float) -> tuple[int, list[int]]:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        pid = _read_pid(wd)
        if pid is not None and not pid_alive(pid):
            raise ApacheStartError(
                f"start: Apache (pid {pid}) exited during start-up; error log: {_error_log_tail(wd)}"
            )
        if pid is not None:
            try:
                code, _, body = http_get(host, port, "/server-status?auto", 1.0)
                if code != 200 or "ServerMPM" not in body:
                    last = f"/server-status?auto answered {code}"
                else:
                    # Exercises mod_lua + tcpu.so end to end (fails if the module cannot load).
                    code, headers, body = http_get(host, port, "/stage1?work=0", 2.0)
                    if code == 200 and "x-stage-cpu-us" in headers:
                        kids = children(pid)
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


def _check_cpu_priority(wd: Path, host: str, port: int) -> None:
    """mod_overtake_prio must answer and be enabled (its child self-test passed)."""
    try:
        st = fetch_prio_status(connect_host(host), port)
    except ApacheNotRunningError as exc:
        raise ApacheStartError(f"cpu_priority: {exc}; error log: {_error_log_tail(wd)}") from None
    if not st.enabled:
        raise ApacheStartError(
            f"cpu_priority: mod_overtake_prio disabled itself in child {st.child_pid} "
            f"(RLIMIT_NICE {st.rlimit_nice}): demoted threads could not be restored; start as "
            f"root or `ulimit -e 20` first. Error log: {_error_log_tail(wd)}"
        )


def _kill_quietly(wd: Path) -> None:
    pid = _read_pid(wd)
    if pid is not None and pid_alive(pid) and _is_apache(pid):
        os.kill(pid, signal.SIGTERM)
        _wait_gone([pid], time.monotonic() + 5.0)


def _wait_gone(pids: list[int], deadline: float) -> bool:
    while True:
        if not any(pid_alive(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _check_may_signal(pid: int, wd: Path) -> None:
    try:
        os.kill(pid, 0)
    except PermissionError:
        raise ApacheError(
            f"stop: not permitted to signal Apache pid {pid} in {wd} (started by another "
            "user); run the stop as that user or as root"
        ) from None


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
    wd = existing_workdir(workdir)
    pid = _read_pid(wd)
    if pid is None or not pid_alive(pid) or not _is_apache(pid):
        # Stale pidfile (crash, reboot, PID reuse): never signal a PID that is not Apache.
        (wd / "run" / "httpd.pid").unlink(missing_ok=True)
        return False
    procs = [pid, *children(pid)]
    start_t = time.monotonic()
    _check_may_signal(pid, wd)
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
        alive = [p for p in procs if pid_alive(p)]
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
    """:func:`~.mod_status.fetch_status` of the instance recorded in ``workdir`` (by :func:`start`).

    Raises
    ------
    ApacheInputError
        ``workdir`` does not exist.
    ApacheNotRunningError
        No instance recorded in ``workdir`` or it does not answer.
    """
    wd = existing_workdir(workdir)
    return fetch_status(load_instance(wd).listen, timeout=timeout)
