"""The priority-inversion guard's parts that need no Apache (``op_guard_pure.c``, ``op_guard_pure.h``).

Compiled with gcc alone and driven on stdin like ``test_mod_pure.py``: the words of
``OvertakePrioExemptMethods`` and ``OvertakePrioExemptPath``, which requests they exempt, and the
due time of a demoted request under ``OvertakePrioDemotionLimit``. Known answers with the edges:
lower-case methods, ``unsafe`` against GET/HEAD, path prefixes on a segment boundary, a limit
reached exactly, and overflow near INT64_MAX.
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
#include "op_guard_pure.h"

int main(void)
{
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        char *f[16];
        int n = 0, release = -1;
        char *p = line;
        line[strcspn(line, "\n")] = 0;
        for (;;) {  /* fields separated by '|' */
            char *bar = strchr(p, '|');
            f[n++] = p;
            if (!bar || n == 16) {
                break;
            }
            *bar = 0;
            p = bar + 1;
        }
        if (!strcmp(f[0], "WORD")) {
            printf("%d", (int)op_guard_method_word(f[1]));
        }
        else if (!strcmp(f[0], "METHOD")) {  /* METHOD|unsafe|method|names... */
            printf("%d", op_guard_method_exempt(atoi(f[1]), (const char *const *)f + 3, n - 3, f[2]));
        }
        else if (!strcmp(f[0], "PATHOK")) {
            printf("%d", op_guard_path_ok(f[1]));
        }
        else if (!strcmp(f[0], "PATH")) {
            printf("%d", op_guard_path_match(f[1], f[2]));
        }
        else if (!strcmp(f[0], "DUE")) {  /* DUE|now|since|limit|due */
            long long d = op_guard_due(strtoll(f[1], NULL, 10), strtoll(f[2], NULL, 10),
                                       strtoll(f[3], NULL, 10), strtoll(f[4], NULL, 10), &release);
            printf("%lld %d", d, release);
        }
        printf("\n");
    }
    return 0;
}
"""

BAD, METHOD, UNSAFE = range(3)  # op_guard_word


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_driver(tmp_path_factory.mktemp("op_guard_pure"), DRIVER, ("op_guard_pure.c",))


def test_method_words(driver: Path) -> None:
    cases = {"POST": METHOD, "PROPFIND": METHOD, "VERSION-CONTROL": METHOD, "unsafe": UNSAFE, "UNSAFE": UNSAFE,
             "post": BAD, "": BAD, "PO ST": BAD, "GET1": BAD, "X" * 32: METHOD, "X" * 33: BAD}
    got = run_driver(driver, [f"WORD|{w}" for w in cases])
    assert [int(g) for g in got] == list(cases.values())


def test_method_exemption(driver: Path) -> None:
    cases = [
        ("1", "POST", [], 1), ("1", "PUT", [], 1), ("1", "DELETE", [], 1), ("1", "OPTIONS", [], 1),
        ("1", "GET", [], 0), ("1", "HEAD", [], 0),  # unsafe: everything but GET and HEAD
        ("0", "POST", [], 0), ("0", "POST", ["PUT", "POST"], 1), ("0", "GET", ["POST"], 0),
        ("0", "GET", ["GET"], 1), ("0", "post", ["POST"], 0),  # methods are case-sensitive
    ]
    got = run_driver(driver, ["|".join(["METHOD", u, m, *names]) for u, m, names, _ in cases])
    assert [int(g) for g in got] == [want for *_, want in cases]


def test_path_prefixes(driver: Path) -> None:
    ok = {"/": 1, "/api.php": 1, "/w/": 1, "api.php": 0, "": 0, "/a b": 0, "/api.php?action=edit": 0, "/x#y": 0}
    assert [int(g) for g in run_driver(driver, [f"PATHOK|{w}" for w in ok])] == list(ok.values())
    cases = [("/api", "/api", 1), ("/api", "/api/x", 1), ("/api", "/apix", 0), ("/api/", "/api/x", 1),
             ("/api/", "/api", 0), ("/", "/anything", 1), ("/api.php", "/api.php", 1), ("/api.php", "/api", 0),
             ("/index.php", "/index.phpx", 0)]
    got = run_driver(driver, [f"PATH|{pre}|{path}" for pre, path, _ in cases])
    assert [int(g) for g in got] == [want for *_, want in cases]


def test_demotion_limit_due(driver: Path) -> None:
    cases = [
        # (now, since, limit, due) -> (due, release)
        ((100, 50, 0, 500), (500, 0)),          # no limit: the threshold's due time
        ((100, 50, 0, INT64_MAX), (INT64_MAX, 0)),
        ((100, 50, 200, 500), (250, 0)),        # the limit ends first
        ((100, 50, 200, 180), (180, 0)),        # the next threshold comes first
        ((100, 50, 200, INT64_MAX), (250, 0)),  # at the last level: only the limit
        ((249, 50, 200, INT64_MAX), (250, 0)),
        ((250, 50, 200, INT64_MAX), (INT64_MAX, 1)),  # reached exactly: released
        ((900, 50, 200, 300), (INT64_MAX, 1)),
        ((INT64_MAX - 5, INT64_MAX - 10, 100, INT64_MAX), (INT64_MAX, 0)),  # since + limit saturates
        ((INT64_MAX - 20, INT64_MAX - 10, 100, 7), (7, 0)),
    ]
    got = run_driver(driver, ["DUE|" + "|".join(str(v) for v in args) for args, _ in cases])
    assert [tuple(int(x) for x in g.split()) for g in got] == [want for _, want in cases]
