"""overtake.controller.harness.apache.cpu_priority and mod_overtake_prio (per-request CPU
priority of Apache's worker threads) on a real Apache.

The thread states are read from the kernel (/proc/<child>/task/<tid>/stat: nice = field 19,
policy = field 41, SCHED_IDLE = 5) while requests run, and the module's counters from
/overtake-prio-status. The known answers are the configured thresholds: with levels
(5 ms, 50 ms) of thread CPU, a 1 ms request stays at level 0, a 20 ms request ends at level
1, a 200 ms request reaches level 2 (SCHED_IDLE); after every request -- normal end, handler
error, client abort, graceful restart -- every thread is back at Apache's own nice value and
SCHED_OTHER.

Needs Debian's apache2, apache2-dev (apxs), liblua5.3-dev and gcc (installed on the fly as
root by apache-conf/install-debian-packages.sh), and root: the workers run as www-data and
the module needs RLIMIT_NICE or CAP_SYS_NICE to restore them.
"""

from __future__ import annotations

import http.client
import itertools
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from prio_helpers import ended_since, refusal
from support.private_apache import private_apache

from overtake.controller.errors import ApacheInputError, ApacheStartError
from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import (
    CpuPriority,
    PrioStatus,
    config_tokens,
    fetch_prio_status,
    parse_prio_status,
)
from overtake.controller.harness.apache.lifecycle import children, pid_alive
from overtake.controller.harness.loadgen import get
from overtake.controller.harness.scratch import free_port, scratch_dir

T = TypeVar("T")
IS_ROOT = os.geteuid() == 0
SCHED_OTHER, SCHED_IDLE = 0, 5
CAP_SYS_NICE_MASK = 1 << 23
needs_root = pytest.mark.skipif(
    not IS_ROOT, reason="Apache must start as root: workers run as www-data, the module keeps "
    "RLIMIT_NICE/CAP_SYS_NICE from the root parent"
)

# A handler that burns ?work seconds of thread CPU and then fails (mod_lua answers 500).
CRASH_LUA = """local tcpu = require "tcpu"
function handle(r)
    local work = tonumber(r:parseargs().work or "0") or 0
    local target = tcpu.now_ns() + math.floor(work * 1e9)
    local x = 0
    while tcpu.now_ns() < target do for i = 1, 500 do x = x + (i % 7) end end
    error("crash.lua: deliberate handler error after " .. work .. " s of CPU")
end
"""


# --------------------------------------------------------------------------- helpers


def _server_core() -> int | None:
    cores = sorted(os.sched_getaffinity(0))
    return cores[-1] if len(cores) > 1 else None


def _stat_fields(path: str) -> list[str]:
    return Path(path).read_text().rsplit(")", 1)[1].split()


def _nice_policy(pid: int, tid: int | str) -> tuple[int, int]:
    f = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
    return int(f[16]), int(f[38])


def _threads(pid: int) -> dict[int, tuple[int, int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = _nice_policy(pid, tid)
        except (OSError, IndexError):
            continue  # thread exited meanwhile
    return out


def _base_nice(inst: apache.ApacheInstance) -> int:
    """Apache's own nice value: the launcher's, inherited by every thread (pytest runs niced)."""
    return int(_stat_fields(f"/proc/{inst.pid}/stat")[16])


def _demoted(inst: apache.ApacheInstance) -> dict[tuple[int, int], tuple[int, int]]:
    """(child, tid) -> (nice, policy) for every thread not at Apache's own priority."""
    base = (_base_nice(inst), SCHED_OTHER)
    out = {}
    for kid in children(inst.pid):
        for tid, st in _threads(kid).items():
            if st != base:
                out[(kid, tid)] = st
    return out


def _status(inst: apache.ApacheInstance) -> PrioStatus:
    host, port = apache.parse_listen(inst.listen)
    return fetch_prio_status(host, port)


def _get(inst: apache.ApacheInstance, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    host, port = apache.parse_listen(inst.listen)
    return get(port, path, headers, host=host)


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def _ended_at(inst: apache.ApacheInstance, level: int, count: int) -> None:
    """Wait until ``count`` requests in all have ended at ``level``."""
    _wait(lambda: _status(inst).requests[level] >= count, 15, f"{count} requests ended at level {level}")


def _watch(
    inst: apache.ApacheInstance, run: Callable[[], T], *, poll: float = 0.001
) -> tuple[T, dict[int, list[tuple[int, int]]]]:
    """Run ``run()`` in a thread; meanwhile record each demoted thread's distinct states."""
    seen: dict[int, list[tuple[int, int]]] = {}
    box: dict[str, T] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", run()))
    t.start()
    while t.is_alive():
        for (_, tid), st in _demoted(inst).items():
            states = seen.setdefault(tid, [])
            if not states or states[-1] != st:
                states.append(st)
        time.sleep(poll)
    t.join()
    return box["r"], seen


def _workdir_parent() -> Path:
    return scratch_dir("overtake-prio-test-")


def _conf_with_crash(parent: Path) -> Path:
    """apache-conf/ plus /crash: burns ?work s of thread CPU, then raises a Lua error."""
    conf = parent / "conf"
    shutil.copytree(apache.DEFAULT_CONF_DIR, conf, ignore=shutil.ignore_patterns("__pycache__"))
    (conf / "lua" / "crash.lua").write_text(CRASH_LUA)
    with (conf / "httpd.conf.in").open("a") as f:
        f.write('\nLuaMapHandler "^/crash$" "@APACHE_DIR@/lua/crash.lua" handle\n')
    return conf


@pytest.fixture(scope="module")
def apxs_available(apache_available: None) -> None:
    if shutil.which("apxs") is None:
        if not IS_ROOT:
            pytest.skip("apxs (apache2-dev) not installed and not root: run "
                        "`sudo apache-conf/install-debian-packages.sh`")
        installer = Path(__file__).resolve().parents[3] / "apache-conf" / "install-debian-packages.sh"
        subprocess.run(["sh", str(installer)], check=True)
        assert shutil.which("apxs"), "install-debian-packages.sh ran but apxs is still missing"


@pytest.fixture(scope="module")
def inst(apxs_available: None) -> Iterator[apache.ApacheInstance]:
    if not IS_ROOT:
        pytest.skip("needs root (see module docstring)")
    prio = CpuPriority(levels=(0.005, 0.05), nice=(10, "idle"))
    with private_apache("overtake-prio-test-", prio, max_workers=16, conf=_conf_with_crash) as i:
        yield i


@pytest.fixture
def clean(inst: apache.ApacheInstance) -> Iterator[apache.ApacheInstance]:
    """Every test starts and must end with no demoted thread."""
    _wait(lambda: not _demoted(inst), 10, "a clean start")
    yield inst
    assert not _demoted(inst), "a thread was left demoted"


# --------------------------------------------------------------------------- settings (no Apache)


def test_cpu_priority_defaults_and_tokens() -> None:
    cp = CpuPriority()
    assert cp.levels == (0.005, 0.05) and cp.priorities == (10, "idle")
    assert CpuPriority(levels=(0.01, 0.1, 1.0)).priorities == (10, 10, "idle")
    tok = config_tokens(cp)
    assert tok["CPU_PRIO_DEFINE"] == "Define OVERTAKE_CPU_PRIO"
    assert (tok["CPU_PRIO_LEVELS"], tok["CPU_PRIO_NICE"]) == ("0.005 0.05", "10 idle")
    assert tok["CPU_PRIO_CLASS_HEADER"] == "X-Overtake-Class"
    assert tok["CPU_PRIO_RESOLUTION"] == "0.001" and config_tokens(CpuPriority(cpu_resolution=0))[
        "CPU_PRIO_RESOLUTION"] == "0.0"
    assert config_tokens(None)["CPU_PRIO_DEFINE"].startswith("#")
    assert config_tokens(CpuPriority(class_header=None, age=False))["CPU_PRIO_CLASS_HEADER"] == "none"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"levels": ()}, "cpu_priority.levels"),
        ({"levels": (0.05, 0.005)}, "strictly increasing"),
        ({"levels": (0.0,)}, "cpu_priority.levels"),
        ({"levels": (float("nan"),)}, "not a number"),
        ({"nice": (10,)}, "one value per level"),
        ({"nice": ("idle", 10)}, "only be the last"),
        ({"nice": (0, "idle")}, "1..19"),
        ({"nice": (19, 10)}, "must not rise"),
        ({"interval": 0.0}, "cpu_priority.interval"),
        ({"cpu_resolution": -0.001}, "cpu_priority.cpu_resolution"),
        ({"cpu_resolution": 0.5}, "cpu_priority.cpu_resolution"),
        ({"cpu_resolution": True}, "cpu_priority.cpu_resolution"),
        ({"class_header": "X Bad"}, "cpu_priority.class_header"),
        ({"cap_sys_nice": "yes"}, "cpu_priority.cap_sys_nice"),
        ({"control_file": "/dev/shm/x", "stages": (("a", "^/a$"),), "stage_next": (("a", "b"),)},
         "cpu_priority.stage_next"),
        ({"control_file": "/dev/shm/x", "stages": (("a", "^/a$"),), "stage_next": (("a", "a"),)},
         "cpu_priority.stage_next"),
        ({"control_file": "/dev/shm/x", "stages": (("a", "^/a$"),), "stage_follow_up": 0.0},
         "cpu_priority.stage_follow_up"),
        ({"control_file": "/dev/shm/x", "stages": (("a", "^/a$"),), "stage_abort_on_close": "on"},
         "cpu_priority.stage_abort_on_close"),
        ({"control_file": "/dev/shm/x", "stages": (("a", "^/a$"),), "stage_lifo_after": -1.0},
         "cpu_priority.stage_lifo_after"),
        ({"stage_prefixes": (("a", "/a/"),)}, "give control_file too"),
        ({"control_file": "/dev/shm/x", "stage_prefixes": (("a", "^/a/"),)}, "must be a literal URL path"),
        ({"control_file": "/dev/shm/x", "stage_prefixes": (("a", "/a/", "get"),)}, "is not an HTTP method"),
        ({"control_file": "/dev/shm/x", "stage_prefixes": (("a/b", "/a/"),)}, "stage name 'a/b'"),
        ({"control_file": "/dev/shm/x", "stage_prefixes": (("a", "/a/"), ("b", "/a/"))}, "given twice"),
        ({"control_file": "/dev/shm/x", "stage_prefixes": (("a", "/a/"), ("none", "/a/b")),
          "stage_next": (("a", "none"),)}, "cpu_priority.stage_next"),
    ],
)
def test_cpu_priority_rejects_bad_input(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ApacheInputError, match=field):
        CpuPriority(**kwargs)  # type: ignore[arg-type]


def test_render_config_loads_module_only_when_asked(tmp_path: Path) -> None:
    off = apache.render_config(tmp_path, listen="127.0.0.1:8081", max_workers=4)
    on = apache.render_config(
        tmp_path, listen="127.0.0.1:8081", max_workers=4, cpu_priority=CpuPriority(levels=(0.002,))
    )
    assert "\nDefine OVERTAKE_CPU_PRIO\n" not in off and "\nDefine OVERTAKE_CPU_PRIO\n" in on
    assert "OvertakePrioLevels 0.002\n" in on and "OvertakePrioNice idle\n" in on
    assert "@" not in on.replace("%{", "")  # every token substituted
    staged = apache.render_config(tmp_path, listen="127.0.0.1:8081", max_workers=4, cpu_priority=CpuPriority(
        control_file="/dev/shm/x", stage_prefixes=(("a", "/a/"), ("b", "/a/b", "POST"))))
    assert '\n    OvertakeStagePrefix "/a/" a\n' in staged and '\n    OvertakeStagePrefix "/a/b" b POST\n' in staged
    assert "LocationMatch" not in staged.split("OvertakeStagePrefix", 1)[1]  # no section for a prefix


STATUS_SAMPLE = """# HELP overtake_cpu_prio_enabled x
# TYPE overtake_cpu_prio_enabled gauge
overtake_cpu_prio_enabled 1
# TYPE overtake_cpu_prio_levels gauge
overtake_cpu_prio_levels 2
# TYPE overtake_cpu_prio_level_threshold_seconds gauge
overtake_cpu_prio_level_threshold_seconds{level="1"} 0.005
overtake_cpu_prio_level_threshold_seconds{level="2"} 0.05
# TYPE overtake_cpu_prio_in_flight gauge
overtake_cpu_prio_in_flight{level="0"} 1
overtake_cpu_prio_in_flight{level="1"} 0
overtake_cpu_prio_in_flight{level="2"} 3
# TYPE overtake_cpu_prio_requests_total counter
overtake_cpu_prio_requests_total{level="0"} 10
overtake_cpu_prio_requests_total{level="1"} 4
overtake_cpu_prio_requests_total{level="2"} 2
# TYPE overtake_cpu_prio_demotions_total counter
overtake_cpu_prio_demotions_total{level="1",cause="age"} 6
overtake_cpu_prio_demotions_total{level="1",cause="class"} 1
overtake_cpu_prio_demotions_total{level="2",cause="age"} 5
overtake_cpu_prio_demotions_total{level="2",cause="class"} 0
# TYPE overtake_cpu_prio_restores_total counter
overtake_cpu_prio_restores_total 6
# TYPE overtake_cpu_prio_child_pid gauge
overtake_cpu_prio_child_pid 1234
"""


def test_parse_prio_status_sample() -> None:
    st = parse_prio_status(STATUS_SAMPLE)
    assert st.enabled and st.levels == 2 and st.thresholds == (0.005, 0.05)
    assert st.in_flight == (1, 0, 3) and st.requests == (10, 4, 2)
    assert st.demotions_age == (0, 6, 5) and st.demotions_class == (0, 1, 0)
    assert st.restores == 6 and st.child_pid == 1234 and st.restore_errors == 0


# --------------------------------------------------------------------------- directives (apache2 -t)


@pytest.mark.parametrize(
    ("directives", "message"),
    [
        ("OvertakePrioLevels 0.05 0.005", "strictly increasing"),
        ("OvertakePrioLevels fast", "must be seconds"),
        ("OvertakePrioNice idle 10", "can only be the last level"),
        ("OvertakePrioNice 25 idle", "nice increment in 1..19"),
        ("OvertakePrioLevels 0.01\nOvertakePrioNice 10 idle", "2 values for 1 levels"),
        ("OvertakePrioInterval 5", "OvertakePrioInterval"),
        ("OvertakePrioCpuResolution 1", "OvertakePrioCpuResolution"),
        ("OvertakePrioCpuResolution -0.1", "OvertakePrioCpuResolution"),
        ("OvertakePrioCapSysNice maybe", "auto, on or off"),
        # the words of a per-level directive (op_pure.c) and the messages that name the refused one
        ("OvertakePrioLevels", "OvertakePrioLevels: give one or more thread-CPU thresholds"),
        ("OvertakePrioLevels 1 2 3 4 5 6 7 8 9", "OvertakePrioLevels: at most 8 levels"),
        ("OvertakePrioLevels 0.005 1e999", "OvertakePrioLevels: '1e999' must be seconds in [0, 3600]"),
        ("OvertakePrioLevels 0.005x", "OvertakePrioLevels: '0.005x' must be seconds in [0, 3600]"),
        ("OvertakePrioLevels 0.01 0.02 0.002", "strictly increasing, got 0.002 after .02"),
        ("OvertakePrioNice", "OvertakePrioNice: give one nice increment (1..19) or 'idle' per level"),
        ("OvertakePrioNice 1 2 3 4 5 6 7 8 9", "OvertakePrioNice: at most 8 levels"),
        ("OvertakePrioNice 10 5", "must not rise in priority, got nice 5 after 10"),
        ("OvertakePrioNice 10x idle", "OvertakePrioNice: '10x' must be a nice increment"),
        ("OvertakePrioRlimitNice 41", "OvertakePrioRlimitNice: '41' must be in 0..40"),
        ("OvertakeGate relative/path", "OvertakeGate: 'relative/path' must be an absolute path"),
        ("OvertakeStageNext a a", "OvertakeStageNext: 'a' cannot follow itself"),
        ("OvertakeStageNext a b\nOvertakeStageNext a c", "OvertakeStageNext: 'a' already has next stage 'b'"),
        ("OvertakeStageNext a b/c", "OvertakeStageNext: 'b/c' is not a stage name"),
        ("OvertakeStageFollowUp 0", "OvertakeStageFollowUp: '0' must be seconds in [0.0001, 60]"),
        ("OvertakeStageAbortOnClose maybe", "OvertakeStageAbortOnClose must be On or Off"),
        ("OvertakeStageLifoAfter soon", "OvertakeStageLifoAfter: 'soon' must be seconds in [0, 3600]"),
    ],
)
def test_directives_rejected_by_config_test(
    inst: apache.ApacheInstance, tmp_path: Path, directives: str, message: str
) -> None:
    assert message in refusal(inst.workdir, tmp_path, directives)


# --------------------------------------------------------------------------- demotion and restore


@needs_root
def test_module_is_loaded_with_a_monitor_thread(clean: apache.ApacheInstance) -> None:
    st = _status(clean)
    assert st.enabled and st.levels == 2 and st.thresholds == (0.005, 0.05)
    kid = st.child_pid
    names = [Path(f"/proc/{kid}/task/{t}/comm").read_text().strip() for t in os.listdir(f"/proc/{kid}/task")]
    assert names.count("overtake-prio") == 1
    buckets = st.monitor_late_buckets  # cumulative Prometheus histogram of pass delays
    assert buckets[-1][0] == float("inf") and buckets[-1][1] >= 1
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets))
    # Idle, the monitor waits without a deadline (it used to wake once per first threshold:
    # ~40 times in 0.2 s); the status requests themselves wake it at most a few times.
    time.sleep(0.05)
    ticks = _status(clean).monitor_ticks
    time.sleep(0.2)
    n = _status(clean).monitor_ticks - ticks
    assert n <= 4, n
    # ... and the first request after the idle spell wakes it: a 20 ms request is demoted at 5 ms
    before = _status(clean)
    assert _get(clean, "/stage1?work=0.02")[0] == 200
    after = _status(clean)
    assert after.requests[1] - before.requests[1] == 1 and after.demotions_age[1] - before.demotions_age[1] == 1


def _task_switches(pid: int, tid: str) -> int:
    fields = dict(line.split(":\t") for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
                  if ":\t" in line)
    return int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])


@needs_root
def test_busy_child_passes_at_request_starts(clean: apache.ApacheInstance) -> None:
    """Under a stream of requests the monitor's passes are made by request starts and its thread
    sleeps through (each of its wake-ups would preempt a worker); a long request is still demoted
    level by level. The monitor used to wake for every pass."""
    if shutil.which("wrk") is None:
        pytest.skip("wrk not installed: run apache-conf/install-debian-packages.sh")
    kid = _status(clean).child_pid
    mon = next(t for t in os.listdir(f"/proc/{kid}/task")
               if Path(f"/proc/{kid}/task/{t}/comm").read_text().strip() == "overtake-prio")
    before, wakes0 = _status(clean), _task_switches(kid, mon)
    stream = subprocess.Popen(["wrk", "-t1", "-c8", "-d2s", f"{clean.base_url}/static/hello.txt"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        assert _get(clean, "/stage1?work=0.08")[0] == 200  # crosses 5 ms and 50 ms of CPU
    finally:
        stream.wait(timeout=30)
    after, wakes = _status(clean), _task_switches(kid, mon) - wakes0
    passes = after.monitor_ticks - before.monitor_ticks
    assert after.demotions_age[1] - before.demotions_age[1] >= 1
    assert after.demotions_age[2] - before.demotions_age[2] >= 1
    assert passes >= 100, passes  # a pass every few ms over 2 s of requests
    assert wakes * 5 <= passes, (wakes, passes)


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length from a keep-alive socket; its body."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed in the headers: {head!r}"
        head += chunk
    head, body = head.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = sock.recv(1 << 20)
        assert chunk, "connection closed in the body"
        body += chunk
    return body


@needs_root
def test_restored_at_the_end_of_the_body_before_the_client_reads_it(clean: apache.ApacheInstance) -> None:
    """A request is restored when its body is complete (EOS), before the network write: a
    client that has not read a large response yet finds no thread demoted, though the request
    has not ended (the write is pending). Twice on one keep-alive connection: the end filter is
    the connection's, and each request sets it to its own record."""
    big = Path(clean.workdir) / "htdocs" / "static" / "overtake-big.bin"
    # 16 MiB: more than the two sockets' buffers hold (the receive side's fixed at 64 KiB, the
    # send side's grows to 4 MiB at most), so the write is still pending while the test looks
    big.write_bytes(os.urandom(1 << 16) * 256)
    sock = socket.create_connection(apache.parse_listen(clean.listen), timeout=30)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        for _ in range(2):
            before = _status(clean)
            sock.sendall(b"GET /static/overtake-big.bin HTTP/1.1\r\nHost: t\r\n"
                         b"X-Overtake-Class: 2\r\n\r\n")  # starts demoted
            _wait(lambda b=before: _status(clean).restores > b.restores, 10, "the restore at EOS")
            mid = _status(clean)
            assert mid.demotions_class[2] - before.demotions_class[2] == 1
            assert not _demoted(clean)
            assert len(_read_response(sock)) == big.stat().st_size
    finally:
        sock.close()
        big.unlink()


@needs_root
def test_long_request_demoted_level_by_level_then_restored(clean: apache.ApacheInstance) -> None:
    base = _base_nice(clean)
    before = _status(clean)
    (code, body), seen = _watch(clean, lambda: _get(clean, "/stage1?work=0.2"))
    assert code == 200 and b"ok" in body
    # Right after the response (restored before the last write): nothing demoted.
    assert not _demoted(clean)
    assert len(seen) == 1, f"expected one demoted worker thread, saw {seen}"
    (states,) = seen.values()
    level1, level2 = (min(base + 10, 19), SCHED_OTHER), (min(base + 10, 19), SCHED_IDLE)
    # Level 1 lasts 45 ms of CPU; a poller starved by a loaded machine may miss it (the
    # counters below still show both entries), but never sees anything else or another order.
    assert states in ([level1, level2], [level2]), states
    after = _status(clean)
    assert after.requests[2] - before.requests[2] == 1
    assert after.demotions_age[1] - before.demotions_age[1] == 1
    assert after.demotions_age[2] - before.demotions_age[2] == 1
    assert after.restores - before.restores == 1 and after.restore_errors == 0
    assert after.demote_errors == 0


@needs_root
@pytest.mark.parametrize(("work", "level"), [(0.001, 0), (0.003, 0), (0.007, 1), (0.02, 1), (0.12, 2)])
def test_final_level_follows_thresholds(clean: apache.ApacheInstance, work: float, level: int) -> None:
    before = _status(clean)
    assert _get(clean, f"/stage1?work={work}")[0] == 200
    _, diff = ended_since(lambda: _status(clean), before, 1)
    assert diff == [int(k == level) for k in range(3)], (work, diff)


@needs_root
def test_static_files_are_tracked(clean: apache.ApacheInstance) -> None:
    before = _status(clean)
    for _ in range(5):
        assert _get(clean, "/static/hello.txt")[0] == 200
    after = _status(clean)
    assert after.requests[0] - before.requests[0] == 5 + 1  # + the status request
    assert after.untracked == 0


@needs_root
def test_class_header_starts_request_at_level(clean: apache.ApacheInstance) -> None:
    base = _base_nice(clean)
    before = _status(clean)
    (code, _), seen = _watch(clean, lambda: _get(clean, "/stage1?work=0.1", {"X-Overtake-Class": "2"}))
    assert code == 200
    # Never seen at level 0 or 1: SCHED_IDLE from the start (the nice value is untouched).
    assert list(seen.values()) == [[(base, SCHED_IDLE)]], seen
    mid = _status(clean)
    assert mid.demotions_class[2] - before.demotions_class[2] == 1
    assert mid.demotions_age[1:] == before.demotions_age[1:]
    assert mid.requests[2] - before.requests[2] == 1

    # Class 1, then age: 1 -> 2 (entering level 2 by attained CPU).
    assert _get(clean, "/stage1?work=0.08", {"X-Overtake-Class": "1"})[0] == 200
    st = _status(clean)
    assert st.demotions_class[1] - mid.demotions_class[1] == 1
    assert st.demotions_age[2] - mid.demotions_age[2] == 1
    assert st.demotions_age[1] == mid.demotions_age[1]


@needs_root
@pytest.mark.parametrize("value", ["3", "-1", "high", ""])
def test_invalid_class_header_is_counted_and_ignored(clean: apache.ApacheInstance, value: str) -> None:
    before = _status(clean)
    assert _get(clean, "/stage1?work=0.001", {"X-Overtake-Class": value})[0] == 200
    after = _status(clean)
    assert after.class_invalid - before.class_invalid == 1
    assert after.requests[0] - before.requests[0] == 2  # the request and the status request


@needs_root
def test_handler_error_after_demotion_restores(clean: apache.ApacheInstance) -> None:
    before = _status(clean)
    (code, _), seen = _watch(clean, lambda: _get(clean, "/crash?work=0.2"))
    assert code == 500
    assert seen and all(s[-1][1] == SCHED_IDLE for s in seen.values()), seen
    after = _status(clean)
    assert after.requests[2] - before.requests[2] == 1
    assert after.restores - before.restores == 1
    assert "deliberate handler error" in Path(clean.error_log).read_text()


@needs_root
@pytest.mark.parametrize(("path", "code"), [("/static/missing.txt", 404), ("/stage1", 400)])
def test_error_responses_of_a_demoted_class_restore(
    clean: apache.ApacheInstance, path: str, code: int
) -> None:
    before = _status(clean)
    assert _get(clean, path, {"X-Overtake-Class": "2"})[0] == code
    after = _status(clean)
    assert after.demotions_class[2] - before.demotions_class[2] == 1
    assert after.restores - before.restores == 1


@needs_root
def test_client_abort_mid_request_restores(clean: apache.ApacheInstance) -> None:
    before = _status(clean)
    host, port = apache.parse_listen(clean.listen)
    with socket.create_connection((host, port)) as s:
        s.sendall(b"GET /stage1?work=0.25 HTTP/1.1\r\nHost: t\r\n\r\n")
        _wait(lambda: any(p == SCHED_IDLE for _, p in _demoted(clean).values()), 10, "demotion to SCHED_IDLE")
        # RST instead of FIN: the handler keeps burning, then writes into a dead connection.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _ended_at(clean, 2, before.requests[2] + 1)
    after = _status(clean)
    assert after.requests[2] - before.requests[2] == 1
    assert after.restores - before.restores == 1


@needs_root
def test_keepalive_requests_on_one_connection(clean: apache.ApacheInstance) -> None:
    """A demoted request and a short one on the same connection (and thread): the short one
    runs at full priority."""
    host, port = apache.parse_listen(clean.listen)
    before = _status(clean)
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        for path in ("/stage1?work=0.06", "/stage1?work=0.001", "/stage1?work=0.06"):
            conn.request("GET", path)
            r = conn.getresponse()
            assert r.status == 200
            r.read()
            assert not _demoted(clean)
    finally:
        conn.close()
    _, ended = ended_since(lambda: _status(clean), before, 3)
    assert ended == [1, 0, 2]  # the short one at level 0


@needs_root
def test_workers_run_as_www_data_and_can_restore(clean: apache.ApacheInstance) -> None:
    """The restore path the workers (www-data, no root) rely on: RLIMIT_NICE >= 20, or where
    it cannot be raised (root without CAP_SYS_RESOURCE), CAP_SYS_NICE and nothing else."""
    st = _status(clean)
    status = Path(f"/proc/{st.child_pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Uid"].split()[1] == "33"  # effective uid www-data
    cap_eff = int(fields["CapEff"], 16)
    if st.rlimit_nice >= 20:
        assert cap_eff == 0
    else:
        assert cap_eff == CAP_SYS_NICE_MASK and int(fields["CapPrm"], 16) == CAP_SYS_NICE_MASK


def _can_raise_rlimit_nice() -> bool:
    r = subprocess.run(
        [sys.executable, "-c", "import resource; resource.setrlimit(resource.RLIMIT_NICE, (20, 20))"],
        capture_output=True,
        check=False,
    )
    return r.returncode == 0


@needs_root
def test_rlimit_nice_lets_www_data_thread_return(apxs_available: None) -> None:
    """With OvertakePrioCapSysNice off the only way back is RLIMIT_NICE, raised by the root
    parent: a demoted www-data thread returns to Apache's nice value."""
    if not _can_raise_rlimit_nice():
        pytest.skip(
            "root here lacks CAP_SYS_RESOURCE (CapEff bit 24), so RLIMIT_NICE's hard limit "
            f"({resource.getrlimit(resource.RLIMIT_NICE)[1]}) cannot be raised and the RLIMIT_NICE path "
            "cannot run; test_without_restore_rights_module_refuses_to_start and "
            "test_workers_run_as_www_data_and_can_restore cover this machine"
        )
    parent = _workdir_parent()
    i = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=_server_core(), max_workers=8,
                     cpu_priority=CpuPriority(cap_sys_nice="off"))
    try:
        st = _status(i)
        assert st.enabled and st.rlimit_nice >= 20
        (code, _), seen = _watch(i, lambda: _get(i, "/stage1?work=0.1"))
        assert code == 200 and seen
        assert not _demoted(i)
        assert _status(i).restore_errors == 0
    finally:
        apache.stop(i.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


@needs_root
def test_without_restore_rights_module_refuses_to_start(apxs_available: None) -> None:
    """No CAP_SYS_NICE and an RLIMIT_NICE that cannot be raised: the child's self-test fails,
    it never demotes, and start() says why."""
    if _can_raise_rlimit_nice():
        pytest.skip("RLIMIT_NICE can be raised here: the restore rights exist (see the test above)")
    parent = _workdir_parent()
    try:
        with pytest.raises(ApacheStartError, match=r"disabled itself .*RLIMIT_NICE 0"):
            apache.start(parent / "wd", f"127.0.0.1:{free_port()}", max_workers=4,
                         cpu_priority=CpuPriority(cap_sys_nice="off"))
        assert "leaving SCHED_IDLE" in (parent / "wd" / "logs" / "error.log").read_text()
    finally:
        apache.stop(parent / "wd", graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


@needs_root
def test_class_only_mode(apxs_available: None) -> None:
    """age=False: no monitor thread, long requests keep their priority, the header still works."""
    parent = _workdir_parent()
    i = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=_server_core(), max_workers=8,
                     cpu_priority=CpuPriority(levels=(0.005,), age=False))
    try:
        kid = _status(i).child_pid
        comms = [Path(f"/proc/{kid}/task/{t}/comm").read_text().strip() for t in os.listdir(f"/proc/{kid}/task")]
        assert "overtake-prio" not in comms
        (_, seen) = _watch(i, lambda: _get(i, "/stage1?work=0.1"))
        assert seen == {}
        base = _base_nice(i)
        (_, seen) = _watch(i, lambda: _get(i, "/stage1?work=0.1", {"X-Overtake-Class": "1"}))
        assert list(seen.values()) == [[(base, SCHED_IDLE)]]
        assert not _demoted(i)
    finally:
        apache.stop(i.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


def _keepalive_gets(inst: apache.ApacheInstance, paths: list[str]) -> None:
    host, port = apache.parse_listen(inst.listen)
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        for path in paths:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, (path, resp.status)
    finally:
        conn.close()


@needs_root
@pytest.mark.parametrize("resolution", [0.0, 0.1])
def test_cpu_clock_reads_and_the_overcount_bound(apxs_available: None, resolution: float) -> None:
    """The thread CPU clock is read at most once per ``cpu_resolution`` of a thread's time:
    with 0, at every request; with 0.1 s, a 0.01 s request and the next one on the same
    keep-alive connection (the same worker thread: the event MPM reuses the last idle one)
    share a reading. Attained CPU is then overcounted by less than the
    resolution, never more: a 0.19 s request after a 0.01 s one on the same thread is never
    demoted at a 0.3 s threshold (a reading kept for longer than the resolution would charge it
    the earlier request's CPU), and a 0.32 s one always is."""
    parent = _workdir_parent()
    i = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=_server_core(), max_workers=4,
                     cpu_priority=CpuPriority(levels=(0.3,), nice=("idle",), cpu_resolution=resolution))
    try:
        before = _status(i)
        assert before.cpu_resolution == resolution
        pairs = 8  # a short request, then one that a reading kept too long would push over 0.3 s
        _keepalive_gets(i, ["/stage1?work=0.01", "/stage1?work=0.19"] * pairs + ["/stage1?work=0.32"])
        after = _status(i)
        # the status requests: the first has ended by `after`, each has read the clock at its start
        ended = sum(after.requests) - sum(before.requests) - 1
        reads = after.clock_reads - before.clock_reads - 1
        assert after.requests[1] - before.requests[1] == 1, "only the 0.32 s request reaches level 1"
        assert ended == 2 * pairs + 1
        if resolution == 0.0:
            assert reads == ended
        else:
            assert reads < ended, (reads, ended)
        assert not _demoted(i)
    finally:
        apache.stop(i.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


@needs_root
def test_graceful_restart_while_demoted(apxs_available: None) -> None:
    """The old child finishes the demoted request (restored) and exits; the new child starts
    with every thread at Apache's priority and demotes again; counters survive the restart."""
    parent = _workdir_parent()
    i = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=_server_core(), max_workers=8,
                     cpu_priority=CpuPriority())
    try:
        old_kids = children(i.pid)
        box: dict[str, tuple[int, bytes]] = {}
        t = threading.Thread(target=lambda: box.setdefault("r", _get(i, "/stage1?work=0.3")))
        t.start()
        _wait(lambda: any(p == SCHED_IDLE for _, p in _demoted(i).values()), 10, "demotion")
        ended = sum(_status(i).requests)
        os.kill(i.pid, signal.SIGUSR1)  # graceful restart
        t.join(30)
        assert box["r"][0] == 200
        _wait(lambda: not any(pid_alive(k) for k in old_kids), 20, "the old child to exit")
        _wait(lambda: bool(children(i.pid)), 10, "a new child")
        assert not _demoted(i)
        st = _status(i)
        assert st.enabled and st.child_pid not in old_kids
        assert sum(st.requests) >= ended + 1  # shared counters kept across the restart
        (code, _), seen = _watch(i, lambda: _get(i, "/stage1?work=0.15"))
        assert code == 200 and seen
        assert not _demoted(i)
        # Graceful stop: the child's exit stops the monitor at once (it is woken, not polled).
        t0 = time.monotonic()
        assert apache.stop(i.workdir, graceful=True)
        assert time.monotonic() - t0 < 4.0
    finally:
        apache.stop(i.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


@needs_root
def test_child_killed_while_demoted_replacement_starts_clean(apxs_available: None) -> None:
    """A child that dies mid-request (SIGKILL: no cleanup runs) takes its demoted thread with
    it; the child the parent forks in its place starts every thread at Apache's priority."""
    parent = _workdir_parent()
    i = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=_server_core(), max_workers=8,
                     cpu_priority=CpuPriority())
    try:
        (old,) = children(i.pid)
        host, port = apache.parse_listen(i.listen)
        s = socket.create_connection((host, port))
        s.sendall(b"GET /stage1?work=0.5 HTTP/1.1\r\nHost: t\r\n\r\n")
        _wait(lambda: any(p == SCHED_IDLE for _, p in _demoted(i).values()), 10, "demotion")
        os.kill(old, signal.SIGKILL)
        s.close()
        _wait(lambda: bool(set(children(i.pid)) - {old}), 15, "a replacement child")
        assert not _demoted(i)
        st = _status(i)
        assert st.enabled and st.child_pid != old and sum(st.in_flight) == 1  # the status request
        (code, _), seen = _watch(i, lambda: _get(i, "/stage1?work=0.15"))
        assert code == 200 and seen and not _demoted(i)
    finally:
        apache.stop(i.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)
