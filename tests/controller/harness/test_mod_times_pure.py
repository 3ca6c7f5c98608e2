"""The request-time split's parts that need no Apache (``op_times_pure.c``, ``op_times_pure.h``).

Compiled with gcc alone and driven on stdin like ``test_mod_guard_pure.py``: a line of
``/proc/thread-self/schedstat`` (three decimal fields), with the edges a kernel never writes but a
parser must refuse (a fourth field, a sign, overflow), and the split of a wall time into CPU,
run-queue wait and blocked time. A real line of this process's own schedstat parses too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prio_helpers import build_driver, run_driver

INT64_MAX = 2**63 - 1

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "op_times_pure.h"

static size_t unescape(char *s)  /* \n in a test line is a newline */
{
    char *r = s, *w = s;
    while (*r) {
        if (r[0] == '\\' && r[1] == 'n') { *w++ = '\n'; r += 2; }
        else { *w++ = *r++; }
    }
    *w = 0;
    return (size_t)(w - s);
}

int main(void)
{
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (!strncmp(line, "STAT|", 5)) {
            op_schedstat st = {-1, -1, -1};
            size_t n = unescape(line + 5);
            int ok = op_schedstat_parse(line + 5, n, &st);
            printf("%d %lld %lld %lld", ok, (long long)st.cpu_ns, (long long)st.wait_ns, (long long)st.slices);
        }
        else if (!strncmp(line, "SPLIT|", 6)) {  /* SPLIT|wall|cpu|wait */
            op_times_split_t sp = {-1, -1, -1, -1};
            char *p = line + 6;
            long long wall = strtoll(p, &p, 10), cpu = strtoll(p + 1, &p, 10), wait = strtoll(p + 1, &p, 10);
            int ok = op_times_split(wall, cpu, wait, &sp);
            printf("%d %lld %lld %lld %lld", ok, (long long)sp.wall_ns, (long long)sp.cpu_ns,
                   (long long)sp.wait_ns, (long long)sp.blocked_ns);
        }
        printf("\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_driver(tmp_path_factory.mktemp("op_times_pure"), DRIVER, ("op_times_pure.c",))


def test_schedstat_lines(driver: Path) -> None:
    cases = {
        r"79600238 659283348 40\n": "1 79600238 659283348 40",
        "1 2 3": "1 1 2 3",  # no newline (a short read)
        r"0 0 0\n": "1 0 0 0",
        f"{INT64_MAX} {INT64_MAX} 1": f"1 {INT64_MAX} {INT64_MAX} 1",
        f"{INT64_MAX + 1} 0 0": "0 -1 -1 -1",  # overflow
        "1 2": "0 -1 -1 -1",  # a field missing
        "1 2 3 4": "0 -1 -1 -1",  # a fourth field
        "1  2 3": "0 -1 -1 -1",  # two spaces
        "-1 2 3": "0 -1 -1 -1",
        "1 2 3x": "0 -1 -1 -1",
        r"1 2 3\n\n": "0 -1 -1 -1",  # anything after the newline
        "": "0 -1 -1 -1",
    }
    got = run_driver(driver, [f"STAT|{line}" for line in cases])
    assert got == list(cases.values())


def test_a_real_schedstat_line_parses(driver: Path) -> None:
    path = Path("/proc/thread-self/schedstat")
    if not path.exists():
        pytest.skip("no /proc/thread-self/schedstat (CONFIG_SCHED_INFO)")
    raw = path.read_text()
    fields = raw.split()
    (got,) = run_driver(driver, ["STAT|" + raw.replace("\n", "\\n")])
    assert got == "1 " + " ".join(fields)


def test_split(driver: Path) -> None:
    cases = {
        "100|30|20": "1 100 30 20 50",  # blocked = wall - cpu - wait
        "100|60|40": "1 100 60 40 0",  # never blocked
        "100|61|40": "1 100 61 40 0",  # clocks a little apart: 0, not -1
        "0|0|0": "1 0 0 0 0",
        "100|-1|0": "0 -1 -1 -1 -1",  # a clock went backwards: another thread's
        "100|0|-5": "0 -1 -1 -1 -1",
        "-1|0|0": "0 -1 -1 -1 -1",
        f"{INT64_MAX}|0|0": f"1 {INT64_MAX} 0 0 {INT64_MAX}",
    }
    assert run_driver(driver, [f"SPLIT|{c}" for c in cases]) == list(cases.values())
