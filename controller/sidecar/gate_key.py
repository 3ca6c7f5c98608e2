"""The admission gate's key: what makes an ``X-Overtake-Gate`` header unforgeable.

mod_overtake_prio holds a request carrying the gate header on its slot until the sidecar opens
it. A client reaching Apache directly with a ``SLOT GENERATION`` it read or guessed could park
every worker until ``OvertakeGateTimeout``; so the sidecar signs each header, and the module
refuses (403) one whose MAC is wrong. The MAC is HMAC-SHA256 (truncated to 128 bits) of
``"TOKEN SLOT GENERATION"`` under a 32-byte key: the file's pairing token binds it to one
sidecar's file, the generation to one request.

The key lives next to the gate file, in ``GATE.key``: 64 hex digits, mode 0600. Whichever side
starts first creates it — Apache's root parent (the module's ``post_config``) or the sidecar
(:func:`load_key`) — by linking a complete temporary file into place, so neither ever reads a
half-written key. Apache reads it as root before its workers start, so they need no access;
both sides refuse a key that others may read or change or that belongs to another user (a
local user could otherwise plant a key they know). The gate file's head carries
``HMAC(key, "OVTGATE2 file SLOTS TOKEN")`` (:meth:`GateSigner.keycheck`): the module maps only
a file written with its own key, so a file of a sidecar holding another key, or any other
file put at the path, is never used.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from overtake.controller.errors import SidecarInputError

__all__ = ["KEY_BYTES", "MAC_HEX", "GateSigner", "key_path", "load_key"]

#: key length in bytes (the file holds twice as many hex digits)
KEY_BYTES = 32
#: hex digits of the header's MAC (HMAC-SHA256 truncated to 128 bits)
MAC_HEX = 32


def key_path(gate_path: str) -> str:
    """The key file of the gate file ``gate_path`` (the module derives the same name)."""
    return gate_path + ".key"


def _create(path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES).hex().encode() + b"\n")
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic: fails if the other side created it meanwhile (theirs wins)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def load_key(path: str, option: str = "gate") -> tuple[bytes, int]:
    """The key in ``path``, created (0600, owned by this process's user) when missing, and the
    file's group: Apache's root parent gives the key file its workers' group (mode 0600 lets
    that group read nothing), and the sidecar gives that group to a gate file it creates.
    ``option`` (the sidecar's option: gate, control_file) opens every error message.

    Raises
    ------
    SidecarInputError
        The file cannot be read, is not a regular file, belongs to a user other than this
        process's or root, lets others read it or anyone but its owner change it, or does not
        hold 64 hex digits.
    """
    def refuse(why: str) -> SidecarInputError:
        return SidecarInputError(f"{option}: the {option.replace('_', ' ')} key {path} {why}")

    for attempt in (0, 1):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            break
        except FileNotFoundError:
            if attempt:
                raise refuse("vanished while it was created; start again") from None
            try:
                _create(path)
            except OSError as exc:
                raise refuse(f"cannot be created ({exc.strerror}); give {option} a path in a directory this "
                             "user may write (e.g. /dev/shm/overtake-gate)") from None
        except OSError as exc:
            raise refuse(f"cannot be read ({exc.strerror}); Apache creates it as root: run the sidecar as "
                         "root, or give it read access through the key's group (chgrp GROUP, chmod 0640)") from None
    try:
        st = os.fstat(fd)
        data = os.read(fd, 4 * KEY_BYTES) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise refuse("is not a regular file; remove it")
    if st.st_uid not in (os.geteuid(), 0):
        raise refuse(f"belongs to uid {st.st_uid}, not to root or this user: remove it (someone else may know it)")
    if st.st_mode & 0o027:
        raise refuse(f"has mode {stat.S_IMODE(st.st_mode):04o}: others may read or change it; chmod 0600 "
                     "(0640 to let a sidecar read it through its group) or remove it")
    text = data.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise refuse(f"does not hold {2 * KEY_BYTES} hex digits; remove it (either side creates a new one)")
    return key, st.st_gid


class GateSigner:
    """The MACs of one key: request headers and the gate file's key check."""

    def __init__(self, key: bytes) -> None:
        self._mac = hmac.new(key, digestmod=hashlib.sha256)  # the pad states, hashed once

    def _digest(self, msg: bytes) -> bytes:
        m = self._mac.copy()
        m.update(msg)
        return m.digest()

    def header(self, token: int, slot: int, gen: int) -> bytes:
        """The ``X-Overtake-Gate`` value ``SLOT GENERATION MAC`` of a request held on ``slot``."""
        mac = self._digest(b"%d %d %d" % (token, slot, gen))[:MAC_HEX // 2].hex().encode()
        return b"%d %d %s" % (slot, gen, mac)

    def keycheck(self, slots: int, token: int) -> bytes:
        """The 32 bytes the gate file's head carries so that Apache maps only a file of its key."""
        return self._digest(b"OVTGATE2 file %d %d" % (slots, token))
