"""mod_overtake_prio's SIGBUS-safe load (``og_fault.h``), compiled with gcc, on a real tmpfs file.

Known answers: a load from a MAP_SHARED mapping of a file reads the word; after the file is
truncated under the mapping the same load reports failure instead of killing the process (in
the main thread and in a thread that had every other signal blocked, as the module's promoter);
growing the file back makes the load succeed again (zeros: the pages are new); a SIGBUS that is
not a guarded load still reaches the handler installed before (here one that exits 42) or, with
none, kills the process with SIGBUS, so the guard hides no other fault.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MODULE_DIR = REPO / "apache-conf" / "mod_overtake_prio"

DRIVER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#include "og_fault.h"

static uint32_t *word;

static void prev_handler(int sig) { (void)sig; _exit(42); }

static void *blocked_thread(void *arg)
{
    sigset_t all, bus;
    uint32_t v = 7;
    (void)arg;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, NULL);
    return (void *)(intptr_t)(og_load(word, &v) ? 1 : 0);
}

/* argv: FILE MODE; MODE guarded | unguarded | chained */
int main(int argc, char **argv)
{
    int fd = open(argv[1], O_RDWR | O_CREAT | O_TRUNC, 0600);
    uint32_t v = 0;
    int ok;
    void *ret;
    pthread_t t;
    (void)argc;
    if (fd < 0 || ftruncate(fd, 4096) != 0) {
        return 2;
    }
    word = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (word == MAP_FAILED) {
        return 2;
    }
    word[5] = 0x1234;
    if (!strcmp(argv[2], "chained")) {
        signal(SIGBUS, prev_handler);
    }
    if (!og_fault_install()) {
        return 2;
    }
    ok = og_load(&word[5], &v);
    printf("before %d %x\n", ok, v);
    if (ftruncate(fd, 0) != 0) {
        return 2;
    }
    printf("after %d\n", og_load(&word[5], &v));
    printf("again %d\n", og_load(&word[5], &v));
    pthread_create(&t, NULL, blocked_thread, NULL);
    pthread_join(t, &ret);
    printf("thread %d\n", (int)(intptr_t)ret);
    if (ftruncate(fd, 4096) != 0) {
        return 2;
    }
    v = 9;
    ok = og_load(&word[5], &v);
    printf("regrown %d %x\n", ok, v);
    fflush(stdout);
    if (ftruncate(fd, 0) != 0) {
        return 2;
    }
    if (strcmp(argv[2], "guarded")) {
        volatile uint32_t x = word[5];  /* not through og_load: must not be swallowed */
        (void)x;
        printf("swallowed\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed (apache-conf/install-debian-packages.sh installs it)")
    d = tmp_path_factory.mktemp("og_fault")
    (d / "driver.c").write_text(DRIVER)
    exe = d / "driver"
    subprocess.run([gcc, "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-I", str(MODULE_DIR), "-o", str(exe),
                    str(d / "driver.c")], check=True, capture_output=True, text=True)
    return exe


def _run(exe: Path, mode: str) -> subprocess.CompletedProcess[str]:
    shm = Path("/dev/shm")
    where = shm if shm.is_dir() else exe.parent
    f = where / f"og-fault-test-{mode}-{exe.stat().st_ino}"
    try:
        return subprocess.run([str(exe), str(f), mode], capture_output=True, text=True, timeout=60)
    finally:
        f.unlink(missing_ok=True)


def test_a_truncated_mapping_fails_the_load_instead_of_the_process(driver: Path) -> None:
    r = _run(driver, "guarded")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.split("\n")[:5] == ["before 1 1234", "after 0", "again 0", "thread 0", "regrown 1 0"]


def test_other_faults_still_reach_the_previous_handler(driver: Path) -> None:
    r = _run(driver, "chained")
    assert r.returncode == 42 and "swallowed" not in r.stdout, (r.returncode, r.stdout)


def test_other_faults_still_kill_without_a_previous_handler(driver: Path) -> None:
    r = _run(driver, "unguarded")
    assert r.returncode == -signal.SIGBUS and "swallowed" not in r.stdout, (r.returncode, r.stdout)
