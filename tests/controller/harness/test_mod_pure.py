"""mod_overtake_prio's parts that need no Apache (``op_pure.c``, ``op_pure.h``), compiled with gcc.

A small driver reads commands on stdin (fields separated by ``|``, so that words may hold
blanks) and prints what the module's functions return: the per-level directives
(``OvertakePrioLevels``, ``OvertakePrioNice``), the seconds and integer values of the others, the
class and gate headers, and the level arithmetic of the monitor (the level a request's attained
CPU reaches, when it can cross its next threshold, when the monitor wakes next). Known answers,
with the edge cases: no word, too many, unsorted, out of range, overflow, trailing characters.
"""

from __future__ import annotations

import bisect
import random
from pathlib import Path

import pytest
from prio_helpers import build_driver, run_driver

INT64_MAX = 2**63 - 1

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "op_pure.h"

#define MAXF 16

static int split(char *line, char **f)
{
    int n = 0;
    char *p = line;
    for (;;) {
        char *bar = strchr(p, '|');
        if (n == MAXF) {
            break;
        }
        f[n++] = p;
        if (!bar) {
            break;
        }
        *bar = 0;
        p = bar + 1;
    }
    return n;
}

static int thresholds(char *list, int64_t *thr)
{
    int n = 0;
    char *t = strtok(list, ",");
    while (t && n < OP_MAX_LEVELS) {
        thr[n++] = strtoll(t, NULL, 10);
        t = strtok(NULL, ",");
    }
    return n;
}

int main(void)
{
    static const double le[] = {0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05};
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        char *f[MAXF];
        int n, k, bad = -1;
        line[strcspn(line, "\n")] = 0;
        n = split(line, f);
        if (!strcmp(f[0], "LEVELS")) {
            double thr[OP_MAX_LEVELS];
            op_parse_status st = op_parse_levels((const char *const *)f + 1, n - 1, thr, &bad);
            printf("%d %d", (int)st, bad);
            for (k = 0; st == OP_PARSE_OK && k < n - 1; k++) {
                printf(" %.17g", thr[k]);
            }
        }
        else if (!strcmp(f[0], "NICE")) {
            int nice[OP_MAX_LEVELS];
            op_parse_status st = op_parse_nice((const char *const *)f + 1, n - 1, nice, &bad);
            printf("%d %d", (int)st, bad);
            for (k = 0; st == OP_PARSE_OK && k < n - 1; k++) {
                printf(" %d", nice[k]);
            }
            if (st == OP_PARSE_ORDER) {
                printf(" %d", nice[bad]);
            }
        }
        else if (!strcmp(f[0], "SECONDS")) {
            double v = -1;
            int ok = op_parse_seconds(f[1], atof(f[2]), atof(f[3]), &v);
            printf(ok ? "ok %.17g" : "bad %g", v);
        }
        else if (!strcmp(f[0], "LONG")) {
            long v = -1;
            int ok = op_parse_long(f[1], atol(f[2]), atol(f[3]), &v);
            printf(ok ? "ok %ld" : "bad %ld", v);
        }
        else if (!strcmp(f[0], "CLASS")) {
            int v = -1;
            int ok = op_parse_class(f[1], atoi(f[2]), &v);
            printf(ok ? "ok %d" : "bad %d", v);
        }
        else if (!strcmp(f[0], "GATE")) {
            unsigned long slot, gen;
            uint8_t mac[OG_MAC_BYTES];
            if (op_parse_gate(f[1], &slot, &gen, mac)) {
                printf("ok %lu %lu ", slot, gen);
                for (k = 0; k < OG_MAC_BYTES; k++) {
                    printf("%02x", mac[k]);
                }
            }
            else {
                printf("bad");
            }
        }
        else if (!strcmp(f[0], "LEVELFOR")) {
            int64_t thr[OP_MAX_LEVELS];
            int m = thresholds(f[3], thr);
            printf("%d", op_level_for(strtoll(f[1], NULL, 10), atoi(f[2]), thr, m));
        }
        else if (!strcmp(f[0], "DUE")) {
            int64_t thr[OP_MAX_LEVELS];
            int m = thresholds(f[4], thr);
            printf("%lld", (long long)op_next_due(strtoll(f[1], NULL, 10), strtoll(f[2], NULL, 10),
                                                  atoi(f[3]), thr, m));
        }
        else if (!strcmp(f[0], "WAKE")) {
            printf("%lld", (long long)op_next_wake(strtoll(f[1], NULL, 10), strtoll(f[2], NULL, 10),
                                                   strtoll(f[3], NULL, 10), strtoll(f[4], NULL, 10)));
        }
        else if (!strcmp(f[0], "NICEVAL")) {
            printf("%d", op_level_nice(atoi(f[1]), atoi(f[2])));
        }
        else if (!strcmp(f[0], "BUCKET")) {
            printf("%u", op_bucket(strtoll(f[1], NULL, 10), le, 7));
        }
        else {
            printf("unknown command %s", f[0]);
        }
        printf("\n");
    }
    return 0;
}
"""

# op_parse_status
OK, EMPTY, TOO_MANY, RANGE, ORDER, IDLE_NOT_LAST = range(6)
IDLE = 100  # OP_NICE_IDLE


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_driver(tmp_path_factory.mktemp("op_pure"), DRIVER, ("op_pure.c",))


def test_levels_list(driver: Path) -> None:
    cases = {
        "LEVELS|0.005|0.05": f"{OK} 1 0.0050000000000000001 0.050000000000000003",
        "LEVELS|1": f"{OK} 0 1",
        "LEVELS|1e-3|2E-2|3600": f"{OK} 2 0.001 0.02 3600",
        "LEVELS": f"{EMPTY} 0",
        "LEVELS|" + "|".join(str(k + 1) for k in range(8)): f"{OK} 7 1 2 3 4 5 6 7 8",
        "LEVELS|" + "|".join(str(k + 1) for k in range(9)): f"{TOO_MANY} 0",
        "LEVELS|0.05|0.005": f"{ORDER} 1",   # unsorted
        "LEVELS|0.005|0.005": f"{ORDER} 1",  # strictly increasing
        "LEVELS|0": f"{ORDER} 0",            # > 0
        "LEVELS|0.005|-1": f"{RANGE} 1",
        "LEVELS|0.005|3600.5": f"{RANGE} 1",
        "LEVELS|1e999": f"{RANGE} 0",        # overflow (ERANGE)
        "LEVELS|0.005x": f"{RANGE} 0",       # trailing characters
        "LEVELS|0.005|": f"{RANGE} 1",       # an empty word
        "LEVELS|nan": f"{RANGE} 0",
        "LEVELS|0.001|0.002|0.003|0.0025": f"{ORDER} 3",
    }
    assert dict(zip(cases, run_driver(driver, list(cases)), strict=True)) == cases


def test_nice_list_with_idle(driver: Path) -> None:
    cases = {
        "NICE|10|idle": f"{OK} 1 10 {IDLE}",
        "NICE|IDLE": f"{OK} 0 {IDLE}",
        "NICE|1|19": f"{OK} 1 1 19",
        "NICE|5|5|idle": f"{OK} 2 5 5 {IDLE}",  # equal levels are allowed
        "NICE": f"{EMPTY} 0",
        "NICE|" + "|".join(["1"] * 9): f"{TOO_MANY} 0",
        "NICE|idle|10": f"{IDLE_NOT_LAST} 1",
        "NICE|idle|idle": f"{IDLE_NOT_LAST} 1",
        "NICE|10|5": f"{ORDER} 1 5",          # rises in priority: the refused value is reported
        "NICE|0": f"{RANGE} 0",
        "NICE|20": f"{RANGE} 0",
        "NICE|10|-3": f"{RANGE} 1",
        "NICE|10x": f"{RANGE} 0",
        "NICE|99999999999999999999": f"{RANGE} 0",  # overflow (ERANGE)
        "NICE|10.5": f"{RANGE} 0",
        "NICE|idler": f"{RANGE} 0",
    }
    assert dict(zip(cases, run_driver(driver, list(cases)), strict=True)) == cases


def test_seconds_and_integers(driver: Path) -> None:
    cases = {
        "SECONDS|0.0001|0.0001|1": "ok 0.0001",   # OvertakePrioInterval's bounds are inclusive
        "SECONDS|1|0.0001|1": "ok 1",
        "SECONDS|0.00009|0.0001|1": "bad -1",
        "SECONDS|1.0000001|0.0001|1": "bad -1",
        "SECONDS|0|0|0.1": "ok 0",
        "SECONDS| 0.5|0|1": "ok 0.5",             # strtod skips leading blanks
        "SECONDS|0.5 |0|1": "bad -1",             # but nothing may follow
        "SECONDS||0|1": "bad -1",
        "SECONDS|1e-400|0|1": "bad -1",           # underflow is ERANGE too
        "SECONDS|inf|0|1": "bad -1",
        "LONG|20|0|40": "ok 20",
        "LONG|41|0|40": "bad -1",
        "LONG|-1|0|40": "bad -1",
        "LONG|0x10|0|40": "bad -1",
        "LONG|9223372036854775808|0|40": "bad -1",
    }
    assert dict(zip(cases, run_driver(driver, list(cases)), strict=True)) == cases


def test_class_header(driver: Path) -> None:
    cases = {
        "CLASS|0|2": "ok 0",
        "CLASS|2|2": "ok 2",
        "CLASS|3|2": "bad -1",
        "CLASS|-1|2": "bad -1",
        "CLASS|1 \t |2": "ok 1",      # blanks after the level
        "CLASS| 1|2": "ok 1",
        "CLASS|1x|2": "bad -1",
        "CLASS||2": "bad -1",
        "CLASS|99999999999999999999|2": "bad -1",
    }
    assert dict(zip(cases, run_driver(driver, list(cases)), strict=True)) == cases


def test_gate_header(driver: Path) -> None:
    mac = "00112233445566778899aabbccddeeff"
    cases = {
        f"GATE|3 17 {mac}": f"ok 3 17 {mac}",
        f"GATE|0 0 {mac.upper()}": f"ok 0 0 {mac}",
        f"GATE|0 1073741823 {mac}": f"ok 0 1073741823 {mac}",   # the largest generation
        f"GATE|0 1073741824 {mac}": "bad",
        f"GATE|99999999999999999999999 1 {mac}": "bad",          # overflow
        f"GATE|3 17 {mac}0": "bad",                              # trailing characters
        f"GATE|3 17 {mac[:-1]}": "bad",
        f"GATE|3 17 {mac[:-1]}g": "bad",
        f"GATE|3 17  {mac}": "bad",
        f"GATE| 3 17 {mac}": "bad",
        f"GATE|-3 17 {mac}": "bad",
        f"GATE|3 -17 {mac}": "bad",
        f"GATE|3 +17 {mac}": "bad",
        "GATE|3 17": "bad",
        "GATE|": "bad",
    }
    assert dict(zip(cases, run_driver(driver, list(cases)), strict=True)) == cases


def test_level_for_attained_cpu(driver: Path) -> None:
    thr = [5_000_000, 50_000_000]
    t = ",".join(map(str, thr))
    cases = {
        f"LEVELFOR|0|0|{t}": "0",
        f"LEVELFOR|4999999|0|{t}": "0",
        f"LEVELFOR|5000000|0|{t}": "1",     # at the threshold: crossed
        f"LEVELFOR|49999999|0|{t}": "1",
        f"LEVELFOR|50000000|0|{t}": "2",
        f"LEVELFOR|{INT64_MAX}|0|{t}": "2",
        f"LEVELFOR|0|1|{t}": "1",           # never back up
        f"LEVELFOR|60000000|2|{t}": "2",
        f"LEVELFOR|-5|0|{t}": "0",
        "LEVELFOR|10|0|": "0",              # no level
    }
    assert dict(zip(cases, run_driver(driver, list(cases)), strict=True)) == cases


def test_level_for_agrees_with_bisect(driver: Path) -> None:
    rng = random.Random(7)
    lines, want = [], []
    for _ in range(300):
        thr = sorted(rng.sample(range(1, 10_000), rng.randint(1, 8)))
        cpu = rng.randint(-10, 11_000)
        start = rng.randint(0, len(thr))
        lines.append(f"LEVELFOR|{cpu}|{start}|{','.join(map(str, thr))}")
        want.append(str(max(start, bisect.bisect_right(thr, cpu))))
    assert run_driver(driver, lines) == want


def test_next_due_and_wake(driver: Path) -> None:
    t = "5000000,50000000"
    cases = {
        f"DUE|1000|0|0|{t}": "5001000",
        f"DUE|1000|2000000|0|{t}": "3001000",     # attained CPU counts
        f"DUE|1000|7000000|1|{t}": "43001000",
        f"DUE|1000|7000000|0|{t}": "-1999000",    # already crossed: due now (in the past)
        f"DUE|1000|0|2|{t}": str(INT64_MAX),      # the last level: never
        "DUE|1000|0|0|": str(INT64_MAX),          # no level
        f"DUE|{INT64_MAX - 10}|0|0|{t}": str(INT64_MAX),  # overflow saturates
        f"DUE|{-INT64_MAX}|0|0|{t}": str(-INT64_MAX + 5_000_000),
        # the monitor: soonest due, at most horizon ahead, at least period ahead
        "WAKE|1000|2000|5000|100": "2000",
        "WAKE|1000|9000|5000|100": "6000",
        "WAKE|1000|1050|5000|100": "1100",
        f"WAKE|1000|{INT64_MAX}|5000|100": "6000",
        "WAKE|1000|500|5000|100": "1100",         # overdue: one period from now
    }
    assert dict(zip(cases, run_driver(driver, list(cases)), strict=True)) == cases


def test_level_nice_and_late_buckets(driver: Path) -> None:
    cases = {
        "NICEVAL|0|10": "10",
        "NICEVAL|5|10": "15",
        "NICEVAL|15|10": "19",        # at most 19
        "NICEVAL|-20|19": "-1",
        f"NICEVAL|0|{IDLE}": str(IDLE),
        f"NICEVAL|10|{IDLE}": str(IDLE),
        "BUCKET|0": "0",
        "BUCKET|100000": "0",         # at the bound: in it
        "BUCKET|100001": "1",
        "BUCKET|1000000": "2",
        "BUCKET|50000000": "6",
        "BUCKET|50000001": "7",       # above every bound
        "BUCKET|-5": "0",
    }
    assert dict(zip(cases, run_driver(driver, list(cases)), strict=True)) == cases
