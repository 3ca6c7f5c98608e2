"""The count table and the queue arithmetic of module mode (``os_table.h``, compiled with gcc).

Cross-checks: :class:`~overtake.controller.sidecar.count_table.CountTable` writes a section
into a control file (:func:`~overtake.controller.sidecar.control_file.encode`); the module's
``oc_check`` accepts it and its ``os_lookup`` gives the table's answer for every observation,
inside the caps and beyond them (the documented default, mirrored by ``CountTable.lookup``).
Known answers: π(1,3) of two stages. Known refusals, one per field of the section. The queue:
tickets in order, grants oldest first, a request that gives up is skipped by later grants and
conserves the counts (waiting + running = arrivals − completions).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from overtake.controller.sidecar.control_file import encode
from overtake.controller.sidecar.count_table import CountTable, from_policy
from overtake.controller.sidecar.policies import BaselinePolicy

REPO = Path(__file__).resolve().parents[3]
MODULE_DIR = REPO / "apache-conf" / "mod_overtake_prio"
KEY = bytes(range(32))
OC_OK, OC_SECTION = 0, 10
(OS_OK, OS_SHORT, OS_STAGES, OS_NAME, OS_CAPS, OS_SIZE, OS_ACTION, OS_RESERVED) = range(8)

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "oc_table.h"

static oc_table t;
static uint8_t buf[OC_FILE_MAX_BYTES];

static size_t slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
    if (f) {
        fclose(f);
    }
    return n;
}

/* file: the control file, then groups of 2n counts: print the module's answer to each */
static int lookup(int argc, char **argv)
{
    uint8_t key[32];
    og_hmac_key k;
    int i;
    size_t n = slurp(argv[2]);
    oc_status st;
    if (!og_unhex(argv[1], 32, key)) {
        return 2;
    }
    og_hmac_init(&k, key, 32);
    st = oc_check(buf, n, 1, &k, &t);
    printf("%d %u", (int)st, t.section);
    if (st == OC_OK && t.section) {
        uint32_t m = t.counts.n;
        printf(" %u", m);
        for (i = 3; i + 2 * (int)m <= argc; i += 2 * (int)m) {
            int32_t w[OS_MAX_TSTAGES], kk[OS_MAX_TSTAGES];
            uint8_t a[OS_MAX_TSTAGES];
            uint32_t j;
            for (j = 0; j < m; j++) {
                w[j] = atoi(argv[i + j]);
                kk[j] = atoi(argv[i + m + j]);
            }
            os_lookup(&t.counts, w, kk, a);
            printf(" |");
            for (j = 0; j < m; j++) {
                printf(" %u", a[j]);
            }
        }
    }
    printf("\n");
    return 0;
}

/* a raw section: its os_status */
static int section(const char *path)
{
    os_table s;
    size_t n = slurp(path);
    printf("%d\n", (int)os_check(buf, n, &s));
    return 0;
}

/* a scripted queue: a = arrive, g<N> = grant N, n<N> = grant N newest first, x<T> = ticket T
 * gives up, c = complete, q<T> = granted in turn, s<T> = started (in turn or not) */
static int queue(int argc, char **argv)
{
    static os_queue q;
    int i;
    for (i = 2; i < argc; i++) {
        const char *op = argv[i];
        uint32_t bits = 0, tk = 0;
        if (op[0] == 'a') {
            int ok = os_enqueue(&q, &tk);
            printf("a%d:%u ", ok, tk);
        }
        else if (op[0] == 'g') {
            int32_t n = os_grant(&q, atoi(op + 1), &bits);
            printf("g%d:%x ", n, bits);
        }
        else if (op[0] == 'n') {
            int32_t n = os_grant_newest(&q, atoi(op + 1), &bits);
            printf("n%d:%x ", n, bits);
        }
        else if (op[0] == 's') {
            printf("s%d ", os_started(&q, q.head, (uint32_t)atoi(op + 1)));
        }
        else if (op[0] == 'x') {
            printf("x%d ", os_give_up(&q, (uint32_t)atoi(op + 1)));
        }
        else if (op[0] == 'c') {
            os_complete(&q);
            printf("c ");
        }
        else if (op[0] == 'q') {
            printf("q%d ", os_granted(q.head, (uint32_t)atoi(op + 1)));
        }
    }
    printf("| %u %u %d %d\n", q.head, q.tail, q.waiting, q.active);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 3 && !strcmp(argv[1], "section")) {
        return section(argv[2]);
    }
    if (argc >= 2 && !strcmp(argv[1], "queue")) {
        return queue(argc, argv);
    }
    if (argc >= 3) {
        return lookup(argc, argv);
    }
    return 2;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed (apache-conf/install-debian-packages.sh installs it)")
    d = tmp_path_factory.mktemp("os_table")
    (d / "driver.c").write_text(DRIVER)
    exe = d / "driver"
    subprocess.run([gcc, "-O1", "-Wall", "-Wextra", "-Werror", f"-I{MODULE_DIR}", "-o", str(exe), str(d / "driver.c")],
                   check=True, capture_output=True, text=True)
    return exe


def _run(exe: Path, *args: str) -> str:
    return subprocess.run([str(exe), *args], check=True, capture_output=True, text=True).stdout.strip()


def _file(tmp: Path, table: CountTable, name: str = "control") -> Path:
    p = tmp / name
    p.write_bytes(encode(KEY, 2, 2, [[0.005], [0.005]], table.encode()))
    return p


def test_pi_1_3_known_answers_and_cross_check(driver: Path, tmp_path: Path) -> None:
    table = from_policy(BaselinePolicy("pi(1,3)", 2), ["views", "edits"])
    assert table is not None
    assert table.kcap == (1, 3)
    obs = [(3, 2, 0, 0), (3, 2, 1, 3), (0, 5, 0, 1), (7, 7, 1, 2), (1, 1, 2, 0), (9, 0, 0, 4), (2, 300, 0, 0)]
    # beyond the caps too: waiting 7, 9, 300 (read as the cap), running 2 > 1 and 4 > 3 (start nothing)
    expect = [(1, 2), (0, 0), (0, 2), (0, 1), (0, 0), (0, 0), (1, 3)]
    assert [table.lookup(o[:2], o[2:]) for o in obs] == expect
    out = _run(driver, KEY.hex(), str(_file(tmp_path, table)), *(str(v) for o in obs for v in o)).split(" |")
    assert out[0] == f"{OC_OK} 1 2"
    assert [tuple(int(x) for x in part.split()) for part in out[1:]] == expect


def test_every_observation_agrees(driver: Path, tmp_path: Path) -> None:
    """A random table of three stages: the C lookup equals the Python one on every cell and beyond."""
    rng = np.random.default_rng(7)
    wcap, kcap = (2, 1, 3), (1, 2, 1)
    n_cells = 1
    for w, k in zip(wcap, kcap):
        n_cells *= (w + 1) * (k + 1)
    grid = np.array(list(itertools.product(*[range(w + 1) for w in wcap], *[range(k + 1) for k in kcap])))
    acts = np.minimum(rng.integers(0, 3, size=(n_cells, 3)), grid[:, :3]).astype(np.uint8)
    table = CountTable(("a", "b", "c"), wcap, kcap, acts)
    probe = [tuple(int(v) for v in row) for row in itertools.product(range(5), range(3), range(5), range(3),
                                                                     range(4), range(3))]
    out = _run(driver, KEY.hex(), str(_file(tmp_path, table)), *(str(v) for o in probe for v in o)).split(" |")
    assert out[0] == f"{OC_OK} 1 3"
    got = [tuple(int(x) for x in part.split()) for part in out[1:]]
    assert got == [table.lookup(o[:3], o[3:]) for o in probe]
    assert any(g != (0, 0, 0) for g in got)


def _section(n: int, entries: list[tuple[bytes, int, int]], cells: bytes, reserved: int = 0) -> bytes:
    return (struct.pack("<II", n, reserved) + b"".join(nm.ljust(32, b"\0")[:32] + struct.pack("<II", w, k)
                                                        for nm, w, k in entries) + cells)


@pytest.mark.parametrize(("data", "status"), [
    (_section(1, [(b"a", 0, 1)], bytes(2)), OS_OK),
    (b"\x01\x00", OS_SHORT),
    (_section(1, [], b""), OS_SHORT),
    (_section(0, [], b""), OS_STAGES),
    (_section(9, [(b"s%d" % i, 0, 0) for i in range(9)], bytes(9)), OS_STAGES),
    (_section(1, [(b"", 0, 1)], bytes(2)), OS_NAME),
    (_section(1, [(b"a b", 0, 1)], bytes(2)), OS_NAME),
    (_section(1, [(b"a\0x", 0, 1)], bytes(2)), OS_NAME),
    (_section(2, [(b"a", 0, 0), (b"a", 0, 0)], bytes(2)), OS_NAME),
    (_section(1, [(b"a", 256, 0)], bytes(257)), OS_CAPS),
    (_section(3, [(b"a", 255, 255), (b"b", 255, 255), (b"c", 1, 1)], b""), OS_CAPS),
    (_section(1, [(b"a", 0, 1)], bytes(3)), OS_SIZE),
    (_section(1, [(b"a", 1, 0)], bytes([0, 2])), OS_ACTION),
    (_section(1, [(b"a", 1, 0)], bytes([1, 0])), OS_ACTION),
    (_section(1, [(b"a", 0, 1)], bytes(2), reserved=1), OS_RESERVED),
])
def test_section_refusals(driver: Path, tmp_path: Path, data: bytes, status: int) -> None:
    p = tmp_path / "section"
    p.write_bytes(data)
    assert _run(driver, "section", str(p)) == str(status)


def test_control_file_with_a_bad_section_is_refused(driver: Path, tmp_path: Path) -> None:
    bad = _section(1, [(b"a", 1, 0)], bytes([0, 2]))
    p = tmp_path / "control"
    p.write_bytes(encode(KEY, 2, 1, None, bad))
    assert _run(driver, KEY.hex(), str(p)).split()[0] == str(OC_SECTION)
    raw = bytearray(encode(KEY, 2, 1, None, None))
    raw[20] = 1  # a section announced, none there (the MAC is recomputed: only the section check refuses)
    raw[32:64] = hmac.new(KEY, bytes(raw[:32]) + bytes(raw[64:]), hashlib.sha256).digest()
    p.write_bytes(bytes(raw))
    assert _run(driver, KEY.hex(), str(p)).split()[0] == str(OC_SECTION)


def test_queue_grants_oldest_first_and_skips_the_gone(driver: Path) -> None:
    out = _run(driver, "queue", "a", "a", "a", "g1", "x1", "q1", "g1", "q2", "c", "c", "c", "a", "g5")
    ops, state = out.split("| ")
    # tickets 0,1,2; grant 1 -> ticket 0 (bit 0); ticket 1 gives up (runs: active 2, not granted); the next
    # grant skips it and starts ticket 2 (bit 2); three completions; ticket 3 arrives, grant 5 -> 1
    assert ops.split() == ["a1:0", "a1:1", "a1:2", "g1:1", "x0", "q0", "g1:4", "q1", "c", "c", "c", "a1:3",
                           "g1:8"]
    head, tail, waiting, active = (int(v) for v in state.split())
    assert (head, tail, waiting, active) == (4, 4, 0, 1)
    # conservation: waiting + running = arrivals (4) - completions (3)
    assert waiting + active == 4 - 3


def test_queue_grants_newest_first_and_the_head_skips_them(driver: Path) -> None:
    out = _run(driver, "queue", "a", "a", "a", "a", "n2", "q3", "s3", "s2", "s1", "x3", "g1", "n5", "s1", "c", "c",
               "c", "c", "a", "g1")
    ops, state = out.split("| ")
    # tickets 0-3; two starts newest first: 3 then 2 (bits 8 | 4), started though the head did not pass
    # them, and a give-up after its start keeps it; one in turn starts 0 (bit 1); newest first again
    # skips the started 3 and 2 and takes 1 (bit 2); four completions; ticket 4 arrives, the head
    # skips 2 and 3 (started out of turn) and grants it (bit 16)
    assert ops.split() == ["a1:0", "a1:1", "a1:2", "a1:3", "n2:c", "q0", "s1", "s1", "s0", "x1", "g1:1", "n1:2",
                           "s1", "c", "c", "c", "c", "a1:4", "g1:10"]
    head, tail, waiting, active = (int(v) for v in state.split())
    assert (head, tail, waiting, active) == (5, 5, 0, 1)
    assert waiting + active == 5 - 4  # conservation: arrivals less completions


def test_queue_newest_first_moves_the_head_past_the_gone(driver: Path) -> None:
    # tickets 0-2; 0 gives up (runs); a start newest first takes 2, and the head passes 0 (gone) to
    # 1, still waiting; 1 gives up; a start finds nobody, and the head passes 1 and 2: the ring is
    # free again, though nothing was started in turn
    out = _run(driver, "queue", "a", "a", "a", "x0", "n1", "x1", "n1")
    assert out == "a1:0 a1:1 a1:2 x0 n1:4 x0 n0:0 | 3 3 0 3"


def test_queue_give_up_after_grant_keeps_the_grant(driver: Path) -> None:
    out = _run(driver, "queue", "a", "g1", "x0")
    assert out == "a1:0 g1:1 x1 | 1 1 0 1"


def test_queue_ring_is_bounded(driver: Path) -> None:
    out = _run(driver, "queue", *(["a"] * 4097))
    ops, state = out.split("| ")
    assert ops.split()[-1] == "a0:0"  # the 4097th finds the ring full: it runs without a ticket
    assert state.split()[1:3] == ["4096", "4096"]
