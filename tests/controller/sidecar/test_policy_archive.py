"""Policy archives that would take more memory than their size says (controller.sidecar.policy_archive).

Known answers: a genuine policy passes and loads; each crafted archive is refused with one line
naming the setting or the member, and the Python heap (tracemalloc sees numpy's buffers too)
never holds more than a few MiB while refusing it.
"""

from __future__ import annotations

import io
import json
import struct
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from support.service_helpers import inflating_archive, small_policy

from overtake.controller.errors import PolicyLoadError
from overtake.controller.sidecar.policies import load_policy, load_policy_bytes
from overtake.controller.sidecar.policy_archive import check_archive

MiB = 1 << 20
STAGES = ("stage1", "stage2")


def _npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _meta_member() -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.frombuffer(json.dumps({"format": "overtake-policy"}).encode(), dtype=np.uint8))
    return buf.getvalue()


def _zeros_member(z: zipfile.ZipFile, name: str, dtype: str, n_bytes: int) -> None:
    """``name`` declaring (and holding) ``n_bytes`` of zeros of ``dtype``, deflated ~1000:1."""
    item = np.dtype(dtype).itemsize
    with z.open(name, "w") as f:
        f.write(_npy_header(dtype, (n_bytes // item,)))
        zero = bytes(4 * MiB)
        left = n_bytes // item * item
        while left:
            f.write(zero[:min(left, len(zero))])
            left -= min(left, len(zero))


def _archive(build: Callable[[zipfile.ZipFile], None]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        build(z)
    return buf.getvalue()


def _peak_while(fn: Callable[[], object]) -> tuple[int, BaseException | None]:
    """(peak traced bytes while ``fn`` ran, the exception it raised)."""
    tracemalloc.start()
    try:
        fn()
        err = None
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        err = exc
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, err


@pytest.fixture(scope="module")
def three_members() -> bytes:
    """About 400 KB declaring three members of 127 MiB each: every one under the 128 MiB member
    cap, 381 MiB in all."""
    data = inflating_archive(127 * MiB)
    assert len(data) < 1 * MiB
    return data


def test_a_genuine_policy_passes_and_loads(tmp_path: Path) -> None:
    path = small_policy(tmp_path / "p.npz")
    meta = check_archive(path.read_bytes(), "p.npz")
    assert meta["format"] == "overtake-policy" and meta["states"] > 0
    pol = load_policy(str(path), STAGES)
    assert pol.name == "p.npz"


def test_total_inflated_size_is_bounded_before_inflating(three_members: bytes) -> None:
    """Refused from the zip directory with the total and the setting named; the heap stays at a
    few MiB (each member alone passes the per-member cap; their sum must not be inflated)."""
    peak, err = _peak_while(lambda: load_policy_bytes(three_members, "bomb.npz", STAGES))
    assert peak < 8 * MiB, peak
    assert isinstance(err, PolicyLoadError), err
    assert f"policy_max_inflated_bytes = {192 * MiB}" in str(err) and "bomb.npz" in str(err), err


def _lying_directory(declared: int, actual: int) -> bytes:
    """spawn.npy whose central-directory entry declares ``declared`` bytes while its deflate
    stream inflates to ``actual`` (a genuine keys and meta around it)."""
    real = bytearray(_archive(lambda z: (z.writestr("keys.npy", _npy_header("<i8", (1,)) + bytes(8)),
                                         _zeros_member(z, "spawn.npy", "<i2", actual),
                                         z.writestr("meta.npy", _meta_member()))))
    pos = real.find(b"PK\x01\x02")  # central directory entries
    patched = 0
    while pos != -1:
        name_len = struct.unpack_from("<H", real, pos + 28)[0]
        if bytes(real[pos + 46:pos + 46 + name_len]) == b"spawn.npy":
            struct.pack_into("<I", real, pos + 24, declared)  # its uncompressed size
            patched += 1
        pos = real.find(b"PK\x01\x02", pos + 4)
    assert patched == 1
    return bytes(real)


def test_a_directory_that_understates_a_member_is_refused() -> None:
    """spawn.npy declares 1 KiB and inflates to 64 MiB: inflation stops at the declared size and
    the member is refused (CRC); the heap never holds the 64 MiB."""
    data = _lying_directory(1024, 64 * MiB)
    peak, err = _peak_while(lambda: load_policy_bytes(data, "liar.npz", STAGES))
    assert isinstance(err, PolicyLoadError), err
    assert "liar.npz" in str(err) and "not an overtake policy file" in str(err), err
    assert peak < 8 * MiB, peak


def test_keys_of_a_narrow_dtype_are_refused() -> None:
    """keys.npy of 16 MiB uint8: the loader's astype(int64) would make 128 MiB of it (and its
    diff as much again). Refused: keys must be int64 (on main it was widened)."""
    data = _archive(lambda z: (_zeros_member(z, "keys.npy", "|u1", 16 * MiB),
                               z.writestr("spawn.npy", _npy_header("<i2", (1, 2)) + bytes(4)),
                               z.writestr("meta.npy", _meta_member())))
    peak, err = _peak_while(lambda: load_policy_bytes(data, "narrow.npz", STAGES))
    assert peak < 8 * MiB, peak
    assert isinstance(err, PolicyLoadError) and "keys.npy holds uint8 where an int64 array belongs" in str(err), err


def test_a_header_that_overstates_its_data_is_refused() -> None:
    """spawn.npy's header says 10**9 int64 where 16 bytes follow: refused before numpy allocates."""
    data = _archive(lambda z: (z.writestr("keys.npy", _npy_header("<i8", (2,)) + bytes(16)),
                               z.writestr("spawn.npy", _npy_header("<i8", (10**9,)) + bytes(16)),
                               z.writestr("meta.npy", _meta_member())))
    with pytest.raises(PolicyLoadError, match=r"spawn\.npy declares shape \(1000000000,\) of int64 but holds 16"):
        check_archive(data, "over.npz")
