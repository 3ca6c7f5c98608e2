"""``overtake.controller.sidecar.gate``: the sidecar's half of Apache's admission gate (no Apache).

The known answers are the file layout the C module reads (magic, slot count, token, one
``(generation << 2) | state`` word per slot) and the futex protocol: a waiter blocked with
FUTEX_WAIT on a slot's word (here a thread of this process through its own read-only mapping,
as an Apache worker does) wakes when the slot is opened or cancelled, and not before.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import hmac
import mmap
import os
import platform
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.gate import Gate, GateOpener
from overtake.controller.sidecar.heads import upstream_head
from overtake.controller.sidecar.request import Request
from overtake.controller.sidecar.tandem import Ticket

WAIT, OPEN, CANCEL = 0, 1, 2


def _words(path: Path) -> tuple[bytes, int, int, list[int]]:
    raw = path.read_bytes()
    magic, n, token = raw[:8], *struct.unpack("<II", raw[8:16])
    return magic, n, token, list(struct.unpack(f"<{n}I", raw[64:64 + 4 * n]))


def _mac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def test_file_layout_and_slot_states(tmp_path: Path) -> None:
    p = tmp_path / "gate"
    g = Gate(str(p), 4)
    magic, n, token, words = _words(p)
    assert (magic, n, token) == (b"OVTGATE2", 4, g.token) and token != 0
    assert words == [1 << 2] * 4  # generation 1, WAIT
    key = bytes.fromhex((tmp_path / "gate.key").read_text())
    assert p.read_bytes()[32:64] == _mac(key, b"OVTGATE2 file 4 %d" % token)  # the key check
    assert (p.stat().st_mode & 0o777, (tmp_path / "gate.key").stat().st_mode & 0o777) == (0o640, 0o600)
    slot, header = g.arm()  # type: ignore[misc]
    assert header == b"%d 1 %s" % (slot, _mac(key, b"%d %d 1" % (token, slot))[:16].hex().encode())
    g.open(slot)
    assert _words(p)[3][slot] == (1 << 2) | OPEN
    g.free(slot)  # the next generation: a late request on generation 1 finds it stale
    assert _words(p)[3][slot] == (2 << 2) | WAIT
    s2, h2 = g.arm()  # type: ignore[misc]
    assert s2 == slot and h2.startswith(b"%d 2 " % slot) and h2 != header  # LIFO reuse, new generation
    g.cancel(s2)
    assert _words(p)[3][s2] == (2 << 2) | CANCEL
    g.close()


def test_slots_run_out_and_come_back(tmp_path: Path) -> None:
    g = Gate(str(tmp_path / "gate"), 2)
    a, b = g.arm(), g.arm()
    assert a is not None and b is not None and g.arm() is None
    assert g.in_use == 2 and g.full == 1
    g.free(a[0])
    assert g.in_use == 1 and g.arm() is not None
    g.close()


def test_a_restarted_sidecar_moves_every_slot_on(tmp_path: Path) -> None:
    """A request an earlier sidecar left waiting must never pass on the new one's admission."""
    p = tmp_path / "gate"
    g = Gate(str(p), 3)
    slot, _ = g.arm()  # type: ignore[misc]
    g.close()
    ino = p.stat().st_ino
    g2 = Gate(str(p), 3)
    assert p.stat().st_ino == ino  # same file: Apache's mapping stays valid
    _, _, token2, words = _words(p)
    assert token2 == g2.token
    assert all(w >> 2 == 2 and w & 3 == WAIT for w in words)  # generation 1 -> 2 everywhere
    g2.close()


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"),
                    reason="futex number known for x86_64 and aarch64 only")
@pytest.mark.parametrize("action", ["open", "cancel"])
def test_a_futex_waiter_wakes_on_admission_only(tmp_path: Path, action: str) -> None:
    p = tmp_path / "gate"
    g = Gate(str(p), 8)
    slot, _ = g.arm()  # type: ignore[misc]
    fd = os.open(p, os.O_RDONLY)
    ro = mmap.mmap(fd, 64 + 4 * 8, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    libc = ctypes.CDLL(None, use_errno=True)
    view = memoryview(ro)
    word_addr = _buf_ptr(view) + 64 + 4 * slot  # the read-only mapping's own address, as the module's
    nr = 202 if platform.machine().lower() in ("x86_64", "amd64") else 98
    seen: dict[str, float] = {}

    def waiter() -> None:
        t0 = time.monotonic()
        v = struct.unpack_from("<I", ro, 64 + 4 * slot)[0]
        while v & 3 == WAIT:
            ts = (ctypes.c_long * 2)(2, 0)
            libc.syscall(ctypes.c_long(nr), ctypes.c_void_p(word_addr), 0, ctypes.c_uint32(v), ts, None, 0)
            v = struct.unpack_from("<I", ro, 64 + 4 * slot)[0]
            if time.monotonic() - t0 > 5:
                break
        seen["state"], seen["t"] = v & 3, time.monotonic() - t0

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.3)
    assert th.is_alive(), "the waiter passed before any admission"
    t_act = time.monotonic()
    (g.open if action == "open" else g.cancel)(slot)
    th.join(5)
    assert not th.is_alive()
    assert seen["state"] == (OPEN if action == "open" else CANCEL)
    assert seen["t"] >= 0.3 and time.monotonic() - t_act < 1.0  # woken, not the 2 s futex timeout
    view.release()
    ro.close()
    g.close()


def _buf_ptr(view: memoryview) -> int:
    """Address of a (read-only) buffer's first byte (ctypes' from_buffer wants a writable one)."""

    class Py_buffer(ctypes.Structure):
        _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                    ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                    ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                    ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]

    b = Py_buffer()
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(Py_buffer), ctypes.c_int]
    if get(view, ctypes.byref(b), 0) != 0:
        raise OSError("no buffer")
    addr = int(b.buf)
    release = ctypes.pythonapi.PyBuffer_Release
    release.argtypes = [ctypes.POINTER(Py_buffer)]
    release(ctypes.byref(b))
    return addr


def test_the_limiters_admission_opens_the_slot(tmp_path: Path) -> None:
    g = Gate(str(tmp_path / "gate"), 2)
    slot, _ = g.arm()  # type: ignore[misc]
    t = Ticket(0, 0, "", 1, 0.0)
    GateOpener(g).on_admit(t, 0.0)  # not gated: nothing happens
    assert g.opened == 0
    t.gate = slot
    GateOpener(g).on_admit(t, 0.0)
    assert g.opened == 1 and _words(tmp_path / "gate")[3][slot] & 3 == OPEN
    g.close()


def test_bad_settings_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(SidecarInputError, match="gate_slots"):
        Gate(str(tmp_path / "g"), 0)
    with pytest.raises(SidecarInputError, match="gate: cannot open .*OvertakeGate"):
        Gate(str(tmp_path / "no" / "such" / "dir" / "g"), 4)


def test_only_the_sidecars_gate_header_reaches_apache() -> None:
    r = Request()
    r.method, r.target, r.version = b"GET", b"/stage1", "1.1"
    r.headers = [(b"Host", b"x"), (b"X-Overtake-Gate", b"0 1"), (b"x-overtake-gate", b"3 9")]
    head = upstream_head(r, "127.0.0.1", 0, b"apache:80")
    assert b"overtake-gate" not in head.lower()  # a client's would hold a worker at the gate
    head = upstream_head(r, "127.0.0.1", 0, b"apache:80", gate=b"5 7")
    assert head.lower().count(b"x-overtake-gate") == 1 and b"X-Overtake-Gate: 5 7\r\n" in head


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(backfill=1, ops=[("arrive", 0, 0)] * 4 + [("release", 0, 0)])  # the next oldest, not the newest
@given(backfill=st.integers(0, 2), ops=st.lists(st.tuples(st.sampled_from("arrive release cancel".split()),
                                                       st.integers(0, 1), st.integers(0, 50)), max_size=40))
def test_idle_starts_are_the_oldest_held_requests(tmp_path: Path, backfill: int,
                                                   ops: list[tuple[str, int, int]]) -> None:
    """Whatever the interleaving of arrivals, completions and withdrawals under pi(1): every
    admitted gated ticket's slot is OPEN, and the IDLE slots are exactly the ``backfill`` oldest
    queued gated tickets (an idle start is never taken back: new tickets are younger)."""
    from overtake.controller.sidecar.classifier import Classifier
    from overtake.controller.sidecar.limiter import ADMITTED, QUEUED, Limiter
    from overtake.controller.sidecar.policies import BaselinePolicy
    from overtake.controller.sidecar.stages import ClassifierSettings

    async def run() -> None:
        pol = BaselinePolicy("pi(1)", 2)
        lim = Limiter(pol, Classifier(ClassifierSettings(mode="hidden"), pol), stage_names=("s1", "s2"),  # type: ignore[arg-type]
                      queue_caps=(100, 100), max_inflight=100, passthrough_cap=None, passthrough_queue_cap=100)
        gate = Gate(str(tmp_path / f"gate-{backfill}-{len(ops)}"), 64)
        lim.add_listener(GateOpener(gate, lim, backfill))
        live: list[Ticket] = []
        for op, stage, k in ops:
            if op == "arrive":
                t = lim.submit(stage, 0, "")
                assert t is not None
                if t.status == QUEUED:  # as the gateway: a slot, then the idle starts
                    armed = gate.arm()
                    assert armed is not None
                    t.gate = armed[0]
                    for fn in lim.after_dispatch:
                        fn()
                live.append(t)
            else:
                pool = [t for t in live if t.status == (ADMITTED if op == "release" else QUEUED)]
                if not pool:
                    continue
                t = pool[k % len(pool)]
                if op == "release":
                    lim.release(t, "completed")
                else:
                    lim.cancel(t, "queue_timeout")
                    if t.gate is not None:
                        gate.cancel(t.gate)
                if t.gate is not None:  # the exchange ended
                    gate.free(t.gate)
                    t.gate = None
                live.remove(t)
            held = sorted((t for t in live if t.status == QUEUED and t.gate is not None), key=lambda t: t.seq)
            idle = {t.seq for t in held if gate.is_idle(t.gate)}  # type: ignore[arg-type]
            assert idle == {t.seq for t in held[:backfill]}
            assert gate.idle_waiting == len(idle)
            for t in live:
                if t.status == ADMITTED and t.gate is not None:
                    assert _words(tmp_path / f"gate-{backfill}-{len(ops)}")[3][t.gate] & 3 == OPEN
        gate.close()

    asyncio.run(run())


def test_a_truncated_gate_file_does_not_crash_the_sidecar(tmp_path: Path) -> None:
    """``truncate -s 0`` on the gate file, then every store the limiter makes: the sidecar's
    process survives (it died of SIGBUS touching its mapping) and reports the file lost."""
    p = tmp_path / "gate"
    script = (
        "import os\n"
        "from overtake.controller.sidecar.gate import Gate\n"
        f"g = Gate({str(p)!r}, 8)\n"
        "s, _ = g.arm()\n"
        f"os.truncate({str(p)!r}, 0)\n"
        "g.idle(s); g.open(s); g.cancel(s); g.free(s)\n"
        "s2, _ = g.arm(); g.open(s2); g.free(s2)\n"
        "print('lost:', getattr(g, 'lost', None))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"
    assert "lost: " in r.stdout and "shrank" in r.stdout


@pytest.mark.parametrize("how", ["truncate", "remove", "replace", "grow"])
def test_the_gate_notices_a_file_that_is_no_longer_its_own(tmp_path: Path, how: str) -> None:
    """Without any store (no traffic), the periodic check finds the change; the sidecar hears it
    once, and later stores neither raise nor report it again."""
    p = tmp_path / "gate"
    g = Gate(str(p), 4)
    heard: list[str] = []
    g.on_lost = heard.append
    slot, _ = g.arm()  # type: ignore[misc]
    assert g.check() is None
    if how == "truncate":
        os.truncate(p, 0)
    elif how == "remove":
        p.unlink()
    elif how == "replace":
        p.unlink()
        p.write_bytes(bytes(64 + 16))  # same size, another inode
    else:
        os.truncate(p, 64 + 4 * 4 + 4096)
    why = g.check()
    want = {"truncate": "shrank to 0 bytes", "remove": "was removed", "replace": "was replaced",
            "grow": "grew to"}[how]
    assert why is not None and want in why and heard == [why]
    g.open(slot)
    g.free(slot)
    assert g.check() == why and heard == [why]
    g.close()


def test_a_store_into_a_truncated_file_is_reported_once(tmp_path: Path) -> None:
    p = tmp_path / "gate"
    g = Gate(str(p), 4)
    heard: list[str] = []
    g.on_lost = heard.append
    slot, _ = g.arm()  # type: ignore[misc]
    os.truncate(p, 0)
    g.idle(slot)
    g.open(slot)  # also the epoch word (an idle start's promotion)
    g.free(slot)
    assert len(heard) == 1 and "shrank under the sidecar's mapping" in heard[0] and g.lost == heard[0]
    g.close()


def test_the_key_is_made_once_and_shared(tmp_path: Path) -> None:
    """Whoever starts first creates GATE.key (0600); a restarted sidecar signs with the same key."""
    p = str(tmp_path / "gate")
    g1 = Gate(p, 2)
    key = (tmp_path / "gate.key").read_text()
    g1.close()
    g2 = Gate(p, 2)
    assert (tmp_path / "gate.key").read_text() == key and len(key.strip()) == 64
    slot, header = g2.arm()  # type: ignore[misc]
    mac = _mac(bytes.fromhex(key), b"%d %d %s" % (g2.token, slot, header.split()[1]))[:16].hex().encode()
    assert header.split()[2] == mac
    assert not list(tmp_path.glob("*.tmp"))
    g2.close()


@pytest.mark.parametrize("case", ["mode", "owner", "content", "symlink", "directory"])
def test_a_key_file_anyone_else_could_know_is_refused(tmp_path: Path, case: str) -> None:
    key = tmp_path / "gate.key"
    if case == "symlink":
        (tmp_path / "elsewhere").write_text("ab" * 32)
        key.symlink_to(tmp_path / "elsewhere")
    elif case == "directory":
        key.mkdir()
    else:
        key.write_text("x" * 64 if case == "content" else "ab" * 32)
        key.chmod(0o644 if case == "mode" else 0o600)
        if case == "owner":
            if os.geteuid() != 0:
                pytest.skip("needs root to give the key to another user")
            os.chown(key, 65534, 65534)
    want = {"mode": "mode 0644", "owner": "belongs to uid 65534", "content": "64 hex digits",
            "symlink": "cannot be read", "directory": "cannot be read|not a regular file"}[case]
    with pytest.raises(SidecarInputError, match=f"gate: the gate key .*({want})"):
        Gate(str(tmp_path / "gate"), 2)


def test_a_gate_file_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    p = tmp_path / "gate"
    p.write_bytes(b"")
    os.chown(p, 65534, 65534)
    with pytest.raises(SidecarInputError, match="belongs to uid 65534"):
        Gate(str(p), 2)


def test_a_forbidden_process_vm_writev_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seccomp profile that forbids the safe store: the sidecar says so at start."""
    from overtake.controller.sidecar import gate as gate_mod

    monkeypatch.setattr(gate_mod._SafeMemory, "write", lambda self, offset, data: False)
    with pytest.raises(SidecarInputError, match="process_vm_writev.*seccomp"):
        Gate(str(tmp_path / "gate"), 2)
