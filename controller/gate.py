"""The admission gate inside Apache: the sidecar's half of mod_overtake_prio's ``OvertakeGate``.

Without it, a request the policy holds waits in the sidecar, and its admission writes it to
Apache, which parses it and hands it to a worker: with a one-thread limit that hand-over
leaves Apache's CPU idle 0.28 ms per admission beyond Apache's own per-request cost
(``bench/handover.py``), time the model (paper 004 §2: a thread starts the instant the policy
says so) does not have. With the gate, the sidecar sends a queued request to Apache at once,
with a header naming a *slot* of a small shared file; the module holds the worker thread on
that slot's futex word before any other hook runs. Admission is then a 32-bit store and a
futex wake (:meth:`Gate.open`), made synchronously inside the limiter's decision; a withdrawn
request (queue timeout, client gone) is cancelled (:meth:`Gate.cancel`: Apache answers 503,
which the sidecar does not relay).

Idle starts (:meth:`Gate.idle`, ``--gate-backfill``): the oldest queued requests may start
before their admission at the module's lowest level (``SCHED_IDLE``), so that Apache's core
does not idle while the policy waits for something that is not on the CPU yet — a
completion's hand-over, or a client's round trip between two stages with the thread reserved
for its next request (``next``; 0.7–0.9 ms per transaction measured on loopback). Under
``SCHED_IDLE`` (weight 3 against 1024) such a request takes ~0.3 % of the core from admitted
ones; when the policy admits it, :meth:`Gate.open` bumps the file's epoch word and the
module's promoter thread gives it its priority back.

File layout (shared with the C module): a 64-byte head — magic ``OVTGATE1``, the slot count,
a random 32-bit pairing token, the promoter's epoch word (the module reports the one it has mapped at
``/overtake-prio-status``, so the sidecar can check that Apache reads *its* file) — then one
32-bit word per slot, ``(generation << 2) | state`` with state WAIT 0, OPEN 1, CANCEL 2, IDLE 3. A slot
moves to a new generation when it is armed and again when its exchange ends
(:meth:`Gate.free`), so a stale request (one the sidecar has given up) never passes on a later
request's admission.
"""

from __future__ import annotations

import ctypes
import heapq
import mmap
import os
import platform
import secrets
import struct

from overtake.controller.errors import SidecarInputError
from overtake.controller.limiter import Limiter, LimiterListener, Ticket

__all__ = ["GATE_HEADER", "Gate", "GateOpener"]

#: request header carrying "SLOT GENERATION" (mod_overtake_prio's default OvertakeGateHeader)
GATE_HEADER = b"X-Overtake-Gate"
_MAGIC = b"OVTGATE1"
_HEAD = 64
_WAIT, _OPEN, _CANCEL, _IDLE = 0, 1, 2, 3
_GEN_MASK = 0x3FFFFFFF
_FUTEX_WAKE = 1
#: futex(2) system call numbers (the C module waits with FUTEX_WAIT on the same words)
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}


class Gate:
    """The sidecar's side of the gate file ``path`` with ``slots`` slots.

    The file is created if missing and reused if present with the same size (a restarted
    sidecar keeps the inode Apache has mapped); every slot starts a new generation, so any
    request an earlier sidecar left waiting ends stale.
    """

    def __init__(self, path: str, slots: int = 4096) -> None:
        if not 1 <= slots <= 1 << 20:
            raise SidecarInputError(f"gate_slots: must be 1..{1 << 20}, got {slots}")
        nr = _SYS_FUTEX.get(platform.machine().lower())
        if nr is None:
            raise SidecarInputError(f"gate: futex(2) number unknown on {platform.machine()}; run without --gate")
        self.path = path
        self.slots = slots
        self.token = secrets.randbits(31) | 1  # nonzero: 0 is the module's "nothing mapped"
        size = _HEAD + 4 * slots
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise SidecarInputError(f"gate: cannot open {path}: {exc.strerror}; give a writable path "
                                    "(e.g. /dev/shm/overtake-gate), the same as Apache's OvertakeGate") from None
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # the words first, the head (magic last) after: a module that maps the file meanwhile
        # sees no magic and waits for the next request to map it
        self._words = (ctypes.c_uint32 * slots).from_buffer(self._map, _HEAD)
        self._epoch = ctypes.c_uint32.from_buffer(self._map, 16)
        self._gen = [0] * slots
        self._state = [_WAIT] * slots
        for i in range(slots):
            old = self._words[i] >> 2
            self._gen[i] = (old + 1) & _GEN_MASK
            self._words[i] = self._gen[i] << 2
        self._map[8:16] = struct.pack("<II", slots, self.token)
        self._map[0:8] = _MAGIC
        self._base = ctypes.addressof(self._words)
        self._epoch_addr = ctypes.addressof(self._epoch)
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._nr = nr
        self._free = list(range(slots - 1, -1, -1))
        self.opened = 0
        self.cancelled = 0
        self.idled = 0
        self.idle_waiting = 0  # slots in IDLE: started early, not yet admitted
        self.full = 0  # arms refused for want of a slot (the request then waits in the sidecar)

    # ---- one request's slot ---------------------------------------------------------------
    def arm(self) -> tuple[int, bytes] | None:
        """A slot for a request about to be sent while queued, and its header value; None when
        every slot is in use."""
        if not self._free:
            self.full += 1
            return None
        i = self._free.pop()
        return i, b"%d %d" % (i, self._gen[i])

    def open(self, slot: int) -> None:
        """Admit: the worker holding ``slot`` runs now (an idle start gets its priority back)."""
        was = self._state[slot]
        self._set(slot, _OPEN)
        self.opened += 1
        if was == _IDLE:
            self._promote()

    def idle(self, slot: int) -> None:
        """Start the held request now at the lowest CPU priority, before its admission."""
        if self._state[slot] == _WAIT:
            self._set(slot, _IDLE)
            self.idled += 1

    def is_idle(self, slot: int) -> bool:
        return self._state[slot] == _IDLE

    def cancel(self, slot: int) -> None:
        """Withdraw: a held request ends with 503 (not relayed); an idle start gets its priority
        back and finishes unseen (its connection is closed). Idempotent."""
        was = self._state[slot]
        if was == _CANCEL:
            return
        self._set(slot, _CANCEL)
        self.cancelled += 1
        if was == _IDLE:
            self._promote()

    def free(self, slot: int) -> None:
        """The exchange ended: the slot's next generation, back to the free list."""
        was = self._state[slot]
        g = self._gen[slot] = (self._gen[slot] + 1) & _GEN_MASK
        self._set(slot, _WAIT, g)
        self._free.append(slot)
        if was == _IDLE:
            self._promote()

    def _promote(self) -> None:
        self.idle_waiting -= 1
        self._epoch.value = (self._epoch.value + 1) & 0xFFFFFFFF
        self._syscall(self._nr, ctypes.c_void_p(self._epoch_addr), _FUTEX_WAKE, 1 << 30, None, None, 0)

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def _set(self, slot: int, state: int, gen: int | None = None) -> None:
        if state == _IDLE:
            self.idle_waiting += 1
        self._state[slot] = state
        self._words[slot] = ((self._gen[slot] if gen is None else gen) << 2) | state
        # the store is visible before the wake: the system call is a full barrier
        self._syscall(self._nr, ctypes.c_void_p(self._base + 4 * slot), _FUTEX_WAKE, 1 << 30, None, None, 0)

    def close(self) -> None:
        del self._words, self._epoch
        self._map.close()


class GateOpener(LimiterListener):
    """Opens a gated ticket's slot the moment the limiter admits it: inside the policy's
    decision, before the event loop runs anything else. With ``backfill`` > 0, after every
    decision the oldest queued gated tickets (up to ``backfill`` of them) are idle-started."""

    def __init__(self, gate: Gate, limiter: Limiter | None = None, backfill: int = 0) -> None:
        self.gate = gate
        self.limiter = limiter
        self.backfill = backfill
        if limiter is not None and backfill > 0:
            limiter.after_dispatch.append(self.fill)

    def on_admit(self, ticket: Ticket, now: float) -> None:
        if ticket.gate is not None:
            self.gate.open(ticket.gate)

    def on_reject(self, ticket: Ticket, reason: str) -> None:
        # withdrawn (queue timeout, client gone): cancel before the decision that follows, so
        # that an idle start it held is replaced in the same decision
        if ticket.gate is not None:
            self.gate.cancel(ticket.gate)

    def fill(self) -> None:
        """Idle-start the oldest queued gated tickets until ``backfill`` are started."""
        gate, lim = self.gate, self.limiter
        if lim is None or gate.idle_waiting >= self.backfill or not any(lim.tandem.stage_waiting):
            return
        queued = heapq.nsmallest(self.backfill - gate.idle_waiting,
                                 (t for qs in lim.tandem.queues for q in qs for t in q
                                  if t.gate is not None and not gate.is_idle(t.gate)), key=lambda t: t.seq)
        for t in queued:
            assert t.gate is not None
            gate.idle(t.gate)
