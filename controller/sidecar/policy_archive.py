"""A policy archive (``.npz``) checked before it is loaded, with the memory it may take bounded.

A policy file is a zip of three ``.npy`` members: ``keys`` (int64 state ranks), ``spawn`` (an
integer table) and ``meta`` (JSON bytes). A small archive can declare members of any size and
deflate inflates about 1000:1, so :func:`check_archive` bounds what a load may inflate in three
ways before :meth:`overtake.mdp.Policy.load` sees the bytes:

* from the zip directory: each member at most ``max_array_bytes``, all members together at most
  ``max_inflated_bytes`` (refused without inflating anything);
* while inflating, in chunks, with nothing kept but ``meta``: a member that yields more bytes than
  its directory entry declares, or a running total beyond ``max_inflated_bytes``, is refused at
  that chunk (a directory can lie; the count cannot);
* each member's ``.npy`` header must describe exactly the bytes that follow it, with an integer
  dtype (int64 for ``keys``, uint8 for ``meta``): numpy then allocates what was counted, and the
  loader's ``astype`` copies stay within a small multiple of it.

The CRC of every member is checked on the way (zipfile raises at a member's end).
"""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

import numpy as np

from overtake.controller.errors import PolicyLoadError

__all__ = ["MAX_ARRAY_BYTES", "MAX_INFLATED_BYTES", "MAX_META_BYTES", "check_archive"]

#: ``policy_max_array_bytes``: the largest uncompressed member of a policy archive; 128 MiB holds
#: the spawn table of 5 million states (mdp.chain's cap) with 8 queues
MAX_ARRAY_BYTES = 128 << 20
#: ``policy_max_inflated_bytes``: all members of one archive together (keys + spawn + meta of the
#: largest policy the solver writes, with room to spare)
MAX_INFLATED_BYTES = 192 << 20
#: the metadata is JSON of the model (a few kB; routes add little): the one member held whole
MAX_META_BYTES = 16 << 20
_MEMBERS = frozenset({"keys.npy", "spawn.npy", "meta.npy"})
_CHUNK = 1 << 20


def check_archive(data: bytes, name: str, *, max_array_bytes: int = MAX_ARRAY_BYTES,
                  max_inflated_bytes: int = MAX_INFLATED_BYTES) -> dict[str, Any]:
    """Check a policy archive (see the module) and return its metadata.

    Raises
    ------
    PolicyLoadError
        Not a zip, an unknown or oversized member, more inflated bytes than declared or allowed,
        a ``.npy`` header that does not match its member, a bad CRC, or metadata that is not a
        JSON object. One line, naming the archive, the member and the setting to raise.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
            _check_directory(infos, name, max_array_bytes, max_inflated_bytes)
            budget = [max_inflated_bytes]
            meta = b""
            for info in infos:
                raw = _inflate_member(z, info, name, budget)
                if info.filename == "meta.npy":
                    meta = raw
    except PolicyLoadError:
        raise
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, NotImplementedError) as exc:
        raise PolicyLoadError(f"policy: {name}: not an overtake policy file (corrupt archive: {exc})") from None
    return _parse_meta(meta, name)


def _check_directory(infos: list[zipfile.ZipInfo], name: str, max_array_bytes: int, max_inflated_bytes: int) -> None:
    """Member names and declared sizes, before anything is inflated."""
    for info in infos:
        if info.filename not in _MEMBERS:
            raise PolicyLoadError(f"policy: {name}: not an overtake policy file (unexpected member "
                                  f"{info.filename!r}; expected keys, spawn and meta)")
        if info.file_size > max_array_bytes:
            raise PolicyLoadError(
                f"policy: {name}: member {info.filename} would inflate to {info.file_size} bytes, more "
                f"than policy_max_array_bytes = {max_array_bytes}; raise it if the policy is genuine")
    if len({i.filename for i in infos}) != len(infos):
        raise PolicyLoadError(f"policy: {name}: not an overtake policy file (a member appears twice)")
    if "meta.npy" not in {i.filename for i in infos}:
        raise PolicyLoadError(f"policy: {name}: not an overtake policy file (no meta)")
    total = sum(i.file_size for i in infos)
    if total > max_inflated_bytes:
        raise PolicyLoadError(
            f"policy: {name}: its members would inflate to {total} bytes in all, more than "
            f"policy_max_inflated_bytes = {max_inflated_bytes}; raise it if the policy is genuine")


def _inflate_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, budget: list[int]) -> bytes:
    """Inflate one member in chunks against its declared size and the archive's remaining
    ``budget[0]``; check its ``.npy`` header. Returns the member's bytes for ``meta``, else b""."""
    keep = info.filename == "meta.npy"
    if keep and info.file_size > MAX_META_BYTES:
        raise PolicyLoadError(f"policy: {name}: meta.npy declares {info.file_size} bytes, more than "
                              f"{MAX_META_BYTES}; not an overtake policy file")
    seen, head, kept = 0, b"", []
    with z.open(info) as f:
        while chunk := f.read(_CHUNK):
            seen += len(chunk)
            budget[0] -= len(chunk)
            if seen > info.file_size or budget[0] < 0:
                what = (f"more than the {info.file_size} bytes its directory entry declares" if seen > info.file_size
                        else "past policy_max_inflated_bytes for the whole archive")
                raise PolicyLoadError(f"policy: {name}: member {info.filename} inflates to {what}; "
                                      "not an overtake policy file")
            if len(head) < 4096:
                head += chunk[:4096 - len(head)]
            if keep:
                kept.append(chunk)
    _check_npy_header(head, seen, info.filename, name)
    return b"".join(kept)


def _check_npy_header(head: bytes, size: int, member: str, name: str) -> None:
    """The ``.npy`` header at the start of ``member`` (``size`` bytes in all) must describe an
    integer array of exactly the bytes after it."""
    buf = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(buf)
        shape, fortran, dtype = (np.lib.format.read_array_header_1_0(buf) if version == (1, 0)
                                 else np.lib.format.read_array_header_2_0(buf))
    except (ValueError, EOFError) as exc:
        raise PolicyLoadError(f"policy: {name}: member {member} is not a .npy array ({exc}); "
                              "not an overtake policy file") from None
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    want = {"keys.npy": "an int64", "meta.npy": "a uint8"}.get(member, "an integer")
    ok = dtype.kind in "iu" and (member != "keys.npy" or dtype.itemsize == 8) and (
        member != "meta.npy" or dtype.itemsize == 1)
    if not ok or fortran and len(shape) > 1:
        raise PolicyLoadError(f"policy: {name}: member {member} holds {dtype} "
                              f"{'(Fortran order) ' if fortran else ''}where {want} array belongs; "
                              "not an overtake policy file")
    if buf.tell() + count * dtype.itemsize != size:
        raise PolicyLoadError(f"policy: {name}: member {member} declares shape {tuple(shape)} of {dtype} "
                              f"but holds {size - buf.tell()} data bytes; not an overtake policy file")


def _parse_meta(raw: bytes, name: str) -> dict[str, Any]:
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
        meta = json.loads(bytes(arr).decode())
    except (ValueError, TypeError, EOFError) as exc:
        raise PolicyLoadError(f"policy: {name}: meta is not JSON ({exc}); not an overtake policy file") from None
    if not isinstance(meta, dict):
        raise PolicyLoadError(f"policy: {name}: meta must be a mapping (a JSON object), got "
                              f"{type(meta).__name__ if meta is not None else 'null'}; not an overtake policy file")
    return meta
