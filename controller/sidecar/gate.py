"""The admission gate inside Apache: the sidecar's half of mod_overtake_prio's ``OvertakeGate``.

Without it, a request the policy holds waits in the sidecar, and its admission writes it to
Apache, which parses it and hands it to a worker: with a one-thread limit that hand-over
leaves Apache's CPU idle 0.28 ms per admission beyond Apache's own per-request cost
(``bench/handover.py``), time the model (van der Weij et al., "Dynamic thread assignment" §2: a thread starts the
instant the policy says so) does not have. With the gate, the sidecar sends a queued request to Apache at once,
with a header naming a *slot* of a small shared file; the module holds the worker thread on
that slot's futex word before any other hook runs. Admission is then a 32-bit store and a
futex wake (:meth:`Gate.open`), made synchronously inside the limiter's decision; a withdrawn
request (queue timeout, client gone) is cancelled (:meth:`Gate.cancel`: Apache answers 503,
which the sidecar does not relay).

Idle starts (:meth:`Gate.idle`, ``--gate-backfill``): the oldest queued requests may start
before their admission at the module's lowest level (``SCHED_IDLE``), so that Apache's core
does not idle while the policy waits for something that is not on the CPU yet — a
completion's hand-over, or a client's round trip between two stages with the thread reserved
for its next request (``next``). Under
``SCHED_IDLE`` (weight 3 against 1024) such a request takes ~0.3 % of the core from admitted
ones; when the policy admits it, :meth:`Gate.open` bumps the file's epoch word and the
module's promoter thread gives it its priority back.

File layout (shared with the C module): a 64-byte head — magic ``OVTGATE2``, the slot count,
a random 32-bit pairing token, the promoter's epoch word, and at offset 32 the key check
(:meth:`~overtake.controller.sidecar.gate_key.GateSigner.keycheck`: the module maps only a file written
with its key; it reports the token it has mapped at ``/overtake-prio-status``, so the sidecar
can check that Apache reads *its* file) — then one 32-bit word per slot,
``(generation << 2) | state`` with state WAIT 0, OPEN 1, CANCEL 2, IDLE 3. A slot moves to a
new generation when its exchange ends (:meth:`Gate.free`), so a stale request (one the sidecar
has given up) never passes on a later request's admission. The header a request carries is
``SLOT GENERATION MAC`` (:mod:`overtake.controller.sidecar.gate_key`): Apache refuses a forged one.

The file may shrink under both mappings (``truncate``, or another process rewriting it): a
store through the mapping into a page beyond the file's end would kill the sidecar with SIGBUS.
So the sidecar never touches its mapping itself: :class:`_SafeMemory` writes through
``process_vm_writev(2)``, for which such a page is an EFAULT, and the mapping serves only as
the futex address. A failed store, or :meth:`Gate.check` (the file's size and the inode at its
path, every status scrape), marks the gate lost: the sidecar stops sending requests to it and
says so once; the module lets requests already held there through (its loads are guarded the
same way). The file is the sidecar's, mode 0640 (Apache's root parent gives its group to
Apache's workers); one that belongs to another user is refused.
"""

from __future__ import annotations

import ctypes
import heapq
import mmap
import os
import platform
import secrets
import stat
import struct
from collections.abc import Callable

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.gate_key import GateSigner, key_path, load_key
from overtake.controller.sidecar.limiter import Limiter, LimiterListener, Ticket

__all__ = ["GATE_HEADER", "Gate", "GateOpener"]

#: request header carrying "SLOT GENERATION MAC" (mod_overtake_prio's default OvertakeGateHeader)
GATE_HEADER = b"X-Overtake-Gate"
_MAGIC = b"OVTGATE2"
_HEAD = 64
_EPOCH = 16  # offset of the epoch word in the head
_WAIT, _OPEN, _CANCEL, _IDLE = 0, 1, 2, 3
_GEN_MASK = 0x3FFFFFFF
_FUTEX_WAKE = 1
#: futex(2) system call numbers (the C module waits with FUTEX_WAIT on the same words)
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _SafeMemory:
    """Stores into this process's own mapping at ``base`` that cannot fault: the kernel copies
    (``process_vm_writev``), and a page that is gone is an error instead of SIGBUS. A 32-bit
    store changes a slot's state in one byte, so a reader never sees a torn state."""

    def __init__(self, base: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._pvw = libc.process_vm_writev
        self._pvw.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                              ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
        self._pvw.restype = ctypes.c_ssize_t
        self._pid = os.getpid()
        self._base = base
        self._word = ctypes.c_uint32()
        self._local = _IOVec(ctypes.addressof(self._word), 4)
        self._remote = _IOVec(0, 4)

    def store32(self, offset: int, value: int) -> bool:
        self._word.value = value
        self._remote.base = self._base + offset
        n: int = self._pvw(self._pid, ctypes.byref(self._local), 1, ctypes.byref(self._remote), 1, 0)
        return n == 4

    def write(self, offset: int, data: bytes) -> bool:
        buf = ctypes.create_string_buffer(data, len(data))
        local, remote = _IOVec(ctypes.addressof(buf), len(data)), _IOVec(self._base + offset, len(data))
        n: int = self._pvw(self._pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        return n == len(data)

    @staticmethod
    def errno() -> str:
        return os.strerror(ctypes.get_errno())


def open_shared_file(path: str, option: str = "gate", directive: str = "OvertakeGate") -> int:
    """A file the sidecar writes for Apache (the gate's, the control file), created 0640 if
    missing; only this user's or root's (Apache's parent creates it empty for its workers).
    Errors name the sidecar's ``option`` and Apache's ``directive``."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    except OSError as exc:
        raise SidecarInputError(f"{option}: cannot open {path}: {exc.strerror}; give a writable path "
                                f"(e.g. /dev/shm/overtake-{option.replace('_', '-')}), the same as Apache's "
                                f"{directive}") from None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_uid not in (os.geteuid(), 0):
        why = f"belongs to uid {st.st_uid}, not to root or this user: remove it (its owner could rewrite it)"
    elif st.st_uid == os.geteuid():
        os.fchmod(fd, 0o640)  # slots and generations are not for other users to read
    elif st.st_mode & 0o022:
        why = f"has mode {stat.S_IMODE(st.st_mode):04o}: others may change it; chmod 0640"
    if why is not None:
        os.close(fd)
        raise SidecarInputError(f"{option}: {path} {why}")
    return fd


def give_group(fd: int, gid: int) -> None:
    """A file this user owns gets group ``gid``: the key file's, which Apache's parent sets to
    its workers' group, so that they can read a gate file made while Apache runs."""
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and st.st_gid != gid:
        try:
            os.fchown(fd, -1, gid)
        except PermissionError:
            pass  # not a member of that group: the file keeps this user's (docs/sidecar.md)


class Gate:
    """The sidecar's side of the gate file ``path`` with ``slots`` slots.

    The file is created if missing and reused if present (a restarted sidecar keeps the inode
    Apache has mapped); every slot starts a new generation, so any request an earlier sidecar
    left waiting ends stale. The key is ``path + ".key"`` (:func:`~overtake.controller.sidecar.gate_key.load_key`).
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
        self._size = size = _HEAD + 4 * slots
        self._fd = fd = open_shared_file(path)
        try:
            key, gid = load_key(key_path(path))
            self._signer = GateSigner(key)
            give_group(fd, gid)
            st = os.fstat(fd)
            if st.st_size != size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            old = os.pread(fd, 4 * slots, _HEAD)  # never the mapping: the file may shrink meanwhile
        except SidecarInputError:
            os.close(fd)
            raise
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise SidecarInputError(f"gate: cannot size and map {path} ({exc}); is another process changing it?") from None
        self._id = (st.st_dev, st.st_ino)
        #: why the file is no longer usable (truncated, removed, replaced), or None
        self.lost: str | None = None
        #: called once, with the reason, when the gate is lost
        self.on_lost: Callable[[str], None] | None = None
        self._anchor = ctypes.c_char.from_buffer(self._map)  # the mapping's address: never read or written here
        self._base = ctypes.addressof(self._anchor)
        self._mem = _SafeMemory(self._base)
        words = struct.unpack(f"<{len(old) // 4}I", old[:len(old) // 4 * 4]) + (0,) * (slots - len(old) // 4)
        self._gen = [((w >> 2) + 1) & _GEN_MASK for w in words]
        self._state = [_WAIT] * slots
        self._epoch_n = 0
        # no magic while the words change: a module that checks the file meanwhile skips it
        head = struct.pack("<II", slots, self.token) + bytes(16) + self._signer.keycheck(slots, self.token)
        if not (self._mem.write(0, bytes(8))
                and self._mem.write(_HEAD, struct.pack(f"<{slots}I", *(g << 2 for g in self._gen)))
                and self._mem.write(8, head) and self._mem.write(0, _MAGIC)):
            err = self._mem.errno()
            self.close()
            raise SidecarInputError(f"gate: cannot write {path} through process_vm_writev(2) ({err}); if a "
                                    "seccomp profile forbids that system call, allow it or run without --gate")
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
        return i, self.sign(i, self._gen[i])

    def sign(self, slot: int, gen: int) -> bytes:
        """The header value ``SLOT GENERATION MAC`` for ``slot`` at generation ``gen``."""
        return self._signer.header(self.token, slot, gen)

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
        self._epoch_n = (self._epoch_n + 1) & 0xFFFFFFFF
        if self._mem.store32(_EPOCH, self._epoch_n):
            self._syscall(self._nr, ctypes.c_void_p(self._base + _EPOCH), _FUTEX_WAKE, 1 << 30, None, None, 0)
        else:
            self._lose(f"{self.path} shrank under the sidecar's mapping (truncated?)")

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def _set(self, slot: int, state: int, gen: int | None = None) -> None:
        if state == _IDLE:
            self.idle_waiting += 1
        self._state[slot] = state
        off = _HEAD + 4 * slot
        if self._mem.store32(off, ((self._gen[slot] if gen is None else gen) << 2) | state):
            # the store is visible before the wake: both are system calls (full barriers)
            self._syscall(self._nr, ctypes.c_void_p(self._base + off), _FUTEX_WAKE, 1 << 30, None, None, 0)
        else:  # Apache lets what it holds there through: nothing is lost
            self._lose(f"{self.path} shrank under the sidecar's mapping (truncated?)")

    # ---- the file itself ------------------------------------------------------------------
    def check(self) -> str | None:
        """Whether the file is still this gate's (its size, the inode at its path); why not, or None."""
        if self.lost is None:
            try:
                size = os.fstat(self._fd).st_size
                st = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                self._lose(f"{self.path} was removed")
            except OSError as exc:
                self._lose(f"{self.path} cannot be checked ({exc.strerror})")
            else:
                if size < self._size:
                    self._lose(f"{self.path} shrank to {size} bytes (truncated?)")
                elif size > self._size:
                    self._lose(f"{self.path} grew to {size} bytes (rewritten by another process?)")
                elif (st.st_dev, st.st_ino) != self._id:
                    self._lose(f"{self.path} was replaced by another file")
        return self.lost

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            if self.on_lost is not None:
                self.on_lost(why)

    def close(self) -> None:
        del self._anchor
        self._map.close()
        os.close(self._fd)


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
