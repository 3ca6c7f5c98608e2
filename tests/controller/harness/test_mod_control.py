"""The control file's check (``oc_table.h``, compiled with gcc) on files the sidecar's writer makes.

Cross-check: :func:`overtake.controller.sidecar.control_file.encode` writes a table, the module's
``oc_check`` reads back the same thresholds in nanoseconds. Known refusals, one per field: a
short file, another magic, a generation the writer holds (odd), too many stages, a size that is
not the stage count's, a MAC of another key or of changed bytes, a level count other than the
configured one, an unknown flag or a reserved field set, thresholds not positive, increasing and
at most 3600 s, and trailing thresholds not 0. The exemption flag (bit 0) is accepted.
"""

from __future__ import annotations

import hashlib
import hmac
import shutil
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from overtake.controller.sidecar.control_file import MAGIC, MAX_LEVELS, ControlFile, encode, no_demotion

REPO = Path(__file__).resolve().parents[3]
MODULE_DIR = REPO / "apache-conf" / "mod_overtake_prio"
KEY = bytes(range(32))

(OK, SHORT, MAGIC_BAD, BUSY, STAGES, SIZE, LEVELS, MAC, FLAGS, THRESHOLDS) = range(10)

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include "oc_table.h"

static oc_table t;
static uint8_t buf[OC_MAX_BYTES + 4096];

int main(int argc, char **argv)
{
    uint8_t key[32];
    og_hmac_key k;
    int i;
    if (argc < 3 || !og_unhex(argv[1], 32, key)) {
        return 2;
    }
    og_hmac_init(&k, key, 32);
    for (i = 3; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
        oc_status st;
        uint32_t r, lv;
        if (f) {
            fclose(f);
        }
        st = oc_check(buf, n, (uint32_t)atoi(argv[2]), &k, &t);
        printf("%d", (int)st);
        if (st == OC_OK) {
            printf(" %u %u %u", t.generation, t.stages, t.levels);
            for (r = 0; r <= t.stages; r++) {
                printf(" |%u", t.rows[r].flags);
                for (lv = 0; lv < t.levels; lv++) {
                    printf(" %lld", (long long)t.rows[r].thr_ns[lv]);
                }
            }
        }
        printf("\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed (apache-conf/install-debian-packages.sh installs it)")
    d = tmp_path_factory.mktemp("oc_table")
    (d / "driver.c").write_text(DRIVER)
    exe = d / "driver"
    subprocess.run([gcc, "-O2", "-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wmissing-prototypes",
                    "-Werror", "-I", str(MODULE_DIR), "-o", str(exe), str(d / "driver.c")],
                   check=True, capture_output=True, text=True)
    return exe


def check(exe: Path, tmp: Path, files: Sequence[bytes], levels: int = 1, key: bytes = KEY) -> list[str]:
    paths = []
    for i, data in enumerate(files):
        p = tmp / f"ctl{i}"
        p.write_bytes(data)
        paths.append(str(p))
    out = subprocess.run([str(exe), key.hex(), str(levels), *paths], capture_output=True, text=True, check=True,
                         timeout=60)
    return out.stdout.splitlines()


def raw(gen: int, stages: int, levels: int, rows: Sequence[Sequence[int]], flags: Sequence[int] = (),
        reserved: int = 0, key: bytes = KEY) -> bytes:
    """A file with any fields (no check of its own), MAC'd with ``key``."""
    head = MAGIC + struct.pack("<IIIIII", gen, stages, levels, 0, 0, reserved)  # 20, 24: the stage section
    body = b"".join(struct.pack("<II8q", flags[i] if i < len(flags) else 0, 0,
                                *(list(r) + [0] * (MAX_LEVELS - len(r)))) for i, r in enumerate(rows))
    return head + hmac.new(key, head + body, hashlib.sha256).digest() + body


def test_the_writers_table_reads_back(driver: Path, tmp_path: Path) -> None:
    two = encode(KEY, 6, 2, [[0.0125], [0.0125]])
    three = encode(KEY, 8, 3, [[0.001, 0.02], [0.002, 0.03], [0.004, 3600.0]])
    none = encode(KEY, 10, 2, None)
    assert len(two) == 64 + 3 * 72
    out = check(driver, tmp_path, [two], levels=1) + check(driver, tmp_path, [three], levels=2) \
        + check(driver, tmp_path, [none], levels=2)
    assert out[0] == "0 6 2 1 |0 12500000 |0 12500000 |0 12500000"
    # row 0 (every request) is the first stage's
    assert out[1] == ("0 8 3 2 |0 1000000 20000000 |0 1000000 20000000 |0 2000000 30000000 "
                      "|0 4000000 3600000000000")
    assert out[2] == "0 10 2 0 |0 |0 |0"  # no thresholds: whatever the configured level count


def test_each_field_is_checked(driver: Path, tmp_path: Path) -> None:
    good = encode(KEY, 4, 1, [[0.01]])
    odd = bytearray(good)
    odd[8] = 5
    stages = bytearray(good)
    stages[12:16] = struct.pack("<I", 256)
    flipped = bytearray(good)
    flipped[64 + 8] ^= 1  # a threshold byte: the MAC no longer matches
    files = [
        good[:63], b"OVTGATE2" + good[8:], bytes(odd), bytes(stages), good[:-1], good + b"\0" * 72,
        encode(b"\1" * 32, 4, 1, [[0.01]]), bytes(flipped),
        raw(4, 1, 1, [[10**7], [10**7]], flags=[0, 2]),                  # unknown flag bit
        raw(4, 1, 1, [[10**7], [10**7]], reserved=1),                    # reserved head field
        raw(4, 1, 1, [[10**7], [0]]),                                    # not > 0
        raw(4, 1, 1, [[10**7], [3600 * 10**9 + 1]]),                     # above 3600 s
        raw(4, 1, 1, [[10**7], [10**7, 5]]),                             # a threshold past the level count
        raw(4, 0, 0, [[5]]),                                             # no levels, yet a threshold
        raw(4, 1, 1, [[10**7], [10**7]], flags=[1, 1]),                  # the exemption flag: accepted
    ]
    out = check(driver, tmp_path, files, levels=1)
    assert [int(o.split()[0]) for o in out] == [SHORT, MAGIC_BAD, BUSY, STAGES, SIZE, SIZE, MAC, MAC, FLAGS, FLAGS,
                                                THRESHOLDS, THRESHOLDS, THRESHOLDS, THRESHOLDS, OK]
    assert out[-1] == "0 4 1 1 |1 10000000 |1 10000000"
    two = [raw(4, 1, 2, [[10**7, 10**8], [10**7, 10**7]]), raw(4, 1, 2, [[10**7, 10**8], [10**8, 10**7]]),
           raw(4, 1, 2, [[10**7, 10**8], [10**7, 10**8]])]
    assert [int(o.split()[0]) for o in check(driver, tmp_path, two, levels=2)] == [THRESHOLDS, THRESHOLDS, OK]
    # a table of 2 levels where 1 is configured, and of 1 where 2 are
    assert check(driver, tmp_path, [two[2]], levels=1)[0] == str(LEVELS)
    assert check(driver, tmp_path, [good], levels=2)[0] == str(LEVELS)


def test_the_writer_refuses_what_the_module_would(tmp_path: Path) -> None:
    for rows, stages, why in [([[0.01, 0.005]], 1, "increasing"), ([[0.0]], 1, "increasing"),
                              ([[4000.0]], 1, "3600"), ([[0.01], [0.01, 0.02]], 2, "thresholds, the first stage"),
                              ([[0.01]], 2, "1 rows of thresholds for 2 stages"), ([[0.01] * 9], 1, "at most 8"),
                              ([[float("nan")]], 1, "increasing")]:
        with pytest.raises(ValueError, match=why):
            encode(KEY, 2, stages, rows)
    with pytest.raises(ValueError, match="at most 255"):
        encode(KEY, 2, 256, None)


def test_the_file_keeps_its_inode_and_generation_across_writers(tmp_path: Path) -> None:
    path = str(tmp_path / "control")
    f = ControlFile(path)
    assert f.write(2, [[0.01], [0.01]]) == 2 and f.write(2, None) == 4
    ino = Path(path).stat().st_ino
    f.close()
    g = ControlFile(path)  # a restarted sidecar: the next generation, the same inode
    assert g.write(2, [[0.02], [0.02]]) == 6
    assert Path(path).stat().st_ino == ino and Path(path).stat().st_mode & 0o777 == 0o640
    key = bytes.fromhex(Path(path + ".key").read_text().strip())
    assert Path(path).read_bytes() == encode(key, 6, 2, [[0.02], [0.02]])
    g.close()


def test_the_no_demotion_table_is_the_modules_largest(driver: Path, tmp_path: Path) -> None:
    """Apache's default in the verifier's windows: as many thresholds as the module has
    configured, ending at its largest (3600 s of thread CPU, which no request reaches), accepted."""
    one = encode(KEY, 12, 2, [list(no_demotion(1))] * 2)
    three = encode(KEY, 14, 1, [list(no_demotion(3))])
    out = check(driver, tmp_path, [one], levels=1) + check(driver, tmp_path, [three], levels=3)
    assert out[0] == "0 12 2 1 |0 3600000000000 |0 3600000000000 |0 3600000000000"
    assert out[1] == "0 14 1 3 |0 3599998000000 3599999000000 3600000000000 |0 3599998000000 3599999000000 3600000000000"
