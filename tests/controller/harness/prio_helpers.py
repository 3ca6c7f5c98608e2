"""Helpers the mod_overtake_prio tests share: a config test of directives, a gcc-built driver
of the module's pure parts, and the requests ended since a status reading."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from overtake.controller.harness.apache.config import APACHE_BIN, MODULES_DIR
from overtake.controller.harness.apache.cpu_priority import PrioStatus
from overtake.controller.harness.scratch import free_port

MODULE_DIR = Path(__file__).resolve().parents[3] / "apache-conf" / "mod_overtake_prio"


def refusal(inst_workdir: str | Path, tmp_path: Path, directives: str) -> str:
    """What ``apache2 -t`` says refusing a minimal config that loads the instance's module and sets
    ``directives`` (fails the test if it accepts them)."""
    so = Path(inst_workdir) / "modules" / "mod_overtake_prio.so"
    conf = tmp_path / "t.conf"
    conf.write_text(
        f'ServerRoot "{tmp_path}"\nErrorLog "{tmp_path}/e.log"\nServerName localhost\n'
        f"Listen 127.0.0.1:{free_port()}\nLoadModule mpm_event_module "
        f"{MODULES_DIR}/mod_mpm_event.so\nLoadModule overtake_prio_module {so}\n"
        f"OvertakePrio On\n{directives}\n"
    )
    r = subprocess.run([APACHE_BIN, "-t", "-f", str(conf)], capture_output=True, text=True,
                       env={"PATH": "/usr/sbin:/usr/bin:/bin"}, check=False)
    assert r.returncode != 0, r.stdout + r.stderr
    return r.stderr + r.stdout


def build_driver(d: Path, source: str, c_files: tuple[str, ...]) -> Path:
    """Compile the driver ``source`` with the module's ``c_files`` (warnings fail), in ``d``."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed (apache-conf/install-debian-packages.sh installs it)")
    (d / "driver.c").write_text(source)
    exe = d / "driver"
    subprocess.run([gcc, "-O2", "-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wmissing-prototypes",
                    "-Werror", "-I", str(MODULE_DIR), "-o", str(exe), str(d / "driver.c"),
                    *(str(MODULE_DIR / f) for f in c_files)],
                   check=True, capture_output=True, text=True)
    return exe


def run_driver(exe: Path, lines: list[str]) -> list[str]:
    """Feed ``lines`` to the driver; its output lines."""
    out = subprocess.run([str(exe)], input="".join(line + "\n" for line in lines), capture_output=True,
                         text=True, check=True, timeout=60)
    return out.stdout.splitlines()


def ended_since(read: Callable[[], PrioStatus], before: PrioStatus, n: int,
                timeout: float = 10.0) -> tuple[PrioStatus, list[int]]:
    """The status after ``n`` requests sent since ``before`` have all been counted, and the ends
    by deepest level less the status requests'. A request that stays at level 0 is counted by its
    pool's cleanup, after its response has gone, so the next reading may come before it: read
    again until ``before``'s request, the ``n`` and every earlier reading are counted (each
    status request ends at level 0)."""
    reads = 0
    deadline = time.monotonic() + timeout
    while True:
        after = read()
        ended = [a - b for a, b in zip(after.requests, before.requests)]
        expected = n + 1 + reads  # + before's own request and the readings since
        if sum(ended) >= expected or time.monotonic() > deadline:
            ended[0] -= 1 + reads
            return after, ended
        reads += 1
        time.sleep(0.01)
