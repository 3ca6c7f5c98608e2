"""Shared by the bench scripts: the machine line and BENCHMARKS.md's marked sections.

Each script owns one section between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` and
rewrites only that, so scripts run at different times never overwrite each other's figures.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """One line: cores, CPU, Python, and the load average now (the machine is shared)."""
    return (f"{os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f}")


def write_section(name: str, text: str, path: Path = BENCHMARKS) -> None:
    """Replace (or append) the section ``name`` of BENCHMARKS.md with ``text``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    cur = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in cur and end in cur:
        cur = cur[: cur.index(begin)] + block + cur[cur.index(end) + len(end):]
    else:
        cur = cur.rstrip() + "\n\n" + block + "\n"
    path.write_text(cur)
