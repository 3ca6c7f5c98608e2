"""mod_overtake_prio's admission gate (``OvertakeGate``) on a real Apache.

Known answers: a request carrying ``X-Overtake-Gate: SLOT GEN`` does not run until the sidecar's
:class:`~overtake.controller.sidecar.gate.Gate` opens that slot (its response comes only after
:meth:`Gate.open`); a cancelled or stale slot answers 503 at once; a malformed header or a slot
beyond the file answers 400; a gate that never opens lets the request through after
``OvertakeGateTimeout``; a closed connection frees the worker within a 100 ms slice; without the
file, gated requests pass at once. The sidecar's side: tests/controller/sidecar/test_sidecar_gate.py.
"""

from __future__ import annotations

import argparse
import functools
import grp
import http.client
import os
import shutil
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import CpuPriority, PrioStatus, fetch_prio_status
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.controller.sidecar.gate import Gate

GATE_TIMEOUT = 1.5  # the gate_apache fixture's (tests/controller/conftest.py)


def _core() -> int | None:
    cores = sorted(os.sched_getaffinity(0))
    return cores[-1] if len(cores) > 1 else None


@pytest.fixture(scope="module")
def gated(gate_apache: tuple[apache.ApacheInstance, str]) -> Iterator[tuple[apache.ApacheInstance, Gate]]:
    inst, path = gate_apache
    gate = Gate(path, 16)
    try:
        yield inst, gate
    finally:
        gate.close()


def _status(inst: apache.ApacheInstance) -> PrioStatus:
    return fetch_prio_status(*apache.parse_listen(inst.listen))


def _get(inst: apache.ApacheInstance, path: str, gate: bytes | None, timeout: float = 10) -> tuple[int, float]:
    host, port = apache.parse_listen(inst.listen)
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.monotonic()
    try:
        c.request("GET", path, headers={"X-Overtake-Gate": gate.decode()} if gate is not None else {})
        r = c.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    finally:
        c.close()


def _in_background(fn) -> tuple[threading.Thread, dict[str, object]]:  # type: ignore[no-untyped-def]
    out: dict[str, object] = {}

    def run() -> None:
        out["result"] = fn()

    th = threading.Thread(target=run)
    th.start()
    return th, out


def test_gate_settings_and_tokens() -> None:
    """No Apache: the directive is rendered only with a gate, bad values name the field."""
    from overtake.api.commands.apache import _cpu_priority
    from overtake.controller.errors import ApacheInputError
    from overtake.controller.harness.apache.cpu_priority import config_tokens

    tok = config_tokens(CpuPriority(levels=(0.02,), gate="/dev/shm/g", gate_timeout=5))
    assert tok["CPU_PRIO_GATE"] == 'OvertakeGate "/dev/shm/g"\n    OvertakeGateTimeout 5.0'
    assert config_tokens(CpuPriority())["CPU_PRIO_GATE"].startswith("#")  # no gate: a comment
    for bad, field in (({"gate": "rel/path"}, "cpu_priority.gate"), ({"gate": "/a b"}, "cpu_priority.gate"),
                       ({"gate": "/g", "gate_timeout": 0}, "cpu_priority.gate_timeout")):
        with pytest.raises(ApacheInputError, match=field):
            CpuPriority(**bad)  # type: ignore[arg-type]
    ns = argparse.Namespace(cpu_priority_levels=None, cpu_priority_nice=None, cpu_priority_class_only=False,
                            gate="/dev/shm/g")
    cp = _cpu_priority(ns)
    assert cp is not None and cp.gate == "/dev/shm/g" and not cp.age and cp.priorities == ("idle",)
    ns.gate = None
    assert _cpu_priority(ns) is None


def test_status_reports_the_sidecars_file(gated: tuple[apache.ApacheInstance, Gate]) -> None:
    inst, gate = gated
    st = _status(inst)
    assert st.gate_mapped and st.gate_token == gate.token


def test_a_held_request_runs_only_once_opened(gated: tuple[apache.ApacheInstance, Gate]) -> None:
    inst, gate = gated
    before = _status(inst)
    slot, header = gate.arm()  # type: ignore[misc]
    try:
        th, out = _in_background(lambda: _get(inst, "/stage1?work=0.001", header))
        time.sleep(0.4)
        assert th.is_alive(), f"answered before the gate opened: {out}"
        t_open = time.monotonic()
        gate.open(slot)
        th.join(5)
        code, _ = out["result"]  # type: ignore[misc]
        assert code == 200 and time.monotonic() - t_open < 0.5
    finally:
        gate.free(slot)
    after = _status(inst)
    assert after.gate_held - before.gate_held == 1
    assert after.gate_wait_s - before.gate_wait_s >= 0.35
    assert after.gate_timeouts == before.gate_timeouts


@pytest.mark.parametrize("how", ["cancel", "stale"])
def test_withdrawn_or_stale_answers_503_at_once(gated: tuple[apache.ApacheInstance, Gate], how: str) -> None:
    inst, gate = gated
    before = _status(inst)
    slot, header = gate.arm()  # type: ignore[misc]
    try:
        if how == "stale":  # the header names the slot's previous generation
            gen = int(header.split()[1])
            header = gate.sign(slot, gen - 1)
            code, dt = _get(inst, "/stage1", header)
        else:
            th, out = _in_background(lambda: _get(inst, "/stage1", header))
            time.sleep(0.2)
            assert th.is_alive()
            gate.cancel(slot)
            th.join(5)
            code, dt = out["result"]  # type: ignore[misc]
    finally:
        gate.free(slot)
    assert code == 503 and dt < 1.0
    after = _status(inst)
    got = after.gate_cancels - before.gate_cancels if how == "cancel" else after.gate_stale - before.gate_stale
    assert got == 1 and after.gate_held == before.gate_held


@pytest.mark.parametrize("value", [b"x", b"1", b"1 2 3", b"-1 0", b"99999 1", b"1 4294967295", b"1 2 " + b"0" * 31,
                                   b"1 2 " + b"g" * 32, b"1 4294967295 " + b"0" * 32, b"signed beyond the file"])
def test_a_bad_gate_header_is_refused(gated: tuple[apache.ApacheInstance, Gate], value: bytes) -> None:
    inst, gate = gated
    if value == b"signed beyond the file":
        value = gate.sign(99999, 1)  # a MAC of the key, but no such slot
    before = _status(inst)
    code, dt = _get(inst, "/stage1", value)
    assert code == 400 and dt < 1.0
    assert _status(inst).gate_invalid - before.gate_invalid == 1


def test_a_gate_that_never_opens_lets_the_request_through(gated: tuple[apache.ApacheInstance, Gate]) -> None:
    inst, gate = gated
    before = _status(inst)
    slot, header = gate.arm()  # type: ignore[misc]
    try:
        code, dt = _get(inst, "/stage1?work=0.001", header)
    finally:
        gate.free(slot)
    assert code == 200 and GATE_TIMEOUT <= dt < GATE_TIMEOUT + 1.0
    assert _status(inst).gate_timeouts - before.gate_timeouts == 1


def test_a_closed_connection_frees_the_worker(gated: tuple[apache.ApacheInstance, Gate]) -> None:
    inst, gate = gated
    before = _status(inst)
    slot, header = gate.arm()  # type: ignore[misc]
    host, port = apache.parse_listen(inst.listen)
    try:
        s = socket.create_connection((host, port))
        s.sendall(b"GET /stage1 HTTP/1.1\r\nHost: x\r\nX-Overtake-Gate: " + header + b"\r\n\r\n")
        time.sleep(0.2)
        s.close()
        deadline = time.monotonic() + 1.0  # well before GATE_TIMEOUT
        while _status(inst).gate_aborts == before.gate_aborts:
            assert time.monotonic() < deadline, "the worker still waits for a connection that is gone"
            time.sleep(0.05)
    finally:
        gate.free(slot)
    assert _status(inst).gate_timeouts == before.gate_timeouts


def test_without_the_file_gated_requests_pass(apache_available: None) -> None:
    if os.geteuid() != 0 or shutil.which("apxs") is None:
        pytest.skip("needs root and apxs (apache2-dev): mod_overtake_prio")
    parent = scratch_dir("overtake-gate-test-")
    path = f"/dev/shm/overtake-gate-missing-{os.getpid()}"
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=_core(), max_workers=4,
                        cpu_priority=CpuPriority(levels=(3600.0,), nice=("idle",), age=False, gate=path))
    try:
        code, dt = _get(inst, "/stage1?work=0.001", b"0 1 " + b"0" * 32)
        st = _status(inst)
        assert code == 200 and dt < 1.0 and st.gate_unmapped == 1 and not st.gate_mapped
        assert "start the sidecar with --gate" in (Path(inst.workdir) / "logs" / "error.log").read_text()
    finally:
        apache.stop(inst.workdir, graceful=False)
        for p in (path, path + ".key"):
            Path(p).unlink(missing_ok=True)
        shutil.rmtree(parent, ignore_errors=True)


def _policies(inst: apache.ApacheInstance) -> list[int]:
    """Scheduling policy (field 41 of /proc/<tid>/stat) of every thread of Apache's child."""
    kid = _status(inst).child_pid
    out = []
    for tid in os.listdir(f"/proc/{kid}/task"):
        try:
            stat = Path(f"/proc/{kid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        out.append(int(stat.rsplit(")", 1)[1].split()[38]))
    return out


def test_an_idle_start_runs_at_sched_idle_until_opened(gated: tuple[apache.ApacheInstance, Gate]) -> None:
    """IDLE: the request runs before its admission, its thread under SCHED_IDLE (5); opening the
    slot gives the thread SCHED_OTHER back (the promoter), the answer follows."""
    inst, gate = gated
    before = _status(inst)
    slot, header = gate.arm()  # type: ignore[misc]
    gate.idle(slot)
    try:
        th, out = _in_background(lambda: _get(inst, "/stage1?work=0.6", header))
        deadline = time.monotonic() + 2
        while 5 not in _policies(inst):
            assert time.monotonic() < deadline and th.is_alive(), "no thread under SCHED_IDLE"
            time.sleep(0.02)
        gate.open(slot)
        deadline = time.monotonic() + 0.5
        while 5 in _policies(inst):
            assert time.monotonic() < deadline, "still SCHED_IDLE after the slot opened"
            time.sleep(0.01)
        th.join(5)
        assert out["result"][0] == 200  # type: ignore[index]
    finally:
        gate.free(slot)
    after = _status(inst)
    assert after.gate_idle_starts - before.gate_idle_starts == 1
    assert after.gate_promotions - before.gate_promotions == 1 and after.restore_errors == before.restore_errors
    assert after.gate_held == before.gate_held


def test_an_exempt_request_never_starts_idle(gated: tuple[apache.ApacheInstance, Gate]) -> None:
    """An exempt request (it may hold a lock) waits for its admission instead of running early at
    SCHED_IDLE: it starts when the slot opens, at its own priority."""
    inst, gate = gated
    before = _status(inst)
    slot, header = gate.arm()  # type: ignore[misc]
    gate.idle(slot)
    host, port = apache.parse_listen(inst.listen)

    def send() -> int:
        c = http.client.HTTPConnection(host, port, timeout=10)
        try:
            c.request("POST", "/stage1?work=0.05", body=b"",
                      headers={"X-Overtake-Gate": header.decode(), "X-Overtake-Exempt": "1"})
            r = c.getresponse()
            r.read()
            return r.status
        finally:
            c.close()

    try:
        th, out = _in_background(send)
        time.sleep(0.4)
        assert th.is_alive() and 5 not in _policies(inst), f"ran before its admission: {out}"
        gate.open(slot)
        th.join(5)
        assert out["result"] == 200
    finally:
        gate.free(slot)
    after = _status(inst)
    assert after.gate_idle_starts == before.gate_idle_starts
    assert after.gate_held - before.gate_held == 1
    assert after.exempt_header - before.exempt_header == 1


def test_a_forged_gate_header_is_refused_at_once(gated: tuple[apache.ApacheInstance, Gate]) -> None:
    """A client that reaches Apache directly and copies a waiting slot's ``SLOT GENERATION``
    (from the file, or guessed) must not park a worker until ``OvertakeGateTimeout``."""
    inst, gate = gated
    before = _status(inst)
    slot, _ = gate.arm()  # type: ignore[misc]
    try:
        gen = struct.unpack_from("<I", Path(gate.path).read_bytes(), 64 + 4 * slot)[0] >> 2
        for value in (b"%d %d" % (slot, gen), b"%d %d %s" % (slot, gen, b"0" * 32)):
            code, dt = _get(inst, "/stage1?work=0.001", value)
            assert code in (400, 403) and dt < 1.0, (value, code, dt)
    finally:
        gate.free(slot)
    after = _status(inst)
    assert after.gate_held == before.gate_held and after.gate_timeouts == before.gate_timeouts
    assert getattr(after, "gate_forged", 0) - getattr(before, "gate_forged", 0) == 1  # the one with a MAC


def test_the_gate_file_and_its_key_are_private(gated: tuple[apache.ApacheInstance, Gate]) -> None:
    """Slot and generation are not for other local users to read; the key only for root."""
    _, gate = gated
    assert os.stat(gate.path).st_mode & 0o007 == 0, oct(os.stat(gate.path).st_mode)
    key = os.stat(gate.path + ".key")
    assert key.st_mode & 0o077 == 0 and key.st_uid == 0, oct(key.st_mode)
    workers = grp.getgrnam("www-data").gr_gid  # the private Apache's Group: the workers read the file
    assert os.stat(gate.path).st_gid == key.st_gid == workers


@pytest.fixture(scope="module")
def private(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    """An Apache of its own for the tests that break its gate file (truncate, remove, replace)."""
    if os.geteuid() != 0 or shutil.which("apxs") is None:
        pytest.skip("needs root and apxs (apache2-dev): mod_overtake_prio")
    parent = scratch_dir("overtake-gate-test-")
    path = f"/dev/shm/overtake-gate-broken-{os.getpid()}-{free_port()}"
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=_core(), max_workers=8,
                        cpu_priority=CpuPriority(levels=(3600.0,), nice=("idle",), age=False, gate=path,
                                                 gate_timeout=8))
    try:
        yield inst, path
    finally:
        apache.stop(inst.workdir, graceful=False)
        for p in (path, path + ".key"):
            Path(p).unlink(missing_ok=True)
        shutil.rmtree(parent, ignore_errors=True)


def _paired(inst: apache.ApacheInstance, path: str) -> Gate:
    """A sidecar's Gate on ``path``, once Apache reports its token (the status page maps it)."""
    gate = Gate(path, 8)
    deadline = time.monotonic() + 10
    while _status(inst).gate_token != gate.token:
        assert time.monotonic() < deadline, "Apache never mapped the gate file: " + _log(inst)[-1500:]
        time.sleep(0.05)
    return gate


def _log(inst: apache.ApacheInstance) -> str:
    return (Path(inst.workdir) / "logs" / "error.log").read_text()


def _hold(inst: apache.ApacheInstance, gate: Gate, n: int) -> list[tuple[int, tuple[threading.Thread, dict[str, object]]]]:
    """``n`` requests held on fresh slots, still waiting 0.3 s later: (slot, background run)."""
    held = [gate.arm() for _ in range(n)]
    runs = [(s, _in_background(functools.partial(_get, inst, "/stage1?work=0.001", h))) for s, h in held]  # type: ignore[misc]
    time.sleep(0.3)
    assert all(th.is_alive() for _, (th, _) in runs), "answered before the gate opened"
    return runs


def _codes(runs: list[tuple[int, tuple[threading.Thread, dict[str, object]]]]) -> list[object]:
    for _, (th, _) in runs:
        th.join(10)
    return [out.get("result", (None,))[0] for _, (_, out) in runs]  # type: ignore[index]


def test_a_truncated_gate_file_lets_held_requests_through(private: tuple[apache.ApacheInstance, str]) -> None:
    """``truncate -s 0`` while requests wait in the gate: no child dies of SIGBUS, the waiting
    requests run (as without a file, long before OvertakeGateTimeout), the child says so once;
    a sidecar that writes the file again is paired and holds requests again."""
    inst, path = private
    gate = _paired(inst, path)
    crashes, said = _log(inst).count("exit signal"), _log(inst).count("AH90101")
    try:
        runs = _hold(inst, gate, 3)
        t_cut = time.monotonic()
        os.truncate(path, 0)
        assert _codes(runs) == [200] * 3
        assert time.monotonic() - t_cut < 3.0  # let through, not timed out (8 s)
        log = _log(inst)
        assert log.count("exit signal") == crashes, log[-2000:]
        st = _status(inst)
        assert st.gate_faults >= 1 and not st.gate_mapped and st.gate_token == 0
        assert log.count("AH90101") - said == 1 and "shrank under its mapping" in log, log[-2000:]  # once
    finally:
        gate.close()
    gate = _paired(inst, path)  # the same inode, written again
    try:
        (slot, run), = _hold(inst, gate, 1)
        gate.open(slot)
        assert _codes([(slot, run)]) == [200]
    finally:
        gate.close()


def test_a_removed_gate_file_keeps_serving_what_waits(private: tuple[apache.ApacheInstance, str]) -> None:
    """``rm`` of the file: a request waiting on it is still opened by the sidecar (both keep the
    inode mapped), the child says once that the file is gone, the sidecar notices; a restarted
    sidecar's new file is readable by the workers (the key file's group) and paired at once."""
    inst, path = private
    gate = _paired(inst, path)
    said = _log(inst).count("AH90103")
    try:
        (slot, run), = _hold(inst, gate, 1)
        os.unlink(path)
        for _ in range(3):
            assert _status(inst).gate_token == gate.token  # still what the waiting request uses
        gate.open(slot)
        assert _codes([(slot, run)]) == [200]
        assert _log(inst).count("AH90103") - said == 1
        assert gate.check() is not None and "removed" in gate.check()  # type: ignore[operator]
    finally:
        gate.close()
    gate = _paired(inst, path)
    assert os.stat(path).st_gid == os.stat(path + ".key").st_gid != 0
    gate.close()


def test_a_file_of_another_key_is_never_used(private: tuple[apache.ApacheInstance, str]) -> None:
    """A gate file not written with Apache's key (another file put at the path, or a sidecar that
    read another key file writing the mapped one) is never mapped: Apache keeps the old one, or
    lets gated requests pass; each said once."""
    inst, path = private
    key = Path(path + ".key")
    original = key.read_text()
    gate = _paired(inst, path)
    foreign_said, changed_said = _log(inst).count("AH90104"), _log(inst).count("AH90102")
    try:
        key.write_text("ab" * 32 + "\n")
        os.unlink(path)
        other = Gate(path, 8)  # a new inode, another key
        for _ in range(3):
            assert _status(inst).gate_token == gate.token  # the old file stays in use
        assert _log(inst).count("AH90104") - foreign_said == 1
        other.close()
        gate.close()
        key.write_text(original)
        gate = _paired(inst, path)  # the new inode, Apache's key: used
        key.write_text("cd" * 32 + "\n")
        other = Gate(path, 8)  # the same inode, rewritten with another key
        for _ in range(3):
            st = _status(inst)
            assert st.gate_token == 0 and not st.gate_mapped
        assert _log(inst).count("AH90102") - changed_said == 1 and "not written with this server's key" in _log(inst)
        other.close()
    finally:
        key.write_text(original)
        gate.close()
    _paired(inst, path).close()


def test_a_key_others_can_read_is_refused_at_start(apache_available: None) -> None:
    if os.geteuid() != 0 or shutil.which("apxs") is None:
        pytest.skip("needs root and apxs (apache2-dev): mod_overtake_prio")
    parent = scratch_dir("overtake-gate-test-")
    path = f"/dev/shm/overtake-gate-badkey-{os.getpid()}-{free_port()}"
    Path(path + ".key").write_text("ab" * 32)
    os.chmod(path + ".key", 0o644)
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=_core(), max_workers=4,
                        cpu_priority=CpuPriority(levels=(3600.0,), nice=("idle",), age=False, gate=path))
    try:
        st = _status(inst)
        assert not st.gate_key_loaded and not st.gate_mapped
        code, dt = _get(inst, "/stage1?work=0.001", b"0 1 " + b"0" * 32)
        assert code == 200 and dt < 1.0 and _status(inst).gate_unmapped == 1  # never held
        log = _log(inst)
        assert "AH90112" in log and "has mode 0644" in log, log[-2000:]
    finally:
        apache.stop(inst.workdir, graceful=False)
        for p in (path, path + ".key"):
            Path(p).unlink(missing_ok=True)
        shutil.rmtree(parent, ignore_errors=True)
